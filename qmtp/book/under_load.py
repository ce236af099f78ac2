"""MTP under load: the expert-union cost model for B rows of n_draft tokens each, beside a batch measured here.

**Experts a batched pass reads.** A verify pass over B rows of n tokens each routes B * n tokens, each to k of E
experts, so under independent uniform routing it reads the union

    U(B, n) = E (1 - (1 - k/E)^(B n))                                                   (`experts_read`)

of up to min(E, k B n) experts per layer: 8 for one token, all 256 once B n passes a few hundred. Every other
weight of the trunk is read once per pass, whatever B; each row reads its own KV cache and linear-attention state;
the head's B drafts at one position are one batched step reading the union of the B rows' head experts.

**Time of a step** (`step_seconds`), on a machine `qmtp.book.cost_model` calibrates by its published plain
figure (bandwidth, and `overhead` = a plain pass's time beyond its bytes), with `c` the share of that overhead
one more draft position adds (fitted there on the published single-stream MTP runs):

    step(B, n) = [bytes(B, n) + (n - 1) head_bytes(B)] / bandwidth + overhead * extra(B, n)

Two readings of `extra`, since no published run prices what one more *row* adds:

* **per token** (`row_share=None`): every token of the pass beyond the first pays `c`, a row's as a draft's:
  extra = 1 + c (B n - 1). At B = 1 this is exactly `cost_model.step_seconds`.
* **per row** (`row_share=r`): a draft position pays `c`, a row pays `r`: extra = (1 + c (n - 1)) (1 + r (B - 1)).
  `fit_row_share` takes r from the one published plain batch of the 35B-A3B on a named machine (vllm-mlx, 8
  requests on an M3 Ultra, `published.UNDER_LOAD`).

A step yields B tau(n) tokens, tau from the acceptance the cost model fitted (each row keeps its own acceptance:
qmtp's rows are exact, and acceptance does not depend on the batch). Once U(B, n) reaches E, a plain step and a
drafting step read the same bytes, and what a drafted token costs is what the overhead term charges per token: the
compute and dispatch of one more token, no longer bandwidth. Under the per-token reading the gain then falls to
tau(n) / n < 1, so drafting stops paying at some batch (`break_even`); under the per-row reading it tends to
tau(n) / (1 + c (n - 1)).

Two runs are too long for the build and run outside it, their reports saved in `book/measured/` with where and
when they ran (`saved`): verify passes over B rows x n tokens on the real widths (`python -m qmtp bench batch
--real-width`) and the server under load beside mlx_lm.server (`python -m qmtp bench serve`).

Also here: the tables and the figure of chapter 11 (one each per function), a server started in this process
for the chapter's client call (`serving`, `load_rounds`), and the memory one decoding row holds at full size
with the largest batch that fits beside the model (`row_memory`, `largest_batch`, `batch_fits`).
"""

from __future__ import annotations

import contextlib
import math
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..config import LINEAR, QWEN36_35B_A3B, ModelConfig
from ..sizes import sizes
from . import cost_model, published
from .inventory import markdown_table
from .throughput import HEAD_BITS, expected_union, head_step_bytes, state_bytes, total, trunk_pass_bytes

# One calibrated machine per kind of hardware with a published plain figure of the 35B-A3B (`cost_model.rows`)
MACHINES = ("vllm_mlx_m3_ultra", "rocm_vllm_strix_halo_128", "llama_cpp_a100", "lemon_radeon_890m")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 2, 3, 4, 5)
DRAFTING = WIDTHS[1:]
PLAIN_BATCH = "vllm_mlx_m3_ultra_8"  # the published plain batch `fit_row_share` reads
SHOWN_WIDTH = 3  # the width whose union the model table shows beside a plain pass's


def machine(key: str) -> published.Published:
    """The published row of `cost_model.rows()` whose plain figure calibrates a machine."""
    return next(r for r in cost_model.rows() if r.key == key)


def experts_read(batch: int, n_draft: int, config: ModelConfig = QWEN36_35B_A3B) -> float:
    """Expected distinct experts per MoE layer one verify pass over `batch` rows of `n_draft` tokens reads."""
    return expected_union(config.num_experts, config.num_experts_per_tok, batch * n_draft)


