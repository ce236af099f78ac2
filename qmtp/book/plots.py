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

from ..tiny.figures import loss_curve  # noqa: E402,F401  (the card draws it; `tiny` never imports `book`)


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


def shown_passes(generation) -> list[tuple[list[int], int | None, int | None]]:
    """Per trunk pass: (drafts accepted, the draft rejected or None, the trunk's own token or None), cut
    where the generation's tokens end: its last pass may have computed tokens past `max_tokens` or the end
    of text, which the generation drops and the pictures of it should too."""
    left = len(generation.tokens) - 1  # the prefill chose the first
    passes = []
    for step in generation.stats.steps:
        if left <= 0:
            break
        accepted = list(step.drafts[: step.accepted])[:left]
        left -= len(accepted)
        rejected = step.drafts[step.accepted] if step.accepted < len(step.drafts) and left > 0 else None
        trunk = step.emitted[-1] if left > 0 else None
        left -= trunk is not None
        passes.append((accepted, rejected, trunk))
    return passes


def speculative_steps(generation, tokenizer, max_steps: int | None = 24):
    """The generation as the explorer widget replays it, one row per trunk pass: first the token the prefill
    chose (blue), then for each verify pass the drafts the trunk accepted (green), the first one it rejected
    (red, struck out) and the trunk's own token (blue). Passes beyond `max_steps` (None: no limit) are
    counted in a last row rather than dropped silently."""
    from matplotlib.patches import FancyBboxPatch

    steps = shown_passes(generation)
    shown = steps if max_steps is None else steps[:max_steps]
    rows = [("prefill", [(generation.tokens[0], TRUNK)])]
    for i, (accepted, rejected, trunk) in enumerate(shown, 1):
        pieces = [(d, ACCEPTED) for d in accepted]
        if rejected is not None:
            pieces.append((rejected, REJECTED))
        if trunk is not None:
            pieces.append((trunk, TRUNK))
        rows.append((f"pass {i}", pieces))
    hidden = len(steps) - len(shown)
    note = f"... {hidden} more passes, not drawn (max_steps={max_steps})" if hidden else None

    # Laid out in inches, one data unit to the inch, so that the figure is as wide as its longest row: a
    # box's width follows from its characters in DejaVu Sans Mono (bundled with matplotlib), 0.602 em each.
    size = 10
    char, pad, gap, pitch, height = 0.602 * size / 72, 0.05, 0.06, 0.3, 0.23
    boxes, widest = [], 0.0  # (row, x, width, text, colour)
    for row, (_, pieces) in enumerate(rows):
        x = 0.0
        for token, colour in pieces:
            text = repr(tokenizer.decode([token]))[1:-1] or " "
            width = len(text) * char + 2 * pad
            boxes.append((row, x, width, text, colour))
            x += width + gap
        widest = max(widest, x)
    if note:
        widest = max(widest, 0.062 * len(note))  # its proportional font averages ~0.062 in a character
    n_rows = len(rows) + bool(note)
    left, right, top, bottom = 0.75, 1.9, 0.4, 0.15  # labels, legend, title
    fig_w, fig_h = left + widest + right, top + n_rows * pitch + bottom
    fig = plt.figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes((left / fig_w, bottom / fig_h, widest / fig_w, n_rows * pitch / fig_h))
    for row, x, width, text, colour in boxes:
        y = -row * pitch
        ax.add_patch(FancyBboxPatch((x, y - height / 2), width, height, boxstyle="round,pad=0,rounding_size=0.04",
                                    fc=colour, ec="none"))
        ax.text(x + width / 2, y, text, ha="center", va="center_baseline", family="DejaVu Sans Mono",
                fontsize=size, color="white", fontweight="bold")
        if colour == REJECTED:
            ax.plot([x + pad, x + width - pad], [y, y], color="white", lw=1.2)
    if note:
        ax.text(0, -len(rows) * pitch, note, va="center", style="italic", color="#555555")
    ax.set_xlim(0, widest)
    ax.set_ylim(-(n_rows - 0.5) * pitch, pitch / 2)
    ax.set_yticks([-r * pitch for r in range(n_rows)], [label for label, _ in rows] + [""] * bool(note))
    ax.set_xticks([])
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (ACCEPTED, REJECTED, TRUNK)]
    ax.legend(handles, ["draft accepted", "draft rejected", "trunk's own token"], frameon=False,
              loc="upper left", bbox_to_anchor=(1.02, 1.0), handlelength=1.2)
    ax.set_title(f"after the prompt {tokenizer.decode(generation.prompt_tokens)!r}", fontsize=size, loc="left")
    return fig


