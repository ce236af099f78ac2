"""Chapter 9, "Beyond one machine": the experts spread over N ranks (`qmtp.parallel`), checked and priced.

Three things live here, so that the chapter only calls them:

* **The layout** (`layout_rows`, `fit_rows`): which experts each rank holds, the bytes each rank holds
  (`qmtp.sizes.per_rank_bytes`) and the fewest ranks whose share fits machines of a given memory
  (`qmtp.sizes.fewest_ranks`), all arithmetic over the config.
* **The live check** (`run_live`): the bundled model decoded on two ranks of MLX's ring backend on this host,
  started by `mlx.launch` through `qmtp.launch.run` (bounded by a timeout), and once in a separate process
  without a group; each writes what it found (`worker`: tokens greedy and sampled at n_draft 1 and 3, the
  bytes of the weights it holds, its peak resident memory, and on the ranks the time of an all_sum per MoE
  layer) to a JSON file the chapter reads back. The chapter compares the ranks' tokens with those it decodes
  itself in one process.
* **The predictions** (`prediction_rows`, `verdicts`): the N-machine cost model of
  `qmtp.book.throughput` (section 5) at the bandwidths of `qmtp.book.published` and a per-layer all_sum
  latency, measured here (loopback) or published (`published.LINKS`).

    PYTHONPATH=. python -m qmtp.book.beyond OUT [--ranked]     # one worker (what `run_live` starts)
"""

from __future__ import annotations

import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Once upon a time"
MAX_TOKENS = 24
SEED = 3
N_DRAFTS = (1, 3)
TEMPERATURES = (0.0, 0.8)  # greedy, and sampled with SEED
ALL_SUM_REPEATS = 20
GB = 1e9


# ---- the layout --------------------------------------------------------------------------------------------
def blocks(n_experts: int, ranks: int) -> list[tuple[int, int]]:
    """(first, last) expert of each rank's block, as `parallel.ExpertShard.rows` gives them (last included)."""
    if n_experts % ranks:
        raise ValueError(f"{n_experts} experts do not split over {ranks} ranks")
    held = n_experts // ranks
    return [(r * held, (r + 1) * held - 1) for r in range(ranks)]


def layout_rows(report, n_experts: int, ranks=(1, 2, 4, 8), unit: float = GB) -> list[dict]:
    """One row per N: the experts of each MoE layer rank 0 and the last rank hold, the bytes one rank holds
    (in `unit`), and that share of one process's bytes."""
    from ..sizes import per_rank_bytes

    whole = per_rank_bytes(report, 1)
    rows = []
    for n in ranks:
        (a, b), (c, d) = blocks(n_experts, n)[0], blocks(n_experts, n)[-1]
        rows.append({"ranks": n, "experts per rank": n_experts // n, "rank 0": f"{a}-{b}",
                     "last rank": f"{c}-{d}", "per rank": per_rank_bytes(report, n) / unit,
                     "of one process": per_rank_bytes(report, n) / whole})
    return rows


def fit_rows(config, machines_gb=(16, 32, 64, 128, 192), widths=(16, 8, 6, 4), ranks=(1, 2, 4, 8),
             runtime: bool = False) -> list[dict]:
    """The fewest ranks whose per-rank weights (`qmtp.sizes.per_rank_bytes`) fit each machine, one row per trunk
    width (16: bf16, the release), the head in bf16 as the book converts it (`qmtp.book.budget.stored_bytes`),
    router gates at 8 bits as mlx-lm converts. A machine of m "GB" holds m GiB and, with `runtime`, each rank
    also needs `budget.RUNTIME_GB` beside its weights: `budget.fits`'s semantics. None: not even 8."""
    from ..sizes import UNQUANTIZED, per_rank_bytes, sizes
    from .budget import fits

    rows = []
    for bits in widths:
        report = sizes(config, bits, mtp_bits=None, router_bits=UNQUANTIZED if bits == UNQUANTIZED else 8)
        row = {"width": "bf16" if bits == UNQUANTIZED else f"{bits}-bit", "whole GB": report.total_bytes / GB}
        for m in machines_gb:
            row[f"{m} GB"] = next((n for n in ranks if fits(per_rank_bytes(report, n), m, runtime)), None)
        rows.append(row)
    return rows