@lru_cache(maxsize=None)
def pass_bytes(member: str, bits: int, context: int, batch: int, n_draft: int) -> tuple[float, float]:
    """(trunk pass, one batched head step) bytes for `batch` rows of `n_draft` tokens at `context` each."""
    config = published.member_config(member)
    report = sizes(config, bits, mtp_bits=HEAD_BITS)
    tokens = batch * n_draft
    # the weights (and the union of experts) once per pass; each row's own KV cache and linear state
    trunk = (total(trunk_pass_bytes(config, report, tokens, context)) - total(state_bytes(config, context, tokens))
             + batch * total(state_bytes(config, context, n_draft)))
    k = config.num_experts_per_tok
    head = head_step_bytes(config, report, context)
    scale = {"routed experts": expected_union(config.num_experts, k, batch) / k, "embeddings": batch,
             "KV cache": batch}
    return trunk, math.fsum(v * scale.get(name, 1) for name, v in head.items())


def step_seconds(row: published.Published, batch: int, n_draft: int, extra_position: float,
                 row_share: float | None = None) -> float:
    """Seconds of one batched step on the row's machine (module docstring; `row_share` None: per token)."""
    cal = cost_model.calibrate(row)
    trunk, head = pass_bytes(row.member, row.bits, row.context, batch, n_draft)
    if row_share is None:
        extra = 1 + extra_position * (batch * n_draft - 1)
    else:
        extra = (1 + extra_position * (n_draft - 1)) * (1 + row_share * (batch - 1))
    return (trunk + (n_draft - 1) * head) / cal.bandwidth + cal.overhead * extra


def aggregate_tps(row: published.Published, batch: int, n_draft: int, row_share: float | None = None) -> float:
    """Tokens per second over all `batch` rows at `n_draft`, with `c` and the acceptance fitted on every source."""
    c, fit = cost_model.fitted_without(None)
    return batch * fit.tokens_per_pass(n_draft) / step_seconds(row, batch, n_draft, c, row_share)


def fit_row_share() -> float:
    """r, the share of a plain pass's overhead one more row adds, from vllm-mlx's plain batch of 8 requests on
    the M3 Ultra (`published.UNDER_LOAD`) and the same machine's one-request plain figure (`published.FIELD`)."""
    batched = next(r for r in published.UNDER_LOAD if r.key == PLAIN_BATCH)
    row = machine("vllm_mlx_m3_ultra")
    cal = cost_model.calibrate(row)
    trunk, _ = pass_bytes(row.member, row.bits, row.context, batched.requests, 1)
    step = batched.requests / batched.tps["plain"]
    return max(0.0, ((step - trunk / cal.bandwidth) / cal.overhead - 1) / (batched.requests - 1))


def best_width(row: published.Published, batch: int, row_share: float | None = None,
               widths=WIDTHS) -> tuple[int, float]:
    """The width of `widths` with the most aggregate tokens/s at `batch`, and its gain over plain decoding
    (below 1 where `widths` leaves plain decoding out and every drafting width loses)."""
    speeds = {n: aggregate_tps(row, batch, n, row_share) for n in widths}
    best = max(speeds, key=speeds.get)
    return best, speeds[best] / aggregate_tps(row, batch, 1, row_share)


def break_even(row: published.Published, row_share: float | None = None, largest: int = 512) -> int | None:
    """The smallest batch at which no drafting width beats plain decoding on the row's machine (None: none up to
    `largest`)."""
    return next((b for b in range(1, largest + 1) if best_width(row, b, row_share)[0] == 1), None)


def model_rows(key: str = "vllm_mlx_m3_ultra", batches=BATCHES) -> list[dict]:
    """Per batch size on one calibrated machine: experts a plain pass and a pass at `SHOWN_WIDTH` read, plain
    aggregate tokens/s and the best width with its gain, under both readings (module docstring)."""
    row, share = machine(key), fit_row_share()
    out = []
    for b in batches:
        n_token, g_token = best_width(row, b)
        n_row, g_row = best_width(row, b, share)
        out.append({"batch": b, "experts plain": experts_read(b, 1), "experts wide": experts_read(b, SHOWN_WIDTH),
                    "plain tok/s": aggregate_tps(row, b, 1), "best n (token)": n_token, "gain (token)": g_token,
                    "plain tok/s (row)": aggregate_tps(row, b, 1, share), "best n (row)": n_row,
                    "gain (row)": g_row})
    return out


