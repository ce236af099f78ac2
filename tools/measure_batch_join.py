"""How long a 2,000-token prompt joining a continuous batch stalls the rows already decoding (issue 35 item 2).

Three rows decode; then a long prompt is submitted. Each `step()` is one interval between the running rows'
tokens: the median interval before the join against the longest and the median while the prompt is prefilled
in chunks, and against the same join prefilled whole in one step (chunking off). Interleaved, `--rounds` times.

    PYTHONPATH=. python tools/measure_batch_join.py [--prompt 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import qmtp
from qmtp import Settings, continuous
from qmtp.continuous import ContinuousBatch


def intervals(model, long_prompt: list[int], chunked: bool) -> dict:
    batch = ContinuousBatch(model, max_batch=4)
    for text in ("The history of the city", "Once upon a time", "def fibonacci(n):"):
        batch.submit(model.tokenizer.encode(text), Settings.of(max_tokens=3000, n_draft=1, stop_at_eos=False))
    while batch.active < 3:
        batch.step()
    warm = batch.submit(long_prompt[:50], Settings.of(max_tokens=3, stop_at_eos=False))  # compiles 4 rows' step
    while not warm.done.is_set():
        batch.step()
    before = []
    for _ in range(30):
        started = time.perf_counter()
        batch.step()
        before.append(time.perf_counter() - started)
    saved = continuous.MAX_CHUNK, continuous.MIN_CHUNK
    if not chunked:
        continuous.MAX_CHUNK = continuous.MIN_CHUNK = len(long_prompt)
    try:
        joining = batch.submit(long_prompt, Settings.of(max_tokens=8, stop_at_eos=False))
        during = []
        while not joining.tokens and not joining.done.is_set():
            assert batch.active >= 3, "a running row ended before the long prompt joined: raise their max_tokens"
            started = time.perf_counter()
            batch.step()
            during.append(time.perf_counter() - started)
    finally:
        continuous.MAX_CHUNK, continuous.MIN_CHUNK = saved
    base = statistics.median(before)
    return {"median_before_ms": base * 1e3, "longest_during_ms": max(during) * 1e3,
            "median_during_ms": statistics.median(during) * 1e3, "steps_to_join": len(during),
            "longest_over_median_before": max(during) / base,
            "median_during_over_before": statistics.median(during) / base}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = qmtp.load()
    text = " ".join(["the city grew along the river and its people traded"] * 400)
    long_prompt = model.tokenizer.encode(text)[: args.prompt]
    for round_ in range(args.rounds):
        for chunked in (True, False):
            r = intervals(model, long_prompt, chunked)
            print(f"round {round_} {'chunked' if chunked else 'whole  '}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
