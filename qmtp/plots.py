"""Figures for the chapters and the model card, in one style (only notebooks and the card import this)."""

from __future__ import annotations

import matplotlib.pyplot as plt

STYLE = {
    "figure.figsize": (7.0, 3.6),
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "font.size": 10,
}
plt.rcParams.update(STYLE)


def loss_curve(history: list[dict]):
    """Training losses (trunk, head) per step, with the held-out probe where it was measured."""
    fig, ax = plt.subplots()
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["trunk"] for r in history], lw=0.8, alpha=0.6, label="trunk (train)")
    ax.plot(steps, [r["head"] for r in history], lw=0.8, alpha=0.6, label="MTP head (train)")
    probe = [r for r in history if "heldout_trunk" in r]
    if probe:
        ax.plot([r["step"] for r in probe], [r["heldout_trunk"] for r in probe], "o-", ms=3, label="trunk (held-out)")
        ax.plot([r["step"] for r in probe], [r["heldout_head"] for r in probe], "s-", ms=3, label="MTP head (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False)
    return fig


def layer_pattern(config, title: str | None = None):
    """The stack drawn bottom to top: linear / full attention per layer, each with its MoE, then the head."""
    from matplotlib.patches import Rectangle

    kinds = list(config.layer_types) + (["mtp"] if config.has_mtp else [])
    colours = {"linear_attention": "#4C78A8", "full_attention": "#F58518", "mtp": "#54A24B"}
    labels = {"linear_attention": "gated DeltaNet", "full_attention": "gated attention", "mtp": "MTP head (full attention)"}
    # Half-inch cells while they fit the page; a real 40-layer stack gets narrower cells and a label every
    # fourth layer, which is the period of the pattern.
    cell = min(0.5, 6.0 / len(kinds))
    every = 1 if cell >= 0.3 else 4
    fig, ax = plt.subplots(figsize=(cell * len(kinds) + 1.4, 2.0), layout="constrained")
    for i, kind in enumerate(kinds):
        ax.add_patch(Rectangle((i + 0.05, 1.05), 0.9, 0.9, color=colours[kind]))
        ax.add_patch(Rectangle((i + 0.05, 0.0), 0.9, 0.9, color="#B0B0B0"))
    ax.set_xlim(0, len(kinds))
    ax.set_ylim(-0.05, 2.0)
    ticks = [i for i, k in enumerate(kinds) if k == "mtp" or i % every == 0]
    ax.set_xticks([i + 0.5 for i in ticks], [str(i) if kinds[i] != "mtp" else "mtp" for i in ticks])
    ax.set_xlabel("layer")
    ax.set_yticks([1.5, 0.45], ["mixer", f"MoE {config.num_experts}\ntop-{config.num_experts_per_tok}"])
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, color=colours[k]) for k in colours if k in kinds]
    fig.legend(handles, [labels[k] for k in colours if k in kinds], loc="outside upper center", ncol=3,
               frameon=False, handlelength=1.2, columnspacing=1.2)
    if title:
        ax.set_title(title)
    return fig


ACCEPTED, REJECTED, TRUNK = "#54A24B", "#E45756", "#4C78A8"


def speculative_steps(generation, tokenizer, max_steps: int = 12):
    """One row per trunk pass: accepted drafts (green), the first rejected draft (red, struck out), and the
    trunk's own token (blue) that every pass adds."""
    steps = generation.stats.steps[:max_steps]
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(steps) + 0.6))
    for row, step in enumerate(steps):
        x = 0.0
        pieces = [(d, ACCEPTED) for d in step.drafts[: step.accepted]]
        if step.accepted < len(step.drafts):
            pieces.append((step.drafts[step.accepted], REJECTED))
        pieces.append((step.emitted[-1], TRUNK))
        for token, colour in pieces:
            text = repr(tokenizer.decode([token]))[1:-1] or " "
            width = 0.12 + 0.075 * len(text)
            ax.text(x, -row, text, color="white", fontsize=8, family="monospace", va="center",
                    bbox=dict(boxstyle="round,pad=0.25", fc=colour, ec="none"))
            x += width + 0.08
    ax.set_xlim(-0.1, 8)
    ax.set_ylim(-len(steps) + 0.4, 0.8)
    ax.set_yticks([-r for r in range(len(steps))])
    ax.set_yticklabels([f"pass {r + 1}" for r in range(len(steps))], fontsize=8)
    ax.set_xticks([])
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (ACCEPTED, REJECTED, TRUNK)]
    ax.legend(handles, ["draft accepted", "draft rejected", "trunk's own token"], ncol=3, frameon=False,
              loc="upper center", bbox_to_anchor=(0.45, 0.0), fontsize=8)
    ax.set_title(f"after the prompt {tokenizer.decode(generation.prompt_tokens)!r}", fontsize=9, loc="left")
    return fig


