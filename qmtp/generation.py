"""What a generation returns and counts (`Generation`, `Stats`, `Step`), the checks of a prompt against the model, and
the loop's instruments (`PhaseTimer`, `ExpertRecorder`): shared by `qmtp.speculative` (the API) and
`qmtp.continuous` (the engine)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .errors import NonFiniteLogitsError, UsageError
from .model import Model
from .options import Settings


@dataclass
class Step:
    """What one trunk pass did: the drafts it checked and how many it kept."""

    drafts: list[int]
    accepted: int
    emitted: list[int]  # tokens this step added to the output (accepted drafts + the trunk's own)
    nonfinite_drafts: int = 0  # proposed drafts chosen from NaN or Inf head logits (verified like any other)


@dataclass
class Stats:
    n_draft: int | str  # "auto": chosen per step (see `tokens_per_pass`)
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # the prompt's tokens run at the prefill: all but those a `PrefixCache` held
    generated: int = 0
    drafted: list[int] = field(default_factory=list)  # per draft position: how often a draft was proposed
    accepted: list[int] = field(default_factory=list)  # per draft position: how often it was accepted
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0  # from the call to the first new token: checks, prefill, its sampling
    decode_seconds: float = 0.0  # from the first token to the last (the passes overlap: not split by phase)
    experts_per_pass: list[list[int]] = field(default_factory=list)  # per verify pass, per layer: distinct experts
    steps: list[Step] = field(default_factory=list)

    @property
    def trunk_passes(self) -> int:
        """Decode or verify passes (a replay after a partial accept is not counted, being rollback work)."""
        return len(self.steps)

    @property
    def nonfinite_drafts(self) -> int:
        """Proposed drafts the head chose from NaN or Inf logits (a damaged head). Verification keeps the
        output exact, but such a head drafts no better than chance, so `chat` reports them."""
        return sum(s.nonfinite_drafts for s in self.steps)

    @property
    def tokens_per_pass(self) -> list[int]:
        """Tokens each pass ran through the trunk, the pending token and the drafts (each step's n_draft; with
        "auto", the width chosen)."""
        return [1 + len(s.drafts) for s in self.steps]

    @property
    def acceptance(self) -> list[float]:
        """Per draft position, accepted over proposed (position i is proposed only if 1..i-1 were accepted)."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted, self.drafted)]

    @property
    def acceptance_rate(self) -> float:
        """All accepted drafts over all proposed drafts."""
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else float("nan")

    @property
    def tokens_per_trunk_pass(self) -> float:
        """Mean tokens emitted per verify pass (1 for plain decoding)."""
        emitted = sum(len(s.emitted) for s in self.steps)
        return emitted / len(self.steps) if self.steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens after the first over the time from the first to the last (prefill excluded)."""
        return (self.generated - 1) / self.decode_seconds if self.decode_seconds else float("nan")

    def summary(self) -> dict:
        return {
            "n_draft": self.n_draft,
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated": self.generated,
            "trunk_passes": self.trunk_passes,
            "acceptance": self.acceptance,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_trunk_pass": self.tokens_per_trunk_pass,
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
            "first_token_seconds": self.first_token_seconds,
            "decode_seconds": self.decode_seconds,
            "nonfinite_drafts": self.nonfinite_drafts,
        }


@dataclass
class Generation:
    """What `generate` returns: the new text and tokens (the prompt's tokens apart) and the run's statistics."""

    text: str  # end ids left out, cut before a stop string
    tokens: list[int]  # generated tokens only (with the end id, or the tokens that completed a stop string)
    prompt_tokens: list[int]
    stats: Stats
    finish_reason: str = "length"  # "end" (an end id), "stop" (a stop string) or "length" (max_tokens)


def _validate(model: Model, prompt_tokens: list[int], settings: Settings) -> None:
    """What depends on the prompt: its ids within the vocabulary, and it with the new tokens within the context."""
    if not prompt_tokens:
        raise UsageError("the prompt is empty: give at least one token of text")
    max_tokens, n_draft = settings.max_tokens, settings.widest
    vocab = model.config.vocab_size
    outside = next((t for t in prompt_tokens if not 0 <= t < vocab), None)
    if outside is not None:  # MLX does not bounds-check an embedding lookup: garbage, or a crash
        where = f" of {model.path}" if model.path else ""
        raise UsageError(
            f"prompt token id {outside} is outside the vocabulary{where} (0..{vocab - 1}, config.json vocab_size); "
            f"were the ids made by another model's tokenizer?"
        )
    # The sequence (prompt and new tokens) must fit the context, and so must the drafts verified past its
    # last token (the cache holds one position less: the last new token is never fed back).
    limit = model.config.max_position_embeddings
    if len(prompt_tokens) > limit:
        raise UsageError(f"prompt of {len(prompt_tokens)} tokens is longer than the context of {limit} positions")
    needed = len(prompt_tokens) + max_tokens + n_draft - 1
    if needed > limit and len(prompt_tokens) + n_draft > limit:  # not even one new token fits
        drafts = f" and {n_draft - 1} drafted ahead" if n_draft > 1 else ""
        raise UsageError(
            f"prompt of {len(prompt_tokens)} tokens is too long: the context of {limit} positions holds the prompt"
            f"{drafts} and at least one new token; shorten the prompt to at most {limit - n_draft} tokens"
            + (" (or draft fewer)" if n_draft > 1 else "")
        )
    if needed > limit:
        drafts = f" + {n_draft - 1} drafted ahead" if n_draft > 1 else ""
        raise UsageError(
            f"prompt of {len(prompt_tokens)} tokens + {max_tokens} new ones{drafts} is {needed} positions, more "
            f"than the context of {limit}: ask for at most {max_tokens - (needed - limit)} new tokens"
        )




class ExpertRecorder:
    """Keeps the experts every trunk layer chose for one row in each verify pass, on the device, and counts the
    distinct ones per pass and layer once the generation is over (so tracking adds no host sync to the passes)."""

    def __init__(self):
        self.passes: list[tuple[list, int]] = []

    def record(self, experts: list, row: int = 0) -> None:
        """A pass's experts per layer ([B, tokens, top_k] each, None for a layer without experts) and this row's b."""
        self.passes.append((experts, row))

    def distinct(self) -> list[list[int]]:
        return [[int(np.unique(np.array(e[row])).size) if e is not None else 0 for e in layers]
                for layers, row in self.passes]


class PhaseTimer:
    """Wall time of the decoding loop's phases, for profiling: building and queueing a pass ("build"),
    waiting for its tokens ("sync"), replaying kept tokens ("replay"). Pass one to `generate(timer=...)`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


@contextmanager
def _untimed(phase: str):
    yield


def _end_set(eos) -> frozenset[int]:
    """The end ids as a set: None (none), one id, or a collection of ids."""
    if eos is None:
        return frozenset()
    return frozenset(eos) if isinstance(eos, (set, frozenset, list, tuple)) else frozenset((int(eos),))


def _nonfinite(model: Model, position: int, token: int, what: str = "", drafts=()) -> NonFiniteLogitsError:
    """The error for NaN or Inf trunk logits after `token` at `position` (counted from the prompt's first token).

    A pass that verifies drafts names them too: attention masks a later position with a zero weight, and zero
    times NaN is NaN, so a draft whose own values are NaN (its embedding row, say) spoils the positions before
    it in the same pass. Drafting may so stop a few tokens before plain decoding would, never later."""
    where = f" {model.path}" if model.path else ""
    text = ""
    if model.tokenizer is not None:
        try:
            text = f" {model.tokenizer.decode([token])!r:.40}"
        except Exception:  # a token id the tokenizer cannot decode: the id alone says enough
            text = ""
    verifying = f", in a pass verifying the drafts {', '.join(map(str, drafts))}" if drafts else ""
    return NonFiniteLogitsError(
        f"model{where} computes NaN or Inf logits {what}at position {position} (after token {token}{text}"
        f"{verifying}): its weights are damaged (find the tensor with `python -m qmtp doctor MODEL --scan`)")
