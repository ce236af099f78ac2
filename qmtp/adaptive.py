"""Adaptive drafting: the width of each speculative step chosen from what the generation has measured.

A step that verifies k drafts emits on average tau(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens
(`expected_tokens_per_pass`) and costs c(k + 1), the seconds of one step at width k + 1 (the head's
k drafts and the trunk's pass over k + 1 tokens). The best width is the one with the most tokens per second,
tau(k) / c(k + 1). Neither is known in advance, and neither is measured before the first token: both are
learned from the steps the generation runs anyway.

- the acceptance rates a_i are counted as the generation goes (drafts proposed and accepted at each position),
  and the counts are carried from one generation to the next with the same drafter. Old counts fade (every
  step multiplies them by `decay`), and each rate is shrunk towards the rate of the position before it (and
  `prior` at the first position). Together these keep a width from being shut out for good: at width w the
  positions past w - 1 are never proposed, so a low rate once seen there would, if it were kept, keep every
  wider width out for the rest of the process. Faded, such a position drifts back to the rate of the one
  before, which is still counted, and the wider widths get tried again;
- the cost of a step is timed in the decoding loop itself (`StepCosts`): the interval between reading one
  step's tokens and the next's, where the steps around it have the same width (the loop queues a step before
  it reads the one before, so an interval beside a change of width is partly its neighbour's). A width the
  loop has not run yet is priced from the ones it has: the least-squares line through their costs, or, with
  one, a line of slope `prior_slope` (relative to it) through it. So the planner starts at the width the
  prior favours and moves to a neighbour only when the line it has measured says that pays; each width is
  compiled when first used. A width, once chosen, is kept for `run` steps, so that its steps are timed away
  from a change of width. The costs are kept with the model and carried from one generation to the next:
  a later generation starts from what the earlier ones measured, and keeps refining it (the median of the
  last `keep` intervals of each width, robust to the slow steps a shared machine throws in).

Plain decoding (width 1) is the fallback when drafting does not pay: it stops the head, so once chosen it
stays chosen (the head's cache would miss the positions decoded without it). For the same reason it is never
run to be timed: its cost is the measured line's value at width 1.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WIDTHS = (1, 2, 3, 4, 5)


def expected_tokens_per_pass(rates) -> float:
    """1 + sum_i prod_{j<=i} a_j: tokens a step emits on average, given per-position acceptance rates a_j."""
    total, survive = 1.0, 1.0
    for a in rates:
        survive *= a
        total += survive
    return total


class StepCosts:
    """Seconds of one step at each width, learned from the decoding loop's own steps (kept with the model)."""

    def __init__(self, keep: int = 24, min_samples: int = 2, prior_slope: float = 0.5):
        self.keep = keep  # intervals kept per width: the median of the most recent
        self.min_samples = min_samples  # intervals before a width's own median replaces the line's price
        self.prior_slope = prior_slope  # with one width measured: each token more costs this share of width 1
        self.samples: dict[int, deque] = {}

    def observe(self, width: int, seconds: float) -> None:
        if seconds > 0:
            self.samples.setdefault(width, deque(maxlen=self.keep)).append(seconds)

    def measured(self) -> dict[int, float]:
        """Width -> the median of its recent intervals, for the widths timed often enough."""
        return {n: statistics.median(t) for n, t in self.samples.items() if len(t) >= self.min_samples}

    def prices(self, widths) -> dict[int, float]:
        """Every width's cost: its own median where measured, else the line through the measured (up to a
        common scale, before any is measured: only the widths' ratios decide the choice)."""
        known = self.measured()
        line = self._line(known)
        return {n: known[n] if n in known else line(n) for n in widths}

    def _line(self, known: dict[int, float]):
        drafting = {n: c for n, c in known.items() if n > 1} or known
        if len(drafting) >= 2:
            xs, ys = list(drafting), list(drafting.values())
            mx_, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx_) ** 2 for x in xs)
            # a step is never cheaper for verifying more; noise can tilt a line fitted to near widths
            slope = max(slope, 0.0)
            floor = min(ys) * 0.05  # and never free
            return lambda n: max(my + slope * (n - mx_), floor)
        if drafting:
            (m, c), = drafting.items()
            unit = c / (1 + self.prior_slope * (m - 1))  # the prior line's width 1 through the measured width
        else:
            unit = 1.0
        return lambda n: unit * (1 + self.prior_slope * (n - 1))