def model_table(rows: list[dict]) -> str:
    """`model_rows` as a Markdown table."""
    shown = [{**r, "experts": f"{r['experts plain']:.0f} / {r['experts wide']:.0f}",
              "token": f"{r['plain tok/s']:.0f} tok/s; n={r['best n (token)']}, {r['gain (token)']:.2f}x",
              "row": f"{r['plain tok/s (row)']:.0f} tok/s; n={r['best n (row)']}, {r['gain (row)']:.2f}x"}
             for r in rows]
    return markdown_table(shown, ["batch", "experts", "token", "row"])


def union_figure(config: ModelConfig = QWEN36_35B_A3B, batches=(1, 2, 4, 8), widths=(1, 3)):
    """Experts one pass reads against the tokens it holds (B rows x n_draft), the batches of the measured table
    marked at plain decoding and at one drafting width."""
    import matplotlib.pyplot as plt

    E, k = config.num_experts, config.num_experts_per_tok
    tokens = list(range(1, 513))
    fig, ax = plt.subplots(layout="constrained")
    ax.plot(tokens, [expected_union(E, k, t) for t in tokens], color="#4C78A8", label="expected union (uniform)")
    ax.plot(tokens, [min(E, k * t) for t in tokens], color="#B0B0B0", ls="--", label=f"{k} x tokens, at most {E}")
    for n, marker in zip(widths, ("o", "s")):
        xs = [b * n for b in batches]
        ax.scatter(xs, [expected_union(E, k, x) for x in xs], marker=marker, zorder=3,
                   label=f"B = {', '.join(map(str, batches))} at n_draft {n}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in one verify pass (B rows x n_draft)")
    ax.set_ylabel("experts read per layer")
    ax.set_ylim(0, E * 1.05)
    ax.legend(frameon=False, fontsize=8, loc="upper left")
    return fig


def measured_gains(report: dict) -> dict[int, tuple[str, float]]:
    """Per batch size of a `bench_batch.run` report: the fastest drafting width and its aggregate tokens/s over
    the plain batch's."""
    out = {}
    for b in sorted({r["batch"] for r in report["rows"]}):
        plain = next(r for r in report["rows"] if (r["engine"], r["n_draft"], r["batch"]) == ("batch", "1", b))
        wide = [r for r in report["rows"] if r["engine"] == "batch" and r["batch"] == b and r["n_draft"] != "1"]
        best = max(wide, key=lambda r: r["tokens_per_second"])
        out[b] = (best["n_draft"], best["tokens_per_second"] / plain["tokens_per_second"])
    return out


def gain_figure(report: dict | None = None, batches=BATCHES):
    """The best drafting width's gain over plain decoding against the batch: predicted on each of `MACHINES`
    (per-token reading, solid; the M3 Ultra under the per-row reading, dashed) and, from `report`, measured
    here."""
    import matplotlib.pyplot as plt

    share = fit_row_share()
    fig, ax = plt.subplots(layout="constrained")
    for key in MACHINES:
        row = machine(key)
        ax.plot(batches, [best_width(row, b, widths=DRAFTING)[1] for b in batches], marker=".", label=f"{row.engine}, {row.hardware}")
    m3 = machine("vllm_mlx_m3_ultra")
    ax.plot(batches, [best_width(m3, b, share, DRAFTING)[1] for b in batches], ls="--", color="#4C78A8",
            label=f"{m3.hardware}, a row pays r = {share:.2f}")
    if report is not None:
        gains = measured_gains(report)
        ax.plot(list(gains), [g for _, g in gains.values()], color="black", marker="s",
                label="measured here: tiny model, this CPU")
    ax.axhline(1.0, color="#888888", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batches), [str(b) for b in batches])
    ax.set_xlabel("rows decoded together (B)")
    ax.set_ylabel("best drafting width over plain")
    ax.legend(frameon=False, fontsize=8)
    return fig


