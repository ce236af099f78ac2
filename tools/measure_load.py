"""Time `qmtp.load` of one model and its peak RSS, in fresh processes, alternating two (or more) checkouts.

    python tools/measure_load.py MODEL --repo main=/work/main --repo branch=/work/wt-names [--pairs 3]
                                 [--layers K] [--python .venv/bin/python]

Each round runs every checkout once, in the order given, each in a fresh process with PYTHONPATH set to that
checkout: `qmtp.load(MODEL, tokenizer=False)`, timed inside the process (after the import), then the process's
peak RSS as the kernel counts it (wait4's ru_maxrss). A first untimed load warms the page cache. Prints one
line per run and, per checkout, the median and range of the load time and peak RSS.

For the full-size model (about 20 GiB as 4-bit, so the machine needs that much free memory, and one load at a
time): convert it first (`python -m qmtp convert SRC q4 --bits 4`), then run this with --pairs 3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = """
import sys, time
import qmtp
path, layers = sys.argv[1], (None if sys.argv[2] == "-" else int(sys.argv[2]))
start = time.perf_counter()
model = qmtp.load(path, tokenizer=False, **({} if layers is None else {"layers": layers}))
print(f"{time.perf_counter() - start:.3f} {qmtp.__file__}")
"""


def run_once(python: str, repo: str, model: str, layers) -> tuple[float, float, str]:
    env = dict(os.environ, PYTHONPATH=repo)
    env.pop("QMTP_MODEL", None)
    # cwd: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    proc = subprocess.Popen([python, "-c", CHILD, model, "-" if layers is None else str(layers)], env=env, cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{repo}: the load failed ({proc.returncode}): {err.strip()[-500:]}")
    seconds, where = out.split()
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return float(seconds), rss / 2**30, where


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=os.path.abspath)
    parser.add_argument("--repo", action="append", required=True, help="NAME=PATH of a checkout (repeat)")
    parser.add_argument("--pairs", type=int, default=3, help="rounds (each runs every checkout once)")
    parser.add_argument("--layers", type=int, default=None, help="qmtp.load(..., layers=K) (checkouts that have it)")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    repos = [r.split("=", 1) for r in args.repo]
    run_once(args.python, repos[0][1], args.model, args.layers)  # warm the page cache
    results = {name: [] for name, _ in repos}
    for round_ in range(args.pairs):
        for name, repo in repos:
            seconds, rss, where = run_once(args.python, repo, args.model, args.layers)
            results[name].append((seconds, rss))
            print(f"round {round_ + 1} {name:>8}: load {seconds:7.3f} s, peak RSS {rss:6.3f} GiB  ({where})",
                  flush=True)
    for name, runs in results.items():
        t, r = [x[0] for x in runs], [x[1] for x in runs]
        print(f"{name:>8}: load median {statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f}), "
              f"peak RSS median {statistics.median(r):.3f} GiB ({min(r):.3f}-{max(r):.3f}), {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
