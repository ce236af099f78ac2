"""Where a decoding step's time goes, width by width, on one row (issue 44 item 6's per-phase profile).

For each n_draft: the compiled step as `generate` runs it ("step"), and, compiled alone from the same state, its
head's drafts ("draft") and its trunk pass with the logits ("verify"); "accept + roll back" is the step less the
two. "host" is what a pass of `generate` costs beyond its step (the loop's Python, the report read, the books):
its decode seconds per pass less the step. Every shape is timed in the same rounds, in an order that shifts
each round; each cell is the median over rounds, in milliseconds. The last columns price a token: a pass's wall
time over the tokens it emits, and that over plain decoding's.

    python tools/profile_step.py [--rounds 10] [--max-tokens 64] [--widths 1 2 3 4 5]

With PYTHONPATH=DIR it profiles that checkout, also one from before the one step (3ad6b01).
"""

import argparse
import statistics
import time

import mlx.core as mx

import qmtp
from qmtp import decoding
from qmtp.book.evaluate import heldout_prompts
try:
    from qmtp.continuous import prefill as _prefill
except ImportError:  # a checkout before generate ran through the batch
    from qmtp.speculative import _prefill

ONE_STEP = hasattr(decoding, "compiled_step")
if ONE_STEP:
    from qmtp.acceptance import Greedy
else:
    from qmtp.decoding import Greedy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    args = parser.parse_args()
    model = qmtp.load()
    greedy = Greedy()
    prompts = heldout_prompts(model, 1)[:4]
    prompt = prompts[0]
    calls = {}
    for n in args.widths:
        k = n - 1
        head = model.mtp if k else None
        state, last, _ = _prefill(model, head, prompt, decoding.capacity_for(len(prompt) + args.max_tokens + 2 * n),
                                  n, greedy, "post", mx.random.key(0))
        keys = mx.random.key(0)[None]
        tokens = mx.zeros((1, n), mx.int32)
        if ONE_STEP:
            step = decoding.compiled_step(model, model.mtp, k, (greedy,), (k,), "post", True)
            calls[n, "step"] = lambda step=step, s=state, l=last: step(s, l, keys)[2]
            drafts = lambda s, l, k=k: decoding.draft(model, model.mtp, k, (greedy,), (k,), s, l, [keys[0]])[0]
        else:  # a checkout before the one step (3ad6b01): the single-row step and its own draft
            from qmtp.speculative import _compiled_step
            step = _compiled_step(model, model.mtp, k, greedy, "post", k > 0)
            calls[n, "step"] = lambda step=step, s=state, l=last: step(s, l, keys[0])[2]
            drafts = lambda s, l, k=k: decoding.draft(model, model.mtp, k, greedy, s, l, keys[0])[0]
        verify = mx.compile(lambda s, t, k=k: decoding.verify(model, t, s, k > 0)[2], inputs=[model.state])
        calls[n, "verify"] = lambda verify=verify, s=state, t=tokens: verify(s, t)
        if k:
            draft = mx.compile(drafts, inputs=[model.state])
            calls[n, "draft"] = lambda draft=draft, s=state, l=last: draft(s, l)

        def generation(n=n):
            passes = seconds = emitted = 0
            for p in prompts:
                g = qmtp.generate(model, p, max_tokens=args.max_tokens, n_draft=n, stop_at_eos=False)
                passes += g.stats.trunk_passes
                seconds += g.stats.decode_seconds
                emitted += g.stats.generated - 1
            return seconds / passes, emitted / passes
        calls[n, "generate"] = generation
    names = list(calls)
    for name in names:  # warm-up: traces and compiles
        for _ in range(3):
            out = calls[name]()
            if name[1] != "generate":
                mx.eval(out)
    times = {name: [] for name in names}
    per_pass = {n: [] for n in args.widths}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name[1] == "generate":
                seconds, tokens = calls[name]()
                times[name].append(seconds)
                per_pass[name[0]].append(tokens)
                continue
            started = time.perf_counter()
            mx.eval(calls[name]())
            times[name].append(time.perf_counter() - started)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    plain = ms[args.widths[0], "generate"] / statistics.median(per_pass[args.widths[0]])
    print("| n_draft | step | draft | verify | accept + roll back | host | pass (wall) | tokens/pass | ms/token | "
          "token cost / plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.widths:
        draft = ms.get((n, "draft"), 0.0)
        tokens = statistics.median(per_pass[n])
        wall = ms[n, "generate"]
        print(f"| {n} | {ms[n, 'step']:.2f} | {draft:.2f} | {ms[n, 'verify']:.2f} | "
              f"{ms[n, 'step'] - draft - ms[n, 'verify']:.2f} | {wall - ms[n, 'step']:.2f} | {wall:.2f} | "
              f"{tokens:.2f} | {wall / tokens:.2f} | {wall / tokens / plain:.2f} |")


if __name__ == "__main__":
    main()