def acceptance_by_position(results: dict):
    """results: n_draft -> acceptance dict (as qmtp.evaluate.acceptance returns). Two panels: acceptance
    per draft position for each n_draft, and tokens per trunk pass."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    for n, r in results.items():
        left.plot(range(1, len(r["per_position"]) + 1), r["per_position"], "o-", label=f"n_draft={n}")
    left.set_xlabel("draft position")
    left.set_xticks(range(1, max(len(r["per_position"]) for r in results.values()) + 1))
    left.set_ylabel("acceptance")
    left.set_ylim(0, 1)
    left.legend(frameon=False, fontsize=8)
    ns = list(results)
    right.bar([str(n) for n in ns], [results[n]["tokens_per_trunk_pass"] for n in ns], color=TRUNK)
    right.set_xlabel("n_draft")
    right.set_ylabel("tokens per trunk pass")
    fig.tight_layout()
    return fig


def bars(labels, values, ylabel: str, colour: str = TRUNK, ylim=(0, 1)):
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(labels, values, color=colour)
    for i, v in enumerate(values):
        ax.text(i, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    return fig


def bit_packing(bits: int, n_codes: int = 16):
    """How `n_codes` codes of `bits` bits fill little-endian uint32 words: one colour and number per code,
    bit 0 of each word on the right as in the integer; a code that crosses a word boundary shows in both
    words, its low bits at the left end of one word ("lo") and its high bits at the right end of the next."""
    from matplotlib.patches import Rectangle

    words = (n_codes * bits + 31) // 32
    # 32 bits across 7.6 inches leaves a bit ~21 px wide in the book, room for a two-digit number at 10 pt.
    fig, ax = plt.subplots(figsize=(7.6, 0.45 * words + 1.0), layout="constrained")
    light = plt.get_cmap("tab20").colors[1::2]  # the pale half, so that the numbers can be dark
    for word in range(words):
        pieces = []  # (code, first column, last column) of each run of one code in this word
        for bit in range(32):
            code = (word * 32 + bit) // bits
            if code >= n_codes:
                continue
            x = 31 - bit
            # one cell per bit, white-edged, so that the bits of a code can be counted
            ax.add_patch(Rectangle((x, -word), 1, 0.8, facecolor=light[code % len(light)], edgecolor="white", lw=1))
            if pieces and pieces[-1][0] == code:
                pieces[-1][1] = x
            else:
                pieces.append([code, x, x])
        for code, left, right in pieces:
            label = str(code)
            span = right - left + 1
            if span < bits and span >= 2:
                # a code cut by the word boundary: its low bits end this word, its high bits start the next
                label += " lo" if (word * 32 + 31) // bits == code else " hi"
            ax.text((left + right + 1) / 2, -word + 0.4, label, ha="center", va="center", color="#1a1a1a")
    ax.set_xlim(0, 32)
    ax.set_ylim(-words + 0.9, 0.9)
    ax.set_yticks([-w + 0.4 for w in range(words)], [f"word {w}" for w in range(words)])
    ax.set_xticks([31 - b + 0.5 for b in (31, 24, 16, 8, 0)], ["31", "24", "16", "8", "0"])
    ax.set_xlabel("bit of the word")
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{bits}-bit codes packed into uint32 words, numbered in stream order", fontsize=10)
    return fig


def width_curves(by_width: dict, xlabel: str):
    """Perplexity and acceptance against width (dict width -> metrics from qmtp.quality)."""
    labels = [str(w) for w in by_width]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
    left.plot(labels, [m["perplexity"] for m in by_width.values()], "o-", color=TRUNK)
    left.set_ylabel("held-out perplexity")
    left.set_xlabel(xlabel)
    right.plot(labels, [m["acceptance_n_draft_2"] for m in by_width.values()], "o-", color=ACCEPTED)
    right.set_ylabel("acceptance at n_draft=2")
    right.set_xlabel(xlabel)
    right.set_ylim(0, 1)
    fig.tight_layout()
    return fig


def expert_union(report: dict, n_experts: int, top_k: int):
    """Distinct experts a verify pass read per layer (dots, one per layer) against the independent-routing
    formula E(1-(1-k/E)^n) (line) and the no-sharing bound n*k (dashed), for each n_draft of `qmtp.bench.mtp`."""
    from .throughput import expected_union

    fig, ax = plt.subplots()
    ns = [r["n_draft"] for r in report["results"]]
    for r in report["results"]:
        layers = r["experts_per_layer_measured"]
        offsets = [(i - (len(layers) - 1) / 2) * 0.03 for i in range(len(layers))]
        ax.plot([r["n_draft"] + o for o in offsets], layers, "o", ms=4, color=TRUNK, alpha=0.7,
                label="measured, one dot per layer" if r is report["results"][0] else None)
    grid = [1 + i / 20 for i in range(20 * (max(ns) - 1) + 1)]
    ax.plot(grid, [expected_union(n_experts, top_k, n) for n in grid], color=REJECTED,
            label="independent routing: E(1-(1-k/E)^n)")
    ax.plot(ns, [top_k * n for n in ns], "--", color="#888888", lw=0.8, label="no expert shared: n k")
    ax.set_xticks(ns)
    ax.set_xlabel("tokens in the verify pass (n_draft)")
    ax.set_ylabel("distinct experts read per layer")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def predicted_speedups(rows: list[dict], claimed: tuple | None = None):
    """Predicted speedup over plain decoding against n_draft (rows of `qmtp.throughput.real_model_table`): one
    line per (model, width); the band `claimed` (low, high) marks reported speedups."""
    fig, ax = plt.subplots()
    styles = {"MoE": "-", "dense, same active size": "--"}
    widths = sorted({r["bits"] for r in rows})
    colours = dict(zip(widths, (TRUNK, "#F58518", ACCEPTED, REJECTED)))
    for model in styles:
        for bits in widths:
            line = [r for r in rows if r["model"] == model and r["bits"] == bits]
            ax.plot([r["n_draft"] for r in line], [r["speedup"] for r in line], styles[model], marker="o", ms=3,
                    color=colours[bits], label=f"{model}, {bits}-bit")
    if claimed:
        ax.axhspan(*claimed, color="#B0B0B0", alpha=0.3, lw=0, label="reported for A3B MoE models")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(sorted({r["n_draft"] for r in rows}))
    ax.set_xlabel("n_draft")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def measured_vs_predicted(report: dict):
    """The tiny model: measured speedup per n_draft (bars, min-max of the rounds as whiskers) beside the cost
    model's prediction from its fitted overhead and bandwidth (dots), from `qmtp.bench.mtp`."""
    results = report["results"]
    predictions = {p["n_draft"]: p for p in report["cost_model"]["predictions"]}
    plain = next(r for r in results if r["n_draft"] == 1)
    ns = [r["n_draft"] for r in results]
    measured = [r["speedup_vs_plain"] for r in results]
    low = [m - r["tokens_per_second_min"] / plain["tokens_per_second"] for m, r in zip(measured, results)]
    high = [r["tokens_per_second_max"] / plain["tokens_per_second"] - m for m, r in zip(measured, results)]
    fig, ax = plt.subplots()
    ax.bar(ns, measured, color=TRUNK, alpha=0.8, yerr=[[max(0, v) for v in low], [max(0, v) for v in high]],
           capsize=3, label="measured")
    ax.plot(ns, [predictions[n]["predicted_speedup"] for n in ns], "o", color=REJECTED, label="cost model (fitted)")
    ax.plot(ns, [predictions[n]["tokens_per_pass"] for n in ns], "_", ms=18, color="#888888",
            label="tokens per pass (the ceiling)")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(ns)
    ax.set_xlabel("n_draft")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def bytes_per_pass(breakdowns: dict[str, dict[str, float]], unit: float = 1e9, unit_name: str = "GB"):
    """Stacked bars: what one pass reads, by term (dict label -> `qmtp.throughput` breakdown)."""
    fig, ax = plt.subplots()
    terms = []
    for b in breakdowns.values():
        terms += [t for t in b if t not in terms]
    cmap = plt.get_cmap("tab20")
    bottoms = [0.0] * len(breakdowns)
    for i, term in enumerate(terms):
        values = [b.get(term, 0.0) / unit for b in breakdowns.values()]
        ax.bar(list(breakdowns), values, bottom=bottoms, color=cmap(i % 20), label=term)
        bottoms = [a + v for a, v in zip(bottoms, values)]
    ax.set_ylabel(f"{unit_name} read per pass")
    ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
