"""Adaptive drafting: the width of each speculative step chosen from what the generation has measured.

A step that verifies k drafts emits on average tau(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens
(`expected_tokens_per_pass`) and costs c(k + 1), the seconds of one step at width k + 1 (the head's
k drafts and the trunk's pass over k + 1 tokens). The best width is the one with the most tokens per second,
tau(k) / c(k + 1). Neither is known in advance:

- the acceptance rates a_i are counted as the generation goes (drafts proposed and accepted at each position).
  A deep position is proposed only when the ones before it were accepted, so its count is small; each rate
  is shrunk towards a prior: the rate the previous generation with the same drafter ended with, or, for the
  first, the rate of the position before it (and `prior` at the first position);
- the cost of a step is a property of the model and the machine, not of the text: each width's compiled
  step is timed once per model, a few steps in a row from the prompt's state and pipelined as the decoding
  loop pipelines them (`time_steps`) (steps are pure functions of arrays, so running them and throwing the results away
  changes nothing), the widths interleaved, the median kept. A shared machine is not as fast from one second
  to the next (here by a quarter), so those costs are corrected by the steps the generation runs: all
  widths are scaled by the machine's present pace (how long recent steps took against their calibrated
  costs), and each width by how its own steps compared with the pace of their moment. A width is only timed if it is chosen,
  so one whose calibration came out too slow would never be: widths with few timed steps are credited with
  a little optimism (an upper confidence bound, as in a bandit), enough to try the ones near the best.

Plain decoding (width 1) is the fallback when drafting does not pay: it stops the head, so once chosen it
stays chosen (the head's cache would miss the positions decoded without it).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

WIDTHS = (1, 2, 3, 4, 5)


def expected_tokens_per_pass(rates) -> float:
    """1 + sum_i prod_{j<=i} a_j: tokens a step emits on average, given per-position acceptance rates a_j."""
    total, survive = 1.0, 1.0
    for a in rates:
        survive *= a
        total += survive
    return total


@dataclass
class DraftPlanner:
    """Chooses the width (n_draft) of the next step from per-width step costs and the acceptance so far."""

    costs: dict[int, float]  # width -> seconds of one step at that width
    prior: float = 0.7  # acceptance assumed at the first position before any draft is seen
    priors: list[float] | None = None  # per position: rates carried over from an earlier generation
    weight: float = 4.0  # how many drafts the prior (or the position before) counts for
    margin: float = 0.03  # a new width must promise this much more (relative) than the current one
    plain_after: int = 16  # steps observed before the planner may give up drafting
    window: int = 16  # recent steps kept to correct the calibrated costs
    explore: float = 0.2  # optimism for a width with few timed steps, so that a near-best one gets tried
    width: int = 0  # the width last chosen (0: none yet)
    steps: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    paces: dict = field(default_factory=dict)  # width -> its recent steps' paces over the pace of their moment

    def __post_init__(self):
        depth = max(self.costs) - 1
        self.proposed = self.proposed or [0] * depth
        self.accepted = self.accepted or [0] * depth
        self.recent = deque(maxlen=self.window)  # the same ratio for the last steps of any width

    def cost(self, width: int) -> float:
        """Seconds of a step at `width` now: its calibrated cost scaled by the machine's present pace (all
        recent steps against their calibrated costs) and by how this width's own steps compared with the
        pace of their moment, shrunk (as the rates are) towards 1. Relative, so that a width last run in a
        slow spell is not priced by it; medians, since the first step after a switch of width can include
        tracing the step for the new pair of shapes, many steps' worth."""
        mine = self.paces.get(width, ())
        pace = statistics.median(self.recent) if self.recent else 1.0
        shape = statistics.median(mine) if mine else 1.0
        return self.costs[width] * pace * (len(mine) * shape + self.weight) / (len(mine) + self.weight)

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
        return expected_tokens_per_pass(rates[: width - 1]) / self.cost(width)

    def choose(self) -> int:
        if self.width == 1:
            return 1
        rates = self.rates()  # once per step: the decoding loop calls this between trunk passes
        speed = {n: self.tokens_per_second(n, rates) * self._optimism(n)
                 for n in self.costs if n > 1 or self.steps >= self.plain_after}
        best = max(speed, key=speed.get)
        if self.width and best != self.width and speed[best] < (1 + self.margin) * speed[self.width]:
            best = self.width  # not worth a switch (and a new trace) for what the noise could explain
        self.width = best
        return best

    def _optimism(self, width: int) -> float:
        """1 + explore / sqrt(1 + timed steps): a width whose calibrated cost may be off by the noise of a
        few timed steps is credited with that much, until its own steps have been timed. Not for plain
        decoding: it cannot be tried and left (it stops the head)."""
        return 1.0 if width == 1 else 1 + self.explore / math.sqrt(1 + len(self.paces.get(width, ())))

    def observe(self, drafts: int, accepted: int, seconds: float | None = None) -> None:
        """One step: `drafts` proposed, the first `accepted` of them kept, in `seconds` (None: not timed, e.g.
        a step the host could not queue ahead, whose time is not a step's cost)."""
        self.steps += 1
        if seconds is not None:
            pace = seconds / self.costs[drafts + 1]
            self.recent.append(pace)
            relative = pace / statistics.median(self.recent)
            self.paces.setdefault(drafts + 1, deque(maxlen=self.window)).append(relative)
        for i in range(min(accepted + 1, drafts)):
            self.proposed[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1


def time_steps(runs: dict, inputs: dict, rounds: int = 4, chain: int = 3, budget: float = 20.0) -> dict[int, float]:
    """Seconds of one step at each width as the decoding loop runs them: each step queued before the host
    waits for the one before (so what the loop overlaps is overlapped here too), and timed as the loop's
    planner times it, by the interval between two reads inside a run of steps of one width.

    Only inside such a run is that interval one step's cost: where the host waits differs by device (on
    the CPU, MLX computes a step while the host queues it; on a GPU, while the host reads the one before),
    so an interval next to a change of width measures a neighbour as often as itself. `runs[n]` is width
    n's step, `inputs[n]` = (state, last, key) its first inputs; each round runs `chain` + 2 steps of every
    width from its inputs, the order rotated from round to round so that a slow spell of the machine falls
    on every width; the median over the rounds is kept. Where steps take seconds (the real model on a small
    machine), fewer rounds and shorter runs keep the whole within about `budget` seconds."""
    times = {n: [] for n in runs}
    widths = list(runs)
    for n in widths:  # the first calls of each trace and compile it
        mx.eval(runs[n](*inputs[n])[2])
    started = time.perf_counter()
    for n in widths:
        mx.eval(runs[n](*inputs[n])[2])
    step = (time.perf_counter() - started) / len(widths)
    while chain > 1 and step * len(widths) * (chain + 2) * rounds > budget:
        chain -= 1
    rounds = max(1, min(rounds, int(budget / (step * len(widths) * (chain + 2)))))
    for r in range(rounds):
        for n in widths[r % len(widths):] + widths[: r % len(widths)]:
            out = runs[n](*inputs[n])
            mx.async_eval(out[2])
            read = None
            for i in range(chain + 1):
                queued = runs[n](out[0], out[1], out[4])
                mx.async_eval(queued[2])
                out[2].tolist()
                now = time.perf_counter()
                if read is not None:  # the first read comes after a start from rest
                    times[n].append(now - read)
                out, read = queued, now
            out[2].tolist()
    return {n: statistics.median(t) for n, t in times.items()}