# ---- the live check --------------------------------------------------------------------------------------------
def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def generations(model) -> dict[str, list[int]]:
    """Tokens of every (n_draft, temperature) the chapter checks, keyed "n_draft/temperature"."""
    import qmtp

    return {f"{n}/{t}": qmtp.generate(model, PROMPT, max_tokens=MAX_TOKENS, n_draft=n, temperature=t,
                                      seed=SEED).tokens
            for n in N_DRAFTS for t in TEMPERATURES}


def all_sum_per_layer(model, group, repeats: int = ALL_SUM_REPEATS) -> dict[str, float]:
    """Seconds per MoE layer of a chain of all_sums of one token's [1, k, H] float32 expert outputs, one per
    MoE layer of the trunk and the head, as a decode step issues them: {"median": ..., "fastest": ...} over
    `repeats` chains. On a shared machine the median carries whatever else ran; the fastest chain is the
    closest it comes to the link's own latency."""
    import mlx.core as mx

    c = model.config
    x = mx.ones((1, c.num_experts_per_tok, c.hidden_size))
    layers = len(model.layers) + 1
    mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for i in range(repeats):
        y = x + i
        started = time.perf_counter()
        for _ in range(layers):
            y = mx.distributed.all_sum(y * 0.5, group=group)
        mx.eval(y)
        times.append((time.perf_counter() - started) / layers)
    return {"median": statistics.median(times), "fastest": min(times)}


def worker(out_dir: Path, ranked: bool) -> None:
    """What one process of the live check runs: load (expert-parallel on a group), decode, measure, write."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import qmtp
    from qmtp.loading import BUNDLED_MODEL

    group = mx.distributed.init(strict=True) if ranked else None
    model = qmtp.load(BUNDLED_MODEL, group=group)  # two copies on one host: always the tiny model
    found = {"rank": group.rank() if group else 0, "ranks": group.size() if group else 1,
             "held": model.layers[0].mlp.experts.gate_proj.weight.shape[0],
             "weights_bytes": sum(p.nbytes for _, p in tree_flatten(model.parameters())),
             "rss_after_load": peak_rss()}
    found["tokens"] = generations(model)
    # plain decoding timed once warm (the greedy n_draft=1 run above compiled its step): on ranks sharing this
    # host's cores, what it measures is their contention, not a network
    found["plain_tokens_per_second"] = qmtp.generate(model, PROMPT, max_tokens=MAX_TOKENS,
                                                      n_draft=1).stats.tokens_per_second
    if group is not None:
        found["all_sum_per_layer"] = all_sum_per_layer(model, group)
    found["peak_rss"] = peak_rss()
    (out_dir / f"rank{found['rank']}.json").write_text(json.dumps(found))


def run_live(ranks: int = 2, timeout: float = 120.0) -> dict:
    """The live check: `ranks` ranks through `mlx.launch` (ring, this host), then one process alone, each
    bounded by `timeout` seconds. Returns {"ranks": [rank 0's findings, ...], "alone": {...}, "seconds":
    {"ranks": wall time, "alone": wall time}}; a failure raises RuntimeError with the ranks' last lines."""
    from .. import launch

    env_path = str(Path(__file__).resolve().parents[2])
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path  # the ranks import this checkout's qmtp
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            argv = ["-m", "qmtp.book.beyond", str(out)]
            err = io.StringIO()
            started = time.perf_counter()
            code = launch.run([*argv, "--ranked"], ranks=ranks, timeout=timeout, out=io.StringIO(), err=err)
            ranked_s = time.perf_counter() - started
            if code:
                raise RuntimeError(f"the {ranks} ranks failed (code {code}):\n{err.getvalue()[-2000:]}")
            found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
            started = time.perf_counter()
            subprocess.run([sys.executable, *argv], check=True, timeout=timeout, capture_output=True,
                           env=dict(os.environ))
            alone_s = time.perf_counter() - started
            alone = json.loads((out / "rank0.json").read_text())
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return {"ranks": found, "alone": alone, "seconds": {"ranks": ranked_s, "alone": alone_s}}


def compare(live: dict, reference: dict[str, list[int]]) -> list[dict]:
    """One row per (n_draft, temperature): whether every rank's tokens equal `reference` (the chapter's own
    single-process run), token for token, and where the first difference is if not."""
    rows = []
    for key, want in reference.items():
        n, t = key.split("/")
        for found in live["ranks"]:
            got = found["tokens"][key]
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         None if len(got) == len(want) else min(len(got), len(want)))
            rows.append({"n_draft": int(n), "sampling": "greedy" if float(t) == 0 else f"temperature {t}",
                         "rank": found["rank"], "tokens": len(got), "equal": got == want,
                         "first difference": "-" if first is None else first})
    return rows