def field_rows() -> list[dict]:
    """`published.UNDER_LOAD`, one dict per source's figures, as published."""
    out = []
    for r in published.UNDER_LOAD:
        figures = [f"{k}: {v:.1f} tok/s" for k, v in r.tps.items()]
        figures += [f"{k}: {lo:.2f}x" + (f" to {hi:.2f}x" if hi != lo else "") for k, (lo, hi) in r.ratio.items()]
        figures += [f"acceptance {k}: {v:.0%}" for k, v in r.acceptance.items()]
        out.append({"engine": r.engine, "machine, model": f"{r.hardware}; {r.model}",
                    "requests": r.requests or "more than 1",
                    "published": "; ".join(figures) or "-", "drafts with several": "yes" if r.mtp_kept else "no",
                    "source": f"{{cite:p}}`{r.source}`" + ("" if r.checked else " (as reported)")})
    return out


def field_table(rows: list[dict]) -> str:
    """`field_rows` as a Markdown table."""
    return markdown_table(rows, ["engine", "machine, model", "requests", "published", "drafts with several",
                                 "source"])


def measured_rows(report: dict) -> list[dict]:
    """One dict per batch size of a `bench_batch.run` report: aggregate tokens/s of the plain batch, of the same
    rows one after another, and at each drafting width with each row's acceptance."""
    widths = sorted({r["n_draft"] for r in report["rows"] if r["engine"] == "batch"}, key=str)
    out = []
    for b in sorted({r["batch"] for r in report["rows"]}):
        cells = {(r["engine"], r["n_draft"]): r for r in report["rows"] if r["batch"] == b}
        row = {"batch": b, "one by one": cells[("singles", "1")]["tokens_per_second"]}
        for n in widths:
            cell = cells[("batch", n)]
            row[f"n_draft {n}"] = cell["tokens_per_second"]
            row[f"acceptance {n}"] = [a for a in cell["acceptance"] if a == a]  # NaN: a plain row drafts nothing
        out.append(row)
    return out


def measured_table(rows: list[dict]) -> str:
    """`measured_rows` as a Markdown table: tok/s per width, each drafting width's acceptance per row beneath."""
    widths = [k.split()[1] for k in rows[0] if k.startswith("n_draft ")]
    shown = []
    for r in rows:
        cell = {"B": r["batch"], "one by one": f"{r['one by one']:.0f}"}
        for n in widths:
            acc = r[f"acceptance {n}"]
            cell[f"n_draft {n}"] = f"{r[f'n_draft {n}']:.0f}" + (
                f" ({min(acc):.2f}-{max(acc):.2f})" if acc and min(acc) != max(acc) else
                f" ({acc[0]:.2f})" if acc else "")
        shown.append(cell)
    return markdown_table(shown, ["B", "one by one"] + [f"n_draft {n}" for n in widths])


def _accepted(values) -> list[float]:
    """Each row's acceptance, without the rows that drafted nothing (NaN from qmtp, None from a peer)."""
    return [a for a in values or () if a is not None and a == a]


def peer_rows(report: dict, peer: str = "mlx-vlm") -> list[dict]:
    """One dict per batch size of a `bench_batch.run` report that ran `peer`: at each width both engines ran, qmtp's
    and the peer's aggregate tokens/s and each row's acceptance; and the rows whose tokens differ from qmtp's
    greedy batch (as `(n_draft, row, first position)`)."""
    widths = sorted({r["n_draft"] for r in report["rows"] if r["engine"] == peer}
                    & {r["n_draft"] for r in report["rows"] if r["engine"] == "batch"}, key=str)
    out = []
    for b in sorted({r["batch"] for r in report["rows"] if r["engine"] == peer}):
        cells = {(r["engine"], r["n_draft"]): r for r in report["rows"] if r["batch"] == b}
        row = {"batch": b, "widths": widths, "differ": []}
        for n in widths:
            ours, theirs = cells[("batch", n)], cells[(peer, n)]
            row[f"qmtp {n}"], row[f"{peer} {n}"] = ours["tokens_per_second"], theirs["tokens_per_second"]
            row[f"acceptance qmtp {n}"] = _accepted(ours.get("acceptance"))
            row[f"acceptance {peer} {n}"] = _accepted(theirs.get("acceptance"))
            row["differ"] += [(n, i, m) for i, m in enumerate(theirs.get("first_mismatch", ())) if m is not None]
        out.append(row)
    return out