def acceptance_by_position(results: dict):
    """results: n_draft -> acceptance dict (as qmtp.book.evaluate.acceptance returns). Two panels: acceptance
    per draft position for each n_draft, and tokens per trunk pass."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.4, 3.2), layout="constrained", width_ratios=(3, 2))
    ns = list(results)
    # Acceptance at a position hardly depends on n_draft, so the runs' points nearly coincide: each n_draft is
    # nudged sideways and drawn with its own marker and dash, hollow, so that the ones underneath still show.
    markers, dashes = "osD^v<>p", ["-", "--", "-.", ":"]
    for i, n in enumerate(ns):
        per_position = results[n]["per_position"]
        nudge = (i - (len(ns) - 1) / 2) * 0.1
        left.plot([p + 1 + nudge for p in range(len(per_position))], per_position, color=f"C{i}",
                  marker=markers[i % len(markers)], ls=dashes[i % len(dashes)], ms=6, mfc="white", mew=1.5,
                  label=f"n_draft={n}")
    left.set_xlabel("draft position")
    left.set_xticks(range(1, max(len(r["per_position"]) for r in results.values()) + 1))
    left.set_ylabel("acceptance (share of proposals kept)")
    left.set_ylim(0, 1)
    left.legend(frameon=False)  # "best": wherever the lines are not
    tokens = [results[n]["tokens_per_trunk_pass"] for n in ns]
    right.bar([str(n) for n in ns], tokens, color=TRUNK)
    for i, v in enumerate(tokens):
        right.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    right.set_ylim(0, 1.12 * max(tokens))  # room for the numbers above the bars
    right.set_xlabel("n_draft")
    right.set_ylabel("tokens per trunk pass")
    right.grid(axis="x", visible=False)
    return fig


def bars(labels, values, ylabel: str, colour: str = TRUNK, ylim=(0, 1), xlabel: str | None = None):
    """One bar per label, its value written above it; one colour, so no legend."""
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(labels, values, color=colour)
    for i, v in enumerate(values):
        ax.text(i, v + 0.01, f"{v:.2f}", ha="center", fontsize=10)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
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
    # 32 bits across 7.4 inches leaves a bit ~20 px wide in the book, room for a two-digit number at 10 pt.
    fig, ax = plt.subplots(figsize=(7.4, 0.45 * words + 1.0), layout="constrained")
    light = plt.get_cmap("tab20").colors[1::2]  # the pale half, so that the numbers can be dark
    split = False
    for word in range(words):
        pieces = []  # [code, leftmost column, rightmost column] of each run of one code in this word
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
            if 2 <= span < bits:
                # a code cut by the word boundary: its low bits end this word, its high bits start the next
                label += " lo" if (word * 32 + 31) // bits == code else " hi"
                split = True
            # the label's background hides the bit edges it would otherwise be crossed by
            ax.text((left + right + 1) / 2, -word + 0.4, label, ha="center", va="center", color="#1a1a1a",
                    bbox=dict(boxstyle="square,pad=0.1", fc=light[code % len(light)], ec="none"))
    ax.set_xlim(0, 32)
    ax.set_ylim(-words + 0.9, 0.9)
    ax.set_yticks([-w + 0.4 for w in range(words)], [f"word {w}" for w in range(words)])
    ax.set_xticks([31 - b + 0.5 for b in (31, 24, 16, 8, 0)], ["31", "24", "16", "8", "0"])
    ax.set_xlabel("bit of the word")
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    title = f"{bits}-bit codes packed into uint32 words, numbered in stream order"
    if split:
        title += "\nlo, hi: the low and the high bits of a code cut by a word boundary"
    ax.set_title(title, fontsize=10)
    return fig


def width_curves(by_width: dict, xlabel: str):
    """Perplexity and acceptance against width (dict width -> metrics from qmtp.book.quality)."""
    labels = [str(w) for w in by_width]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.4, 3))
    left.plot(labels, [m["perplexity"] for m in by_width.values()], "o-", color=TRUNK)
    left.set_ylabel("held-out perplexity (trunk)")
    left.set_xlabel(xlabel)
    right.plot(labels, [m["acceptance_n_draft_2"] for m in by_width.values()], "o-", color=ACCEPTED)
    right.set_ylabel("acceptance at n_draft=2 (share kept)")
    right.set_xlabel(xlabel)
    right.set_ylim(0, 1)
    fig.tight_layout()
    return fig


def expert_union(report: dict, n_experts: int, top_k: int):
    """Distinct experts a verify pass read per layer (dots, one per layer) against the independent-routing
    formula E(1-(1-k/E)^n) (line) and the no-sharing bound n*k (dashed), for each n_draft of `qmtp.book.bench.mtp`."""
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
    ax.legend(frameon=False, fontsize=10)
    fig.tight_layout()
    return fig


def predicted_speedups(rows: list[dict], claimed: tuple | None = None):
    """Predicted speedup over plain decoding against n_draft (rows of `qmtp.book.throughput.real_model_table`): one
    line per (model, width); the band `claimed` (low, high) marks the speedups a claim summarises (lemon-mlx-engine's
    card)."""
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
        ax.axhspan(*claimed, color="#B0B0B0", alpha=0.3, lw=0, label="lemon-mlx-engine card's summary for A3B MoE")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(sorted({r["n_draft"] for r in rows}))
    ax.set_xlabel("n_draft")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def measured_vs_predicted(report: dict):
    """The tiny model: measured speedup per n_draft (bars, min-max of the rounds as whiskers) beside the loop
    model's prediction (dots) and the bytes model's (crosses), from `qmtp.book.bench.mtp`'s "cost_model"."""
    results = report["results"]
    predictions = {p["n_draft"]: p for p in report["cost_model"]["predictions"]}
    plain = next(r for r in results if r["n_draft"] == 1)
    ns = [r["n_draft"] for r in results]
    measured = [r["speedup_vs_plain"] for r in results]
    low = [m - r["tokens_per_second_min"] / plain["tokens_per_second"] for m, r in zip(measured, results)]
    high = [r["tokens_per_second_max"] / plain["tokens_per_second"] - m for m, r in zip(measured, results)]
    fig, ax = plt.subplots()
    ax.bar(ns, measured, color=TRUNK, alpha=0.8, yerr=[[max(0, v) for v in low], [max(0, v) for v in high]],
           capsize=3, label="measured (median round;\nwhiskers: slowest, fastest)")
    ax.plot(ns, [predictions[n]["predicted_speedup"] for n in ns], "o", color=REJECTED,
            label="loop model (tokens)")
    by_bytes = [predictions[n].get("bytes_model_speedup", float("nan")) for n in ns]
    if any(b == b for b in by_bytes):  # not all NaN
        ax.plot(ns, by_bytes, "x", color="#555555", label="bytes model")
    ax.plot(ns, [predictions[n]["tokens_per_pass"] for n in ns], "_", ms=18, color="#888888",
            label="tokens per pass (the ceiling)")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(ns)
    ax.set_xlabel("n_draft")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def bytes_per_pass(breakdowns: dict[str, dict[str, float]], unit: float = 1e9, unit_name: str = "GB",
                   other_below: float = 0.01):
    """Stacked bars: what one pass reads, by term (dict label -> `qmtp.book.throughput` breakdown), its total on
    top. Terms below `other_below` of the largest total in every pass (too thin to see) are summed into one
    "other" segment whose legend entry names them."""
    import textwrap

    terms = []
    for b in breakdowns.values():
        terms += [t for t in b if t not in terms]
    totals = [sum(b.values()) / unit for b in breakdowns.values()]
    floor = other_below * max(totals) * unit
    small = [t for t in terms if all(b.get(t, 0.0) < floor for b in breakdowns.values())]
    segments = {t: [b.get(t, 0.0) / unit for b in breakdowns.values()] for t in terms if t not in small}
    colours = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(segments)}
    if small:
        label = f"other (each < {100 * other_below:g}% of the tallest bar): " + ", ".join(small)
        segments[label] = [sum(b.get(t, 0.0) for t in small) / unit for b in breakdowns.values()]
        colours[label] = "#B0B0B0"

    fig, ax = plt.subplots(figsize=(7.4, 3.6), layout="constrained")
    bottoms = [0.0] * len(breakdowns)
    handles = []
    for term, values in segments.items():
        handles.append(ax.bar(list(breakdowns), values, bottom=bottoms, color=colours[term],
                              label=textwrap.fill(term, 30)))
        bottoms = [a + v for a, v in zip(bottoms, values)]
    for i, total in enumerate(totals):
        ax.text(i, total, f"{total:.2f}", ha="center", va="bottom")
    ax.set_ylim(0, 1.12 * max(totals))  # room for the totals above the tallest bar
    ax.set_ylabel(f"{unit_name} read per pass")
    ax.grid(axis="x", visible=False)
    # listed top to bottom as the segments are stacked
    fig.legend(handles[::-1], [h.get_label() for h in handles[::-1]], frameon=False, loc="outside right upper")
    return fig