def memory_rows(live: dict, unit: float = 2**20) -> list[dict]:
    """Weights held and peak resident memory of each rank beside the single process's, in `unit` (MiB)."""
    alone = live["alone"]
    rows = [{"process": "one process", "experts held": alone["held"], "weights": alone["weights_bytes"] / unit,
             "peak RSS": alone["peak_rss"] / unit, "weights / one": 1.0, "RSS / one": 1.0}]
    for f in live["ranks"]:
        rows.append({"process": f"rank {f['rank']} of {f['ranks']}", "experts held": f["held"],
                     "weights": f["weights_bytes"] / unit, "peak RSS": f["peak_rss"] / unit,
                     "weights / one": f["weights_bytes"] / alone["weights_bytes"],
                     "RSS / one": f["peak_rss"] / alone["peak_rss"]})
    return rows


# ---- the predictions -------------------------------------------------------------------------------------------
def acceptance_rates(n_drafts) -> list[float]:
    """Per-position rates from the reported acceptance at n_draft 2 and 3, shrinking geometrically after: the
    acceptance every prediction of the book assumes where none is given (`throughput.reported_rates`)."""
    from .throughput import reported_rates

    return reported_rates(max(n_drafts) - 1)


def prediction_rows(config, bits: int, memories: dict, latencies: dict, ranks=(1, 2, 4, 8),
                    n_drafts=range(1, 6), context: int | None = None, measured_on: dict | None = None) -> list[dict]:
    """The N-machine cost model (`throughput.parallel_predictions`) at each memory (name -> `published.Memory`)
    and per-layer all_sum latency (name -> seconds): one row per (memory, link, N) with plain tok/s, the best
    n_draft, its tok/s and its speedup over plain decoding at that N. The head in bf16, as every prediction of
    the book assumes (`throughput.HEAD_BITS`); one rank per machine, each of that memory's bandwidth; no fixed
    cost per pass beyond the all_sums. `context`: chapter 6's `throughput.DEFAULT_CONTEXT` unless given.
    `measured_on`: link name -> the memory whose machines the latency was measured between; a row pricing that
    latency at another memory says so in its "latency from" cell (an assumption, not a measurement)."""
    from ..sizes import sizes
    from .throughput import DEFAULT_CONTEXT, HEAD_BITS, Machine, parallel_predictions

    context = DEFAULT_CONTEXT if context is None else context
    measured_on = measured_on or {}

    n_drafts = list(n_drafts)
    report = sizes(config, bits, mtp_bits=HEAD_BITS)
    rates = acceptance_rates(n_drafts)
    rows = []
    for mem_name, memory in memories.items():
        machine = Machine(memory.bandwidth)
        for link, seconds in latencies.items():
            table = parallel_predictions(config, report, rates, machine, seconds, ranks, n_drafts, context)
            on = measured_on.get(link)
            source = (f"published, measured between {on}s" if on == mem_name else
                      f"{MEASURED_ON.get(on, on)} latency applied to {mem_name} bandwidth (an assumption)"
                      if on else "-")
            for n in ranks:
                at = [r for r in table if r["ranks"] == n]
                plain = next(r for r in at if r["n_draft"] == 1)
                best = next(r for r in at if r["best"])
                rows.append({"memory": mem_name, "GB/s": memory.bandwidth / GB, "link": link,
                             "latency from": source, "assumed": bool(on) and on != mem_name,
                             "all_sum us": seconds * 1e6, "ranks": n,
                             "plain tok/s": plain["tokens_per_second"], "best n_draft": best["n_draft"],
                             "best tok/s": best["tokens_per_second"], "MTP speedup": best["speedup_vs_plain"],
                             "n_draft=3 speedup": next(r["speedup_vs_plain"] for r in at if r["n_draft"] == 3)})
    return rows


