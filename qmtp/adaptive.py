"""Adaptive drafting: the width of each speculative step chosen from what the generation has measured.

A step that verifies k drafts emits on average tau(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens
(`expected_tokens_per_pass`) and costs c(k + 1), the seconds of one step at width k + 1 (the head's
k drafts and the trunk's pass over k + 1 tokens). The best width is the one with the most tokens per second,
tau(k) / c(k + 1). Neither is known in advance:

- the acceptance rates a_i are counted as the generation goes (drafts proposed and accepted at each position),
  and the counts are carried from one generation to the next with the same drafter. Old counts fade (every
  step multiplies them by `decay`), and each rate is shrunk towards the rate of the position before it (and
  `prior` at the first position). Together these keep a width from being shut out for good: at width w the
  positions past w - 1 are never proposed, so a low rate once seen there would, if it were kept, keep every
  wider width out for the rest of the process. Faded, such a position drifts back to the rate of the one
  before, which is still counted, and the wider widths get tried again;
- the cost of a step is a property of the model and the machine, not of the text: each width's compiled
  step is timed once per model, pipelined as the decoding loop pipelines them (`time_steps`), the widths
  interleaved in short rounds, as many as the machine's noise needs for the widths' relative costs to be
  known to a few percent (the choice between near widths turns on that). The planner does not correct
  these costs by the steps it runs: on a shared machine a step's time varies by a third from one step to
  the next and by more from one second to the next, so the few steps a generation times at each width say
  less about the widths' relative costs (all that matters to the choice) than the calibration does.

Plain decoding (width 1) is the fallback when drafting does not pay: it stops the head, so once chosen it
stays chosen (the head's cache would miss the positions decoded without it).
"""

from __future__ import annotations

import math
import statistics
import time
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
    weight: float = 4.0  # how many drafts the position before (or the prior) counts for
    decay: float = 0.95  # per step, what the counts keep: about the last 20 steps count
    plain_after: int = 16  # steps observed before the planner may give up drafting
    width: int = 0  # the width last chosen (0: none yet)
    steps: int = 0
    proposed: list[float] = field(default_factory=list)  # per position, drafts proposed (faded counts)
    accepted: list[float] = field(default_factory=list)  # per position, drafts accepted (faded counts)

    def __post_init__(self):
        depth = max(self.costs) - 1
        self.proposed = list(self.proposed) or [0.0] * depth
        self.accepted = list(self.accepted) or [0.0] * depth

    def rates(self) -> list[float]:
        """Estimated acceptance per draft position: counts shrunk towards the position before."""
        out, before = [], self.prior
        for proposed, accepted in zip(self.proposed, self.accepted):
            before = (accepted + self.weight * before) / (proposed + self.weight)
            out.append(before)
        return out

    def tokens_per_second(self, width: int, rates: list[float] | None = None) -> float:
        rates = self.rates() if rates is None else rates
        return expected_tokens_per_pass(rates[: width - 1]) / self.costs[width]

    def choose(self) -> int:
        if self.width == 1:
            return 1
        rates = self.rates()  # once per step: the decoding loop calls this between trunk passes
        # No hysteresis: switching width between steps costs nothing (each width's step is compiled once).
        self.width = max((n for n in self.costs if n > 1 or self.steps >= self.plain_after),
                         key=lambda n: self.tokens_per_second(n, rates))
        return self.width

    def observe(self, drafts: int, accepted: int) -> None:
        """One step: `drafts` proposed, the first `accepted` of them kept."""
        self.steps += 1
        self.proposed = [p * self.decay for p in self.proposed]
        self.accepted = [a * self.decay for a in self.accepted]
        for i in range(min(accepted + 1, drafts)):
            self.proposed[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1


def time_steps(runs: dict, inputs: dict, rounds: tuple[int, int] = (12, 32), precision: float = 0.03,
               chain: int = 1, budget: float = 10.0, agree=None) -> dict[int, float]:
    """Seconds of one step at each width as the decoding loop runs them: each step queued before the host
    waits for the one before (so what the loop overlaps is overlapped here too), and timed as an interval
    between two reads inside a run of steps of one width.

    Only inside such a run is that interval one step's cost: where the host waits differs by device (on
    the CPU, MLX computes a step while the host queues it; on a GPU, while the host reads the one before),
    so an interval next to a change of width measures a neighbour as often as itself. `runs[n]` is width
    n's step, `inputs[n]` = (state, last, key) its first inputs; each round runs `chain` + 2 steps of every
    width from its inputs, the order rotated from round to round.

    What the planner needs is the widths' costs relative to each other to a few percent, and a shared
    machine's pace drifts from one second to the next by more than that: so the runs are short (the widths
    close in time), each round's times are taken relative to that round's geometric mean (a slow round
    slows every width alike), and the median over the rounds is kept, scaled by the median round. Rounds
    are added, from `rounds[0]` up to `rounds[1]`, until every width's median is known to `precision`
    (relative standard error): a quiet machine is done in the fewest (about 2 s for the bundled model on
    2 cores), a busy one takes more (up to about 8 s there). Rounds stop once they have taken `budget`
    seconds, and where steps take seconds (the real model on a small machine) fewer than `rounds[0]` are
    run, to stay within about that.

    `agree`: for ranks that run each step together (`qmtp.parallel`), a function from this rank's value to
    rank 0's: how many rounds at least and when to stop are decided by timings, which differ between ranks,
    and a rank that ran one round more would wait forever on the others' collectives."""
    widths = list(runs)
    for n in widths:  # the first calls of each trace and compile it
        mx.eval(runs[n](*inputs[n])[2])
    started = time.perf_counter()
    for n in widths:
        mx.eval(runs[n](*inputs[n])[2])
    step = (time.perf_counter() - started) / len(widths)
    fewest = max(1, min(rounds[0], int(budget / (step * len(widths) * (chain + 2)))))
    if agree is not None:
        fewest = int(agree(fewest))
    relative, scales = {n: [] for n in widths}, []  # per round: log(time / the round's geometric mean)
    started = time.perf_counter()
    for r in range(rounds[1]):
        times = {}
        for n in widths[r % len(widths):] + widths[: r % len(widths)]:
            out = runs[n](*inputs[n])
            mx.async_eval(out[2])
            read, intervals = None, []
            for i in range(chain + 1):
                queued = runs[n](out[0], out[1], out[4])
                mx.async_eval(queued[2])
                out[2].tolist()
                now = time.perf_counter()
                if read is not None:  # the first read comes after a start from rest
                    intervals.append(now - read)
                out, read = queued, now
            out[2].tolist()
            times[n] = math.log(statistics.median(intervals))
        scales.append(statistics.fmean(times.values()))
        for n in widths:
            relative[n].append(times[n] - scales[-1])
        done = r + 1 >= fewest and (time.perf_counter() - started > budget or
                                    max(map(_median_error, relative.values())) < precision)
        if agree is not None:
            done = bool(agree(done))
        if done:
            break
    scale = statistics.median(scales)
    return {n: math.exp(statistics.median(r) + scale) for n, r in relative.items()}


def _median_error(values: list[float]) -> float:
    """Standard error of the median of `values`, from their spread (median absolute deviation, robust to the
    slow steps a busy machine throws in): 1.25 sigma / sqrt(n), sigma = 1.48 MAD as for a normal sample."""
    middle = statistics.median(values)
    return 1.25 * 1.4826 * statistics.median(abs(v - middle) for v in values) / math.sqrt(len(values))