def other_widths(goal: dict) -> dict:
    """The mlx-vlm goal of `bench_batch.goals`: its width-by-width ratios, less the pair its headline ratio already
    is (both engines' best at the same width)."""
    return {n: ratio for n, ratio in goal["at_same_width"].items()
            if not n == goal["n_draft"] == goal["mlx_vlm_n_draft"]}


def _peer_missing(report: dict, peer: str) -> str:
    notes = [n for n in report.get("notes", ()) if n.startswith(f"{peer}: not run")]
    return notes[0] if notes else f"{peer}: not run (the report did not ask for it)"


def peer_table(report: dict, peer: str = "mlx-vlm") -> str:
    """`peer_rows` of `report` as a Markdown table: per width "qmtp / peer" tokens/s, each row's acceptance in
    brackets (one value when every row's is the same), and whether the peer's tokens were qmtp's in every row;
    if the peer did not run, why not."""
    def acceptance(values):
        if not values:
            return ""
        return f" ({min(values):.2f})" if min(values) == max(values) else f" ({min(values):.2f}-{max(values):.2f})"

    rows = peer_rows(report, peer)
    if not rows:
        return _peer_missing(report, peer)
    shown = []
    for r in rows:
        cell = {"B": r["batch"]}
        for n in r["widths"]:
            cell[f"n_draft {n}: qmtp / {peer}"] = (f"{r[f'qmtp {n}']:.0f}{acceptance(r[f'acceptance qmtp {n}'])} / "
                                                   f"{r[f'{peer} {n}']:.0f}{acceptance(r[f'acceptance {peer} {n}'])}")
        cell["tokens"] = "qmtp's, every row" if not r["differ"] else "; ".join(
            f"n_draft {n} row {i} differs from position {m}" for n, i, m in r["differ"])
        shown.append(cell)
    return markdown_table(shown, list(shown[0]))


def peer_sentences(report: dict, peer: str = "mlx-vlm", size: int = 4) -> str:
    """What the chapter says of `peer` beside qmtp, from `report`: the goal at `size` rows (qmtp's best drafting
    width over the peer's), how each engine's acceptance at its widest drafting width moves from the smallest
    batch to the largest, and whether the peer's tokens were qmtp's."""
    rows = peer_rows(report, peer)
    if not rows:
        return f"{_peer_missing(report, peer)}."
    out = []
    goal = report["goals"].get("drafting_over_mlx_vlm_drafting")
    if goal:
        theirs_ran = [n for n in rows[0]["widths"] if n != "1"]
        theirs = (f"{peer}'s at n_draft {goal['mlx_vlm_n_draft']}, the one drafting width it ran" if len(theirs_ran) == 1
                  else f"{peer}'s best (n_draft {goal['mlx_vlm_n_draft']})")
        same = "".join(f", {ratio:.2f}x at n_draft {n} both" for n, ratio in other_widths(goal).items())
        out.append(f"At {size} rows qmtp's best drafting width (n_draft {goal['n_draft']}) gave {goal['ratio']:.2f}x "
                   f"the aggregate tokens/s of {theirs}{same}")
    widest = max((n for n in rows[0]["widths"] if n != "1"), key=int, default=None)
    if widest:
        first, last = rows[0], rows[-1]

        def mean(values):
            return statistics.mean(values) if values else float("nan")

        out.append(f"at n_draft {widest} {peer}'s acceptance went from "
                   f"{mean(first[f'acceptance {peer} {widest}']):.2f} at {first['batch']} "
                   f"row{'s' if first['batch'] > 1 else ''} to {mean(last[f'acceptance {peer} {widest}']):.2f} at "
                   f"{last['batch']}, qmtp's on the same rows (their mean) from {mean(first[f'acceptance qmtp {widest}']):.2f} "
                   f"to {mean(last[f'acceptance qmtp {widest}']):.2f}")
    differ = [(r["batch"], n, i, m) for r in rows for n, i, m in r["differ"]]
    out.append(f"{peer}'s tokens were qmtp's greedy tokens in every row of every batch" if not differ else
               f"{peer}'s tokens differed from qmtp's greedy tokens in " + "; ".join(
                   f"batch {b} n_draft {n} row {i} (from position {m})" for b, n, i, m in differ))
    text = "; ".join(out)
    return text[0].upper() + text[1:] + "."