@dataclass
class DraftPlanner:
    """Chooses the width (n_draft) of the next step from per-width step costs and the acceptance so far.

    `costs`: fixed seconds per width (known in advance); or `learned`, a `StepCosts` the decoding loop feeds
    (`observe_cost`), whose widths are `WIDTHS`."""

    costs: dict[int, float] | None = None  # width -> seconds of one step at that width
    prior: float = 0.7  # acceptance assumed at the first position before any draft is seen
    weight: float = 4.0  # how many drafts the position before (or the prior) counts for
    decay: float = 0.95  # per step, what the counts keep: about the last 20 steps count
    plain_after: int = 16  # steps observed before the planner may give up drafting
    width: int = 0  # the width last chosen (0: none yet)
    steps: int = 0
    proposed: list[float] = field(default_factory=list)  # per position, drafts proposed (faded counts)
    accepted: list[float] = field(default_factory=list)  # per position, drafts accepted (faded counts)
    learned: StepCosts | None = None
    run: int = 4  # with learned costs: steps a chosen width is kept (the ones inside the run are timed)
    held: int = 0  # consecutive choices of `width`

    def __post_init__(self):
        if (self.costs is None) == (self.learned is None):
            raise ValueError("give fixed `costs` or a `learned` StepCosts, one of the two")
        self.widths = tuple(sorted(self.costs)) if self.costs is not None else WIDTHS
        depth = max(self.widths) - 1
        self.proposed = list(self.proposed) or [0.0] * depth
        self.accepted = list(self.accepted) or [0.0] * depth

    def rates(self) -> list[float]:
        """Estimated acceptance per draft position: counts shrunk towards the position before."""
        out, before = [], self.prior
        for proposed, accepted in zip(self.proposed, self.accepted):
            before = (accepted + self.weight * before) / (proposed + self.weight)
            out.append(before)
        return out

    def prices(self) -> dict[int, float]:
        return self.costs if self.costs is not None else self.learned.prices(self.widths)

    def tokens_per_second(self, width: int, rates: list[float] | None = None,
                          prices: dict[int, float] | None = None) -> float:
        rates = self.rates() if rates is None else rates
        prices = self.prices() if prices is None else prices
        return expected_tokens_per_pass(rates[: width - 1]) / prices[width]

    def choose(self) -> int:
        if self.width == 1:
            return 1
        if self.learned is not None and self.width and self.held < self.run:
            self.held += 1  # inside a run: its steps are the ones timed
            return self.width
        rates, prices = self.rates(), self.prices()  # once per step: the loop calls this between trunk passes
        # With fixed costs, no hysteresis: switching width between steps costs nothing (each width's step is
        # compiled once); with learned costs, a switch starts a run.
        width = max((n for n in self.widths if n > 1 or self.steps >= self.plain_after),
                    key=lambda n: self.tokens_per_second(n, rates, prices))
        self.held = self.held + 1 if width == self.width else 1
        self.width = width
        return width

    def observe(self, drafts: int, accepted: int) -> None:
        """One step: `drafts` proposed, the first `accepted` of them kept."""
        self.steps += 1
        self.proposed = [p * self.decay for p in self.proposed]
        self.accepted = [a * self.decay for a in self.accepted]
        for i in range(min(accepted + 1, drafts)):
            self.proposed[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1

    def observe_cost(self, width: int, seconds: float) -> None:
        """The loop timed one step at `width` (between two steps of the same width)."""
        if self.learned is not None:
            self.learned.observe(width, seconds)
