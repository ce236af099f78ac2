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
  loop has not run yet is priced from the ones it has (`StepCosts.prices`): optimistically above them, so
  that a wider width that may pay gets run and timed, and by the line through them below. So the planner
  starts at the width the prior favours and moves to a neighbour when what it has measured says that pays;
  each width is compiled when first used. A width, once chosen, is kept for `run` steps, so that its steps
  are timed away from a change of width, and a width close to the best that has not run for `revisit` steps
  runs again (the machine's pace drifts, and a stale price can keep the planner off the best). The costs
  are kept with the model and carried from one generation to the next: a later generation starts from what
  the earlier ones measured, and keeps refining it (the median of the last `keep` intervals of each width,
  robust to the slow steps a shared machine throws in).

Width 1 is a plain step. Chosen while the planner still learns, the head keeps reading each position
(`decoding.follow`: its layer, no draft), so that the step is timed and drafting can resume. After
`plain_after` steps, if plain decoding's timed speed beats every drafting width's by `give_up_margin`,
the planner gives up drafting for good: the head stops, and plain decoding stays (the head's cache would
miss the positions decoded without it).
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
        self.timed = 0  # intervals observed, all widths

    def observe(self, width: int, seconds: float) -> None:
        if seconds > 0:
            self.samples.setdefault(width, deque(maxlen=self.keep)).append(seconds)
            self.timed += 1

    def measured(self) -> dict[int, float]:
        """Width -> the median of its recent intervals, for the widths timed often enough."""
        return {n: statistics.median(t) for n, t in self.samples.items() if len(t) >= self.min_samples}

    def prices(self, widths) -> dict[int, float]:
        """Every width's cost: its own median where measured; else priced from the measured drafting widths.

        - a width wider than one measured: the nearest narrower measured width's cost plus, per width, the
          slope of the line through the measured widths, at most the prior's. Optimistic: a wider width that
          may pay gets run, and so measured (widths timed at different moments can steepen a line by noise);
        - a width narrower than all measured, width 1 included: the line down to it, but no less than half
          the prior line's ratio below the narrowest measured width (it is run, and so measured, if that
          price makes it the best).

        Before any width is measured, the prior line (up to a scale: only the widths' ratios decide)."""
        known = self.measured()
        drafting = {n: c for n, c in known.items() if n > 1}
        s = self.prior_slope
        if not drafting:
            return {n: known.get(n, 1 + s * (n - 1)) for n in widths}
        narrowest = min(drafting)
        unit = drafting[narrowest] / (1 + s * (narrowest - 1))  # the prior line's width 1 through it
        slope = s * unit
        if len(drafting) >= 2:
            xs, ys = list(drafting), list(drafting.values())
            mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
            fitted = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
            slope = max(fitted, 0.0)  # a step is never cheaper for verifying more
        prices = {}
        for n in widths:
            below = [m for m in drafting if m < n]
            if n in known:
                prices[n] = known[n]
            elif below:
                m = max(below)
                prices[n] = drafting[m] + min(slope, s * unit) * (n - m)
            else:  # half the prior line's: a line tilted by noise does not make a width look free
                prices[n] = max(drafting[narrowest] - slope * (narrowest - n), 0.5 * unit * (1 + s * (n - 1)))
        return prices


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
    plain: bool = False  # drafting given up for good: the head is stopped
    give_up_margin: float = 1.15  # with learned costs: how much faster plain decoding must be to give up for good
    revisit: int = 48  # with learned costs: steps after which a width run before, close to the best, runs again
    revisit_margin: float = 1.1  # close: the best's expected speed within this factor of its own
    last_run: dict[int, int] = field(default_factory=dict)  # width -> the step it was last chosen at

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
        """The next step's width. Width 1 chosen after `plain_after` steps gives up drafting for good (`plain`);
        with learned costs, width 1 chosen before is a plain step whose head keeps following (the loop runs
        `decoding.follow`), so that its cost is timed and drafting can resume."""
        if self.plain:
            return 1
        if self.learned is not None and self.width and self.held < self.run:
            self.held += 1  # inside a run: its steps are the ones timed
            return self.width
        rates, prices = self.rates(), self.prices()  # once per step: the loop calls this between trunk passes
        # With fixed costs, no hysteresis: switching width between steps costs nothing (each width's step is
        # compiled once); with learned costs, a switch starts a run.
        allowed = (n for n in self.widths
                   if n > 1 or self.steps >= self.plain_after or self.learned is not None)
        speed = {n: self.tokens_per_second(n, rates, prices) for n in allowed}
        width = max(speed, key=speed.get)
        if width == 1 and self.steps >= self.plain_after:
            # For good only on evidence: plain decoding's cost timed (not guessed), and a clear lead (noise
            # between near speeds must not end drafting for the rest of the generation).
            drafting = max(v for n, v in speed.items() if n > 1)
            self.plain = self.learned is None or (1 in self.learned.measured()
                                                  and speed[1] > self.give_up_margin * drafting)
        if self.learned is not None and not self.plain:
            # A width close to the best that has not run for a while runs again: its cost was timed at the
            # machine's pace of then (or guessed), and a stale price can keep the planner off the best
            for n in sorted(speed, key=speed.get, reverse=True):
                if (n != width and n in self.last_run and speed[n] * self.revisit_margin >= speed[width]
                        and self.steps - self.last_run[n] >= self.revisit):
                    width = n
                    break
        self.held = self.held + 1 if width == self.width else 1
        self.width = width
        self.last_run[width] = self.steps
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
