"""Adaptive drafting: the width of each speculative step chosen from what the generation has measured.

A step that verifies k drafts emits on average tau(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens
(`throughput.expected_tokens_per_pass`) and costs c(k + 1), the seconds of one step at width k + 1 (the head's
k drafts and the trunk's pass over k + 1 tokens). The best width is the one with the most tokens per second,
tau(k) / c(k + 1). Neither is known in advance:

- the acceptance rates a_i are counted as the generation goes (drafts proposed and accepted at each position).
  A deep position is proposed only when the ones before it were accepted, so its count is small; each rate
  is shrunk towards a prior: the rate the previous generation with the same drafter ended with, or, for the
  first, the rate of the position before it (and `prior` at the first position);
- the cost of a step is a property of the model and the machine, not of the text: each width's compiled
  step is timed once per model, a few steps in a row from the prompt's state and pipelined as the decoding
  loop pipelines them (steps are pure functions of arrays, so running them and throwing the results away
  changes nothing), the widths interleaved, the median kept.

Plain decoding (width 1) is the fallback when drafting does not pay: it stops the head, so once chosen it
stays chosen (the head's cache would miss the positions decoded without it).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from .throughput import expected_tokens_per_pass

WIDTHS = (1, 2, 3, 4, 5)


@dataclass
class DraftPlanner:
    """Chooses the width (n_draft) of the next step from per-width step costs and the acceptance so far."""

    costs: dict[int, float]  # width -> seconds of one step at that width
    prior: float = 0.7  # acceptance assumed at the first position before any draft is seen
    priors: list[float] | None = None  # per position: rates carried over from an earlier generation
    weight: float = 4.0  # how many drafts the prior (or the position before) counts for
    margin: float = 0.03  # a new width must promise this much more (relative) than the current one
    plain_after: int = 16  # steps observed before the planner may give up drafting
    width: int = 0  # the width last chosen (0: none yet)
    steps: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        depth = max(self.costs) - 1
        self.proposed = self.proposed or [0] * depth
        self.accepted = self.accepted or [0] * depth

    def rates(self) -> list[float]:
        """Estimated acceptance per draft position: counts shrunk towards the position before."""
        out, before = [], self.prior
        for i, (proposed, accepted) in enumerate(zip(self.proposed, self.accepted)):
            guess = self.priors[i] if self.priors and i < len(self.priors) else before
            before = (accepted + self.weight * guess) / (proposed + self.weight)
            out.append(before)
        return out

    def tokens_per_second(self, width: int, rates: list[float] | None = None) -> float:
        rates = self.rates() if rates is None else rates
        return expected_tokens_per_pass(rates[: width - 1]) / self.costs[width]

    def choose(self) -> int:
        if self.width == 1:
            return 1
        rates = self.rates()  # once per step: the decoding loop calls this between trunk passes
        speed = {n: self.tokens_per_second(n, rates) for n in self.costs if n > 1 or self.steps >= self.plain_after}
        best = max(speed, key=speed.get)
        if self.width and best != self.width and speed[best] < (1 + self.margin) * speed[self.width]:
            best = self.width  # not worth a switch (and a new trace) for what the noise could explain
        self.width = best
        return best

    def observe(self, drafts: int, accepted: int) -> None:
        """One step: `drafts` proposed, the first `accepted` of them kept."""
        self.steps += 1
        for i in range(min(accepted + 1, drafts)):
            self.proposed[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1


def time_steps(runs: dict, inputs: dict, rounds: int = 3, chain: int = 4) -> dict[int, float]:
    """Seconds of one step at each width as the decoding loop runs them: `chain` steps of `runs[n]` one after
    the other from `inputs[n]` = (state, last, key), each queued before the host waits for the one before
    (so what the loop overlaps is overlapped here too). Per width the median over `rounds`, the widths
    interleaved round by round so that a slow spell of the machine does not fall on one of them."""
    for n, run in runs.items():  # the first calls of each trace and compile it
        mx.eval(run(*inputs[n])[2])
    times = {n: [] for n in runs}
    for _ in range(rounds):
        for n, run in runs.items():
            started = time.perf_counter()
            out = run(*inputs[n])
            mx.async_eval(out[2])
            for _ in range(chain - 1):
                queued = run(out[0], out[1], out[4])
                mx.async_eval(queued[2])
                out[2].tolist()
                out = queued
            out[2].tolist()
            times[n].append((time.perf_counter() - started) / chain)
    return {n: statistics.median(t) for n, t in times.items()}