def step_profile(report: dict):
    """Where one step of the decoding loop goes, per n_draft (`qmtp.book.bench.mtp`): the verify pass and the head's
    drafts, each timed alone, and the rest of the step in the loop (its mean time over every round, less those two),
    in ms per step."""
    results = report["results"]
    ns = [r["n_draft"] for r in results]
    verify = [r["trunk_seconds_per_pass"] * 1e3 for r in results]
    head = [(r["n_draft"] - 1) * r["head_seconds_per_draft"] * 1e3 for r in results]
    loop = [r["step_seconds_mean"] * 1e3 for r in results]
    rest = [max(0.0, s - v - h) for s, v, h in zip(loop, verify, head)]
    fig, ax = plt.subplots()
    ax.bar(ns, verify, color=TRUNK, label="verify pass (timed alone)")
    ax.bar(ns, head, bottom=verify, color=ACCEPTED, label="head drafts (timed alone)")
    ax.bar(ns, rest, bottom=[v + h for v, h in zip(verify, head)], color="#bbbbbb",
           label="rest of the step in the loop")
    ax.plot(ns, loop, "_", ms=22, color="black", label="step in the loop\n(mean over the rounds)")
    ax.set_xticks(ns)
    ax.set_xlabel("n_draft")
    ax.set_ylabel("ms per step")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def grouped_bars(labels, series: dict, ylabel: str, xlabel: str | None = None, ylim=(0, 1)):
    """Bars grouped by label, one colour per series (dict name -> values, NaN left empty), a legend naming the
    series and each value written above its bar."""
    import math

    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(series)
    colours = [TRUNK, ACCEPTED, REJECTED, "#888888"]
    for s, (name, values) in enumerate(series.items()):
        xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [0 if math.isnan(v) else v for v in values], width, color=colours[s % 4], label=name)
        for x, v in zip(xs, values):
            if not math.isnan(v):
                ax.text(x, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=9)  # wrap long labels before: they are not rotated
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend(frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(series))
    fig.tight_layout()
    return fig


