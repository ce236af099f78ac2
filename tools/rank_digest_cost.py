"""What the ranks' digests cost at load (issue 32 item 1): on each rank of a group, `qmtp.load(path, group=...)`
timed as it is (every loaded tensor hashed and checked) and with the hashing and the check switched off,
alternating in each round, each time until every rank has loaded. Prints one JSON line per version of the code.

    python tools/rank_digest_cost.py CHECKPOINT [--rounds N] [--launches N] [--cold]
                                     [--version LABEL=DIR ...]

Each launch starts 2 ranks on this machine through `qmtp.launch.run`, as the tests start them. With `--version`
(repeatable), each launch runs every version in turn, in an order that alternates between launches, with DIR
first on the ranks' PYTHONPATH (a checkout of another commit): versions are compared side by side in one run, on
the same noisy machine, and the cost is each version's own ratio of its medians. The page cache is warm (one
untimed load first) unless `--cold`, which asks the kernel to drop it before each timed load (root only).
"""

import argparse
import io
import json
import os
import statistics
import sys
import time

MODES = ("with digests", "without")


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def rank_main(path: str, rounds: int, cold: bool) -> None:
    import mlx.core as mx

    import qmtp
    from qmtp import parallel

    group = mx.distributed.init(strict=True)
    hashing = (parallel.Holdings.add, parallel.Holdings.add_others, parallel.Holdings.agree)

    def switched_off():
        parallel.Holdings.add = lambda self, *args, **kwargs: None
        parallel.Holdings.add_others = lambda self, *args, **kwargs: None
        parallel.Holdings.agree = lambda self, group: self.close()

    def switched_on():
        parallel.Holdings.add, parallel.Holdings.add_others, parallel.Holdings.agree = hashing

    def together():
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))

    times = {mode: [] for mode in MODES}
    if not cold:
        qmtp.load(path, group=group, tokenizer=False)  # the page cache warm for both
    for round_ in range(rounds):
        # the order alternates, so neither mode always follows the other
        for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
            (switched_on if mode == MODES[0] else switched_off)()
            if cold:
                together()
                if group.rank() == 0:
                    drop_page_cache()
            together()  # both ranks start together
            started = time.perf_counter()
            model = qmtp.load(path, group=group, tokenizer=False)
            # until every rank has loaded: the check ends in a collective that waits for the slowest rank, and
            # decoding's first collective would wait for it without the check too
            together()
            times[mode].append(time.perf_counter() - started)
            del model
            mx.clear_cache()
    switched_on()
    if group.rank() == 0:
        print("TIMES " + json.dumps(times), flush=True)


def launch_once(path: str, rounds: int, cold: bool, pythonpath: str | None) -> dict:
    from qmtp import launch

    if pythonpath is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join([pythonpath] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    out = io.StringIO()
    argv = [__file__, "--rank", path, str(rounds)] + (["--cold"] if cold else [])
    code = launch.run(argv, ranks=2, timeout=3600, out=out)
    if code:
        sys.exit(f"the ranks failed (code {code}):\n{out.getvalue()}")
    line = next(line for line in out.getvalue().splitlines() if line.startswith("TIMES "))
    return json.loads(line[len("TIMES "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--rounds", type=int, default=3, help="timed loads of each mode per launch")
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each timed load")
    parser.add_argument("--version", action="append", default=[], metavar="LABEL=DIR",
                        help="a checkout to time (repeatable); default: the code this runs from")
    args = parser.parse_args()
    versions = [tuple(v.split("=", 1)) for v in args.version] or [("this checkout", None)]
    base_path = os.environ.get("PYTHONPATH")
    times = {label: {mode: [] for mode in MODES} for label, _ in versions}
    for launch_ in range(args.launches):
        for label, directory in (versions if launch_ % 2 == 0 else versions[::-1]):
            if base_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = base_path
            got = launch_once(args.checkpoint, args.rounds, args.cold, directory)
            for mode in MODES:
                times[label][mode] += got[mode]
    for label, _ in versions:
        with_, without = (statistics.median(times[label][m]) for m in MODES)
        # each round's two loads ran one after the other: their ratio is what a slow spell longer than a round
        # (which the medians of a version's launches may catch on one version only) leaves alone
        paired = statistics.median(a / b for a, b in zip(times[label][MODES[0]], times[label][MODES[1]]))
        print(json.dumps({"version": label, "checkpoint": args.checkpoint, "loads per mode": len(times[label][MODES[0]]),
                          "cold": args.cold, "load s with digests": round(with_, 3), "load s without": round(without, 3),
                          "cost": round(with_ / without - 1, 3), "cost, round by round": round(paired - 1, 3)}))


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main(sys.argv[2], int(sys.argv[3]), "--cold" in sys.argv)
    else:
        main()