def answer(report: dict) -> dict:
    """What the chapter concludes, as values to glue: the break-even batch per machine under each reading, the
    limits of the gain once the union saturates, and what was measured here."""
    c, fit = cost_model.fitted_without(None)
    share = fit_row_share()
    m3 = machine("vllm_mlx_m3_ultra")
    per_token = {key: break_even(machine(key)) for key in MACHINES}
    found = [b for b in per_token.values() if b]
    gains = measured_gains(report)
    paying = [b for b, (_, g) in gains.items() if g > 1]
    saturated = next(b for b in range(1, 4096) if experts_read(b, 1) >= 0.99 * QWEN36_35B_A3B.num_experts)
    return {
        "c": c, "row_share": share, "tau2": fit.tokens_per_pass(2), "limit_token": fit.tokens_per_pass(2) / 2,
        "limit_row": fit.tokens_per_pass(2) / (1 + c), "break_even_low": min(found) if found else None,
        "break_even_high": max(found) if found else None, "break_even_m3": per_token["vllm_mlx_m3_ultra"],
        "break_even_m3_row": break_even(m3, share), "saturated_batch": saturated,
        "plain_8_model": aggregate_tps(m3, 8, 1), "plain_8_model_row": aggregate_tps(m3, 8, 1, share),
        "measured_paying": paying, "measured_gains": gains,
    }


# ---- a server in this process, for the chapter's client call ---------------------------------------------------
@contextlib.contextmanager
def serving(model, n_draft=None, max_batch: int = 8):
    """`qmtp serve`'s app over `model` on a free port of 127.0.0.1, run by uvicorn in a thread (n_draft None: the
    server's default); yields its base URL and stops it on leaving."""
    import uvicorn

    from ..serve.main import build

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build(model, n_draft=n_draft, max_batch=max_batch), log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def load_rounds(base: str, model_name: str, clients=(1, 4), n_drafts=(1, 3), max_tokens: int = 8,
                prompts=("Once upon a time", "The old dog", "In a small town", "The moon was")) -> list[dict]:
    """For each n_draft (the request's own) and number of clients: that many chat completions sent at once with
    the official client, temperature 0; the round's wall time, the slowest request's, tokens/s in aggregate."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)

    def one(i, n_draft):
        started = time.perf_counter()
        reply = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": prompts[i % len(prompts)]}], temperature=0,
            max_tokens=max_tokens, extra_body={"n_draft": n_draft, "ignore_eos": True})
        return time.perf_counter() - started, reply.usage.completion_tokens

    out = []
    for n_draft in n_drafts:
        one(0, n_draft)  # warm-up: this width's compiled step
        for count in clients:
            results: list = [None] * count

            def run(i, n=n_draft):
                results[i] = one(i, n)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            out.append({"n_draft": n_draft, "clients": count, "wall s": wall,
                        "slowest s": max(s for s, _ in results), "median s": statistics.median(s for s, _ in results),
                        "tokens": sum(t for _, t in results), "tok/s": sum(t for _, t in results) / wall})
    return out


def load_table(rows: list[dict]) -> str:
    """`load_rounds` as a Markdown table, each round's wall time beside the one-client round's at its width."""
    shown = []
    for r in rows:
        alone = next(x for x in rows if x["n_draft"] == r["n_draft"] and x["clients"] == min(
            y["clients"] for y in rows if y["n_draft"] == r["n_draft"]))
        shown.append({**r, "vs one": f"{r['wall s'] / alone['wall s']:.2f}x"})
    return markdown_table(shown, ["n_draft", "clients", "tokens", "wall s", "vs one", "tok/s"],
                          {"wall s": "{:.2f}", "tok/s": "{:.1f}"})


# ---- runs outside the build, read from their saved reports --------------------------------------------------
MEASURED = Path(__file__).resolve().parents[2] / "book" / "measured"
SAVED = {"real width": "bench_batch_real_width.json", "serve": "bench_serve.json"}


def saved(kind: str) -> dict | None:
    """The saved report of a run outside the build (`SAVED`: "real width" or "serve"), or None if none was
    saved."""
    import json

    path = MEASURED / SAVED[kind]
    return json.loads(path.read_text()) if path.exists() else None


def real_width_rows_table(report: dict) -> str:
    """A `bench_batch.real_width_passes` report as a Markdown table: each pass's time against one row's
    one-token pass, and the experts it read per layer beside the independent-routing union."""
    shown = [{"B": r["batch"], "n_draft": r["n_draft"], "tokens": r["tokens"], "ms": f"{r['seconds'] * 1e3:.0f}",
              "x one token": f"{r['time_over_one_token']:.2f}", "experts read": f"{r['experts_read']:.0f}",
              "U(B, n)": f"{r['experts_predicted']:.0f}"} for r in report["rows"]]
    return markdown_table(shown, ["B", "n_draft", "tokens", "ms", "x one token", "experts read", "U(B, n)"])


def serve_rows_table(report: dict) -> str:
    """A `bench_serve.run` report as a Markdown table, one row per server and number of clients."""
    shown = [{"server": server["server"], "clients": r["clients"], "TTFT p50 ms": f"{r['ttft_p50'] * 1e3:.0f}",
              "TTFT p99 ms": f"{r['ttft_p99'] * 1e3:.0f}", "tok/s per stream": f"{r['tokens_per_stream']:.0f}",
              "tok/s all": f"{r['aggregate']:.0f}", "tokens per request": f"{r['tokens_per_request']:.1f}",
              "memory MiB": f"{server['memory_before_mib']:.0f} to {server['memory_after_mib']:.0f}"}
             for server in report["servers"] for r in server["rounds"]]
    return markdown_table(shown, ["server", "clients", "TTFT p50 ms", "TTFT p99 ms", "tok/s per stream",
                                  "tok/s all", "tokens per request", "memory MiB"])


def serve_summary(report: dict, clients: int) -> dict:
    """At `clients` clients: each server's aggregate tok/s, the fastest qmtp server, and its aggregate over
    mlx_lm.server's."""
    at = {s["server"]: next(r["aggregate"] for r in s["rounds"] if r["clients"] == clients) for s in report["servers"]}
    ours = {name: tps for name, tps in at.items() if name.startswith("qmtp")}
    theirs = next((tps for name, tps in at.items() if name.startswith("mlx_lm")), None)
    best = max(ours, key=ours.get)
    return {"aggregate": at, "best": best, "best_over_mlx_lm": ours[best] / theirs if theirs else None}


