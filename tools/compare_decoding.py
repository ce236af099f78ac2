"""`qmtp.generate` and `qmtp.generate_batch` timed on two checkouts side by side (issue 44's "measure before you
cut"): one worker process per checkout, each with its DIR first on PYTHONPATH, the same held-out prompts, and the
rounds alternating between the workers (the order reversed each round), so the machine's drift of tens of percent
between minutes falls on both alike; within a round the versions alternate case by case, so a pair of cells is
seconds apart. Each cell is the median over rounds of tokens after the first over the time from the first token
to the last, summed over the prompts; the ratio columns are medians of the paired per-round ratios, by the wall
clock and by the worker's CPU time (`time.process_time`: what a machine shared with other guests steals from a
process shows in its wall time, not in its CPU time).

    python tools/compare_decoding.py --version old=/path/to/old/checkout --version new=. [--rounds 5]
                                     [--max-tokens 64] [--prompts 4] [--widths 1 2 3 4 5 auto] [--rows 4]

`--rows N` also times `generate_batch` over N rows at each width (aggregate tokens/s). Greedy: each worker also
checks that every width's tokens equal its plain ones, and the table says whether the versions agree.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def worker() -> None:
    import time

    import mlx.core as mx

    import qmtp
    from qmtp.book.evaluate import heldout_prompts
    from qmtp.tiny.corpus import REGISTERS

    model = qmtp.load()
    config = json.loads(sys.stdin.readline())
    count = config["prompts"]  # the prompts `bench mtp --prompts N` takes: the first of each register in turn
    prompts = heldout_prompts(model, -(-count // len(REGISTERS)))[:count]
    max_tokens, rows = config["max_tokens"], config["rows"]
    widths = [w if w == "auto" else int(w) for w in config["widths"]]

    def single(width):
        tokens, seconds, outs = 0, 0.0, []
        cpu = time.process_time()
        for p in prompts:
            g = qmtp.generate(model, p, max_tokens=max_tokens, n_draft=width, stop_at_eos=False)
            tokens += g.stats.generated - 1
            seconds += g.stats.decode_seconds
            outs.append(g.tokens)
        return tokens / seconds, tokens / (time.process_time() - cpu), outs

    def batch(width):
        batch_prompts = (prompts * rows)[:rows]
        started, cpu = time.perf_counter(), time.process_time()
        result = qmtp.generate_batch(model, batch_prompts, max_tokens=max_tokens, n_draft=width, stop_at_eos=False)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        tokens = sum(len(g.tokens) for g in result)
        return tokens / seconds, tokens / cpu, [g.tokens for g in result]

    cases = [("generate", w) for w in widths] + ([("batch", w) for w in widths] if rows else [])
    run = {"generate": single, "batch": batch}
    plain = {}
    for kind, w in cases:  # warm-up: every width's traces, and plain decoding's tokens
        outs = run[kind](w)[-1]
        if w == 1:
            plain[kind] = outs
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        kind, w = cases[json.loads(line)["case"]]
        speed, cpu_speed, outs = run[kind](w)
        print(json.dumps({"name": f"{kind} {w}", "speed": speed, "cpu": cpu_speed,
                          "exact": kind not in plain or outs == plain[kind]}), flush=True)
        mx.clear_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="append", required=True, metavar="LABEL=DIR")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--widths", nargs="+", default=["1", "2", "3", "4", "5", "auto"])
    parser.add_argument("--rows", type=int, default=0)
    args = parser.parse_args()
    versions = [v.split("=", 1) for v in args.version]
    workers = {}
    for label, directory in versions:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(directory)}
        workers[label] = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env, cwd=os.path.abspath(directory))
        workers[label].stdin.write(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens,
                                               "rows": args.rows, "widths": args.widths}) + "\n")
        workers[label].stdin.flush()
    for label, process in workers.items():
        json.loads(process.stdout.readline())
    n_cases = len(args.widths) * (2 if args.rows else 1)
    speeds = {label: {} for label in workers}
    cpu_speeds = {label: {} for label in workers}
    exact = {label: {} for label in workers}
    labels = list(workers)
    for r in range(args.rounds):
        shift = r % n_cases
        for case in list(range(n_cases))[shift:] + list(range(n_cases))[:shift]:
            for label in (labels if r % 2 == 0 else labels[::-1]):
                workers[label].stdin.write(json.dumps({"case": case}) + "\n")
                workers[label].stdin.flush()
                answer = json.loads(workers[label].stdout.readline())
                name = answer["name"]
                speeds[label].setdefault(name, []).append(answer["speed"])
                cpu_speeds[label].setdefault(name, []).append(answer["cpu"])
                exact[label][name] = exact[label].get(name, True) and answer["exact"]
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    first = labels[0]
    names = list(speeds[first])
    header = "| case | " + " | ".join(f"{label} tok/s (min-max)" for label in labels) + " | " + \
        " | ".join(f"{label}/{first}" for label in labels[1:]) + " | " + \
        " | ".join(f"{label}/{first} CPU" for label in labels[1:]) + " | " + \
        " | ".join(f"{label}/plain" for label in labels) + " |"
    print(header)
    print("|" + "---|" * (1 + 2 * len(labels) + 2 * (len(labels) - 1)))
    for name in names:
        cells = []
        for label in labels:
            s = speeds[label][name]
            mark = "" if exact[label][name] else " (tokens differ from plain!)"
            cells.append(f"{statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f}){mark}")
        ratios = [statistics.median(a / b for a, b in zip(speeds[label][name], speeds[first][name]))
                  for label in labels[1:]]
        ratios += [statistics.median(a / b for a, b in zip(cpu_speeds[label][name], cpu_speeds[first][name]))
                   for label in labels[1:]]
        kind = name.split()[0]
        over_plain = [statistics.median(a / b for a, b in zip(speeds[label][name], speeds[label][f"{kind} 1"]))
                      for label in labels]
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.3f}x" for x in ratios) + " | "
              + " | ".join(f"{x:.2f}x" for x in over_plain) + " |")


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
