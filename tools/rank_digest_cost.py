"""What the ranks' digests cost at load (issue 32 item 1): on each rank of a group, `qmtp.load(path, group=...)`
timed as it is (every loaded tensor hashed beside the reading and checked) and with the hashing and the check
switched off, alternating, the page cache warm for both, each until every rank has loaded. Rank 0 prints one JSON
line of the medians.

    python tools/rank_digest_cost.py CHECKPOINT [ROUNDS]

starts 2 ranks on this machine through `qmtp.launch.run`, as the tests start them.
"""

import json
import statistics
import sys
import time


def rank_main(path: str, rounds: int) -> None:
    import mlx.core as mx

    import qmtp
    from qmtp import parallel

    group = mx.distributed.init(strict=True)
    hashing = (parallel.Holdings.add, parallel.Holdings.add_others, parallel.Holdings.agree)

    def switched_off():
        parallel.Holdings.add = lambda self, *args: None
        parallel.Holdings.add_others = lambda self, *args: None
        parallel.Holdings.agree = lambda self, group: self.close()

    def switched_on():
        parallel.Holdings.add, parallel.Holdings.add_others, parallel.Holdings.agree = hashing

    times = {"with digests": [], "without": []}
    qmtp.load(path, group=group, tokenizer=False)  # the page cache warm for both
    for _ in range(rounds):
        for mode, switch in (("with digests", switched_on), ("without", switched_off)):
            switch()
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # both ranks start together
            started = time.perf_counter()
            model = qmtp.load(path, group=group, tokenizer=False)
            # until every rank has loaded: the check ends in a collective that waits for the slowest rank, and
            # decoding's first collective would wait for it without the check too
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
            times[mode].append(time.perf_counter() - started)
            del model
            mx.clear_cache()
    switched_on()
    if group.rank() == 0:
        with_, without = (statistics.median(times[m]) for m in ("with digests", "without"))
        print(json.dumps({"checkpoint": path, "rounds": rounds, "load s with digests": round(with_, 3),
                          "load s without": round(without, 3), "cost": round(with_ / without - 1, 3)}))


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        from qmtp import launch

        rounds = sys.argv[2] if len(sys.argv) > 2 else "3"
        sys.exit(launch.run([__file__, "--rank", sys.argv[1], rounds], ranks=2, timeout=3600))