def join_table(runs: list[dict]) -> str:
    """`bench_batch.join_stall` runs (one batch size and prompt length, which the page states) as a Markdown
    table: how the prompt joined, the rows' step alone, while the long prompt joins (median, 90th percentile
    and longest step over the step alone, and the share of steps over twice it), and the prompt's prefill."""
    shown = [{"n_draft": r["n_draft"], "joined": "as a row" if r.get("steps_as_a_row") else "in chunks",
              "step alone ms": f"{r['step_seconds'] * 1e3:.1f}",
              "while joining, median ms": f"{r['median_while_joining'] * 1e3:.1f}",
              "while joining, longest ms": f"{r['longest_while_joining'] * 1e3:.1f}",
              "p90 / alone": f"{r['p90_over_step']:.2f}", "longest / alone": f"{r['longest_over_step']:.2f}",
              "steps over 2x": f"{r['share_over_twice']:.0%}", "steps": r["steps_while_joining"],
              "prefill s": f"{r['prefill_seconds']:.1f}"} for r in runs]
    return markdown_table(shown, list(shown[0]))


def join_verdict(runs: list[dict], goal: float = 2.0) -> str:
    """Whether the rows' steps while a prompt joined kept within `goal` times their step alone, in words: by
    the 90th percentile, and how the longest step did."""
    p90 = max(r["p90_over_step"] for r in runs)
    longest = max(r["longest_over_step"] for r in runs)
    if p90 > goal:
        return f"missed: the 90th percentile reached {p90:.2f}x"
    tail = "and every step kept within it" if longest <= goal else f"but the longest step took {longest:.2f}x"
    return f"met by 9 steps in 10 at both widths, {tail}"


# ---- memory per decoding row, and the largest batch that fits ---------------------------------------------
RUNTIME_BYTES = 3 * 10**9  # assumed: the Python process, MLX's kernels and buffer cache, activations of a pass
OS_SHARE = 0.25  # assumed: the share of a machine's memory the operating system and other programs keep


