"""Does timing the widths in the same rounds keep them in order on a busy machine? (issue 34, item 8)

Chapter 6 times a verify pass over n_draft tokens at each width. Timed one width after another (`bench.pass_costs`
per width, as the chapter did before), a slow spell of a shared machine falls on some widths and not others, and a
wider pass can come out faster than a narrower one. `bench.interleaved_pass_costs` times every width in each round.

This script runs both on the bundled model, alternating, with a neighbour process that burns a core in bursts of
random length (seeded), and counts the runs in which some wider width's median came out below a narrower one's.

    PYTHONPATH=. python tools/measure_pass_order.py [--runs 8] [--json out.json]

"old": each width timed alone, one after another, with pass_costs' defaults (30 calls); "old, 200 calls": the
same with as many calls per width as the new timing makes, so that a difference is the order, not the count;
"new": interleaved_pass_costs with its defaults (up to 200 rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

NEIGHBOUR = """
import random, time
random.seed(0)
while True:
    end = time.perf_counter() + random.uniform(0.2, 1.5)
    while time.perf_counter() < end:
        pass
    time.sleep(random.uniform(0.2, 1.5))
"""
WIDTHS = (1, 2, 3, 4, 5)


def inversions(verify_ms: dict[int, float]) -> int:
    """Pairs of widths where the wider pass's median is below the narrower one's."""
    return sum(verify_ms[b] < verify_ms[a] for a in WIDTHS for b in WIDTHS if b > a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import qmtp
    from qmtp.book import bench, evaluate

    model = qmtp.load()
    prompt = evaluate.heldout_prompts(model, 1)[0]
    timings = {
        "old": lambda: {n: bench.pass_costs(model, prompt, n)["verify"] for n in WIDTHS},
        "old, 200 calls": lambda: {n: bench.pass_costs(model, prompt, n, repeats=200)["verify"] for n in WIDTHS},
        "new": lambda: {n: c["verify"] for n, c in bench.interleaved_pass_costs(model, prompt, WIDTHS).items()},
    }
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    runs = {name: [] for name in timings}
    try:
        for run in range(args.runs):
            order = list(timings)[run % len(timings):] + list(timings)[:run % len(timings)]
            for name in order:
                started = time.perf_counter()
                verify_ms = {n: s * 1e3 for n, s in timings[name]().items()}
                runs[name].append({"verify_ms": verify_ms, "inversions": inversions(verify_ms),
                                   "seconds": time.perf_counter() - started})
                print(f"run {run} {name:>15}: " + " ".join(f"{verify_ms[n]:.3f}" for n in WIDTHS)
                      + f" ms, {runs[name][-1]['inversions']} inverted pairs", flush=True)
    finally:
        neighbour.kill()
        neighbour.wait()
    summary = {}
    for name, found in runs.items():
        summary[name] = {
            "runs": len(found),
            "runs_with_a_wider_width_faster": sum(r["inversions"] > 0 for r in found),
            "inverted_pairs": sum(r["inversions"] for r in found),
            "median_verify_ms": {n: statistics.median(r["verify_ms"][n] for r in found) for n in WIDTHS},
            "spread_verify_ms": {n: max(r["verify_ms"][n] for r in found) - min(r["verify_ms"][n] for r in found)
                                 for n in WIDTHS},
            "seconds_per_run": statistics.median(r["seconds"] for r in found),
        }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