NO_LATENCY = "no latency (a bound)"
HERE = "this host"  # `measured_on` of the loopback latency: not a link between machines
MEASURED_ON = {"M3 Ultra": "Mac link", HERE: "this host's loopback"}  # how a row names where its latency is from


def verdicts(rows: list[dict], bound: str = NO_LATENCY) -> dict:
    """What the rows say, for the prose. With the `bound` link (no all_sum latency at all) apart from the
    real links: MTP's best speedup and best n_draft on one machine and on the most machines, with no latency
    and over the real links; on how many (memory, link) pairs of the real links the speedup grows with N;
    whether plain decoding on N > 1 machines is slower than on one everywhere over the real links
    (`plain_slower`) and faster everywhere with no latency (`plain_free_faster`); in how many rows of N > 1
    machines over the real links the best tok/s is below one machine's (`best_slower` of `several`); the best
    tok/s on N > 1 machines over the slowest link (a published one if any) at the first memory against one
    machine's (`slow_*`); and `faster`, a sentence naming where the best of N > 1 machines beats one machine's
    best over a real link, with the row's "latency from" where that latency is assumed."""
    one = {r["memory"]: r for r in rows if r["ranks"] == 1}
    most = max(r["ranks"] for r in rows)
    real = [r for r in rows if r["link"] != bound]
    free = [r for r in rows if r["link"] == bound and r["ranks"] == most]
    many = [r for r in real if r["ranks"] == most]
    pairs = {(r["memory"], r["link"]) for r in real}
    grows = sum(1 for r in many if r["MTP speedup"] > one[r["memory"]]["MTP speedup"])
    faster = [r for r in real if r["ranks"] > 1 and r["best tok/s"] > one[r["memory"]]["best tok/s"]]
    if faster:
        where = sorted({(r["link"], r["memory"], r.get("assumed", False), r.get("latency from", ""))
                        for r in faster})
        cases = "; ".join(
            f"over {link} at {memory}'s bandwidth on "
            + _and([str(r["ranks"]) for r in faster if (r["link"], r["memory"]) == (link, memory)])
            + " machines" + (f" ({label.replace(' (an assumption)', ': an assumption')})" if assumed else "")
            for link, memory, assumed, label in where)
        most_over = max(r["best tok/s"] / one[r["memory"]]["best tok/s"] for r in faster)
        sentence = (f"The best of several machines beats one machine's best only {cases}, by at most "
                    f"{most_over:.2f} times")
    else:
        sentence = "The best of several machines never beats one machine's best over these links"
    several = [r for r in real if r["ranks"] > 1]
    published_rows = [r for r in real if r.get("latency from", "").startswith("published")]
    slowest = max(published_rows or real, key=lambda r: r["all_sum us"])["link"]  # a published link if any
    first = rows[0]["memory"]
    worst = [r for r in several if r["link"] == slowest and r["memory"] == first]
    free_many = [r for r in rows if r["link"] == bound and r["ranks"] > 1]
    return {
        "most": most, "pairs": len(pairs), "grows": grows,
        "best_slower": sum(1 for r in several if r["best tok/s"] < one[r["memory"]]["best tok/s"]),
        "several": len(several),
        "slow_link": slowest, "slow_memory": first,
        "slow_best_many": max(r["best tok/s"] for r in worst) if worst else float("nan"),
        "slow_best_one": one[first]["best tok/s"], "slow_plain_one": one[first]["plain tok/s"],
        "plain_free_faster": bool(free_many) and all(
            r["plain tok/s"] > one[r["memory"]]["plain tok/s"] for r in free_many),
        "speedup_one": max(r["MTP speedup"] for r in one.values()),
        "n_one": max(r["best n_draft"] for r in one.values()),
        "speedup_free": max(r["MTP speedup"] for r in free) if free else float("nan"),
        "speedup_many_min": min(r["MTP speedup"] for r in many),
        "speedup_many_max": max(r["MTP speedup"] for r in many),
        "n_many_min": min(r["best n_draft"] for r in many), "n_many_max": max(r["best n_draft"] for r in many),
        "plain_slower": all(r["plain tok/s"] < one[r["memory"]]["plain tok/s"] for r in real if r["ranks"] > 1),
        "faster": sentence,
    }


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def main() -> None:
    out, ranked = Path(sys.argv[1]), "--ranked" in sys.argv[2:]
    worker(out, ranked)


if __name__ == "__main__":
    main()