@dataclass
class RowMemory:
    """Bytes one decoding row holds (`qmtp.continuous`): the trunk's KV buffers at `context` positions, the
    head's, the linear-attention state (conv inputs and S per layer) and, during a verify pass, one snapshot of
    that state per position of the pass (the roll back keeps the row's last kept one)."""

    context: int
    n_draft: int
    kv_bytes: int
    head_kv_bytes: int
    linear_bytes: int
    snapshot_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.head_kv_bytes + self.linear_bytes + self.snapshot_bytes


def row_memory(config: ModelConfig, context: int = 4096, n_draft: int = 5, dtype_bytes: int = 2) -> RowMemory:
    """One row's decoding state for `config` at `context` positions and passes of `n_draft` tokens (KV and conv
    inputs in the compute dtype, `dtype_bytes`; S in float32, as `GatedDeltaNet.empty_state` keeps it)."""
    kinds = config.layer_types if getattr(config, "layer_types", None) else []
    linear = sum(kind == LINEAR for kind in kinds)
    attention = config.num_hidden_layers - linear
    per_position = 2 * config.num_key_value_heads * config.head_dim * dtype_bytes  # keys and values
    conv = (config.linear_conv_kernel_dim - 1) * config.linear_conv_dim * dtype_bytes
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    head_layers = getattr(config, "mtp_num_hidden_layers", 1) or 1
    return RowMemory(context, n_draft, kv_bytes=attention * per_position * context,
                     head_kv_bytes=head_layers * per_position * context, linear_bytes=linear * (conv + recurrent),
                     snapshot_bytes=(n_draft if n_draft > 1 else 0) * linear * (conv + recurrent))


def largest_batch(config: ModelConfig, machine_bytes: float, context: int = 4096, n_draft: int = 5, bits: int = 4,
                  runtime_bytes: int = RUNTIME_BYTES, os_share: float = OS_SHARE) -> int:
    """The most rows that fit beside the `bits`-bit model (its head in bf16) and the runtime in what the operating
    system leaves of `machine_bytes` (0: not even the model fits)."""
    weights = sizes(config, bits=bits).total_bytes
    free = machine_bytes * (1 - os_share) - weights - runtime_bytes
    return max(0, int(free // row_memory(config, context, n_draft).total_bytes))


def batch_fits(config: ModelConfig, machines_gb=(24, 64, 128), context: int = 4096, n_draft: int = 5,
               bits: int = 4) -> list[dict]:
    """Per machine size: the weights, one row's memory and the largest batch (`largest_batch`)."""
    row = row_memory(config, context, n_draft)
    weights = sizes(config, bits=bits).total_bytes
    return [{"machine_GB": gb, "weights_GB": weights / 1e9, "row_MB": row.total_bytes / 1e6,
             "largest_batch": largest_batch(config, gb * 1e9, context, n_draft, bits)} for gb in machines_gb]


def batch_fits_table(config: ModelConfig = QWEN36_35B_A3B, contexts=(4096, 32768), n_drafts=(1, 5),
                     machines_gb=(24, 64, 128), bits: int = 4) -> str:
    """`batch_fits` as a Markdown table: per context and n_draft, one row's decoding state (its KV,
    head KV, linear-attention state and roll-back snapshots) and the largest batch beside the `bits`-bit model
    and the runtime on each machine size."""
    shown = []
    for context in contexts:
        for n_draft in n_drafts:
            row = row_memory(config, context, n_draft)
            fits = batch_fits(config, machines_gb, context, n_draft, bits)
            shown.append({"context": context, "n_draft": n_draft, "KV MB": f"{row.kv_bytes / 1e6:.0f}",
                          "head KV MB": f"{row.head_kv_bytes / 1e6:.0f}",
                          "linear state MB": f"{row.linear_bytes / 1e6:.0f}",
                          "snapshots MB": f"{row.snapshot_bytes / 1e6:.0f}", "row MB": f"{row.total_bytes / 1e6:.0f}",
                          **{f"rows in {f['machine_GB']} GB": f["largest_batch"] for f in fits}})
    return markdown_table(shown, list(shown[0]))
