"""Expert parallelism measured: N ranks on this host (mlx.launch, ring) against one process, interleaved.

    PYTHONPATH=. python tools/measure_ep.py [--model DIR] [--ranks 2] [--rounds 3] [--max-tokens 32] [--json F]

Each round starts one process and one N-rank group (their order alternating from round to round, so a slow
spell of a shared machine falls on both alike), and each of them, fresh:
  - loads the model (one process: whole; ranks: expert-parallel) and records its peak RSS and the bytes of
    the weights it holds;
  - times greedy generation plain (n_draft 1) and with the MTP head (n_draft 2 and 3), after a warm-up run;
  - times one verify pass over 1..4 tokens (`bench.pass_costs`: each compiled and timed alone);
  - on the ranks, times one all_sum of a MoE layer's [1, k, H] float32 outputs, alone and 9 in a chain.
The driver reports medians over the rounds, the per-round ratios ranks / one process, and whether every
rank's tokens equal the single process's.
"""

from __future__ import annotations

import argparse
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
N_DRAFTS = (1, 2, 3)
VERIFY_TOKENS = (1, 2, 3, 4)


def worker(out_dir: Path, model_path, max_tokens: int, ranked: bool) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import qmtp
    from qmtp.book.bench import pass_costs

    group = mx.distributed.init(strict=True) if ranked else None
    model = qmtp.load(model_path, group=group)
    found = {"rank": group.rank() if group else 0, "ranks": group.size() if group else 1,
             "weights_bytes": sum(p.nbytes for _, p in tree_flatten(model.parameters())),
             "peak_rss_after_load": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
             "tokens": {}, "tokens_per_second": {}}
    prompt = model.tokenizer.encode(PROMPT) if model.tokenizer else [1, 2, 3, 4, 5]  # a synthetic model: ids
    for n in N_DRAFTS:
        qmtp.generate(model, prompt, max_tokens=max_tokens, n_draft=n, stop_at_eos=False)  # traces, compiles
        g = qmtp.generate(model, prompt, max_tokens=max_tokens, n_draft=n, stop_at_eos=False)
        found["tokens"][n] = g.tokens
        found["tokens_per_second"][n] = g.stats.tokens_per_second
    found["verify_seconds"] = {n: pass_costs(model, prompt, n, repeats=20, budget=4.0)["verify"]
                               for n in VERIFY_TOKENS}
    if group is not None:
        c = model.config
        x = mx.ones((1, c.num_experts_per_tok, c.hidden_size))
        mx.eval(mx.distributed.all_sum(x, group=group))
        alone, chained = [], []
        for i in range(100):
            started = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x + i, group=group))
            alone.append(time.perf_counter() - started)
        for i in range(30):
            y = x + i
            started = time.perf_counter()
            for _ in range(len(model.layers) + 1):  # one per MoE layer of the trunk and the head
                y = mx.distributed.all_sum(y * 0.5, group=group)
            mx.eval(y)
            chained.append((time.perf_counter() - started) / (len(model.layers) + 1))
        found["all_sum_seconds"] = statistics.median(alone)
        found["all_sum_chained_seconds_per_layer"] = statistics.median(chained)
    found["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out_dir / f"rank{found['rank']}.json").write_text(json.dumps(found))


def run_one(ranks: int, model, max_tokens: int) -> list[dict]:
    from qmtp import launch

    with tempfile.TemporaryDirectory() as tmp:
        argv = [os.path.abspath(__file__), "--worker", tmp, "--max-tokens", str(max_tokens)] + (["--model", str(model)] if model else [])
        if ranks == 1:
            subprocess.run([sys.executable, *argv], check=True, timeout=600)
        else:
            err = io.StringIO()
            code = launch.run([*argv, "--ranked"], ranks=ranks, timeout=600, out=io.StringIO(), err=err)
            if code:
                raise SystemExit(f"the {ranks} ranks failed:\n{err.getvalue()[-2000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ranked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.max_tokens, args.ranked)
    rounds = {1: [], args.ranks: []}
    for r in range(args.rounds):
        for ranks in ((1, args.ranks) if r % 2 == 0 else (args.ranks, 1)):
            rounds[ranks].append(run_one(ranks, args.model, args.max_tokens))
            print(f"round {r + 1}: {ranks} rank(s) done", file=sys.stderr, flush=True)
    report = summarise(rounds, args.ranks)
    report["command"] = " ".join(["python", "tools/measure_ep.py", *sys.argv[1:]])
    report["loadavg_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"report": report, "rounds": {str(k): v for k, v in rounds.items()}}, indent=1))


def summarise(rounds: dict, ranks: int) -> dict:
    alone, ranked = rounds[1], rounds[ranks]
    reference = alone[0][0]["tokens"]
    lossless = all(rank["tokens"] == reference for run in alone + ranked for rank in run)
    median = statistics.median
    out = {"lossless_every_rank_every_round": lossless, "rounds": len(alone)}
    for n in N_DRAFTS:
        n = str(n)
        one = [run[0]["tokens_per_second"][n] for run in alone]
        many = [run[0]["tokens_per_second"][n] for run in ranked]
        out[f"tok/s n_draft={n}"] = {"1 process": median(one), f"{ranks} ranks": median(many),
                                     "ratio (median of per-round ratios)": median(b / a for a, b in zip(one, many))}
    for n in VERIFY_TOKENS:
        n = str(n)
        out[f"verify ms, {n} tokens"] = {"1 process": 1e3 * median(run[0]["verify_seconds"][n] for run in alone),
                                         f"{ranks} ranks": 1e3 * median(run[0]["verify_seconds"][n] for run in ranked)}
    for what in ("weights_bytes", "peak_rss_after_load", "peak_rss"):
        out[what] = {"1 process": median(run[0][what] for run in alone),
                     **{f"rank {r}": median(run[r][what] for run in ranked) for r in range(ranks)}}
        out[what]["rank 0 / 1 process"] = out[what]["rank 0"] / out[what]["1 process"]
    out["all_sum us, [1, k, H] float32, alone"] = 1e6 * median(run[0]["all_sum_seconds"] for run in ranked)
    out["all_sum us per layer, chained"] = 1e6 * median(run[0]["all_sum_chained_seconds_per_layer"] for run in ranked)
    return out


if __name__ == "__main__":
    main()