def machines_scaling(rows: list[dict], memory: str):
    """Predicted tokens/s against the number of machines (rows of `qmtp.book.beyond.scaling_rows`) at one
    memory: per link, plain decoding (dashed) and the best n_draft (solid, its n_draft written by each point)."""
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    links = list(dict.fromkeys(r["link"] for r in rows if r["memory"] == memory))
    colours = (TRUNK, ACCEPTED, REJECTED, "#888888")
    for link, colour in zip(links, colours):
        line = [r for r in rows if r["memory"] == memory and r["link"] == link]
        ns = [r["ranks"] for r in line]
        ax.plot(ns, [r["plain tok/s"] for r in line], "--", marker="o", ms=3, color=colour, lw=1)
        ax.plot(ns, [r["best tok/s"] for r in line], "-", marker="o", ms=3, color=colour, label=link)
        for r in line:
            ax.annotate(str(r["best n_draft"]), (r["ranks"], r["best tok/s"]), textcoords="offset points",
                        xytext=(3, 4), fontsize=8, color=colour)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["ranks"] for r in rows}))
    ax.set_xticklabels([str(n) for n in sorted({r["ranks"] for r in rows})])
    ax.set_xlabel("machines (one rank each)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=9,
              title="solid: best n_draft, dashed: plain decoding", title_fontsize=9)
    fig.tight_layout()
    return fig


def norm_weight_histograms(weights: dict[str, list[float]]):
    """Two histograms side by side: the zero-centred norms' weights as stored (w) and as applied (1 + w)."""
    fig, axes = plt.subplots(1, 2, figsize=(7.4, 2.8), sharey=True, layout="constrained")
    for ax, key, title, xlabel, colour in (
            (axes[0], "stored", "stored w", "stored value w (no unit)", TRUNK),
            (axes[1], "effective", "effective 1 + w", "multiplier applied, 1 + w (no unit)", "#F58518")):
        ax.hist(weights[key], bins=60, color=colour)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel("number of weights")
    return fig
