"""What a decoding call is asked for, apart from how the engine works it out.

`Settings` is what a user sets: how many tokens, at which width, with which sampler, stopping where, from
which seed. `generate`, `Conversation` (and every later entry point: a batch, a server) take the same value
and check it the same way, so none of them copies a list of parameters.

`Engine` holds the switches the book's ablations flip: which head drafts, from which trunk state, how the
head's cache and its chained drafts run, how the trunk rolls back, a compiled or eager step, queueing the
next pass ahead, profiling. Users keep the defaults. Greedy tokens are the same under every choice, and
sampled tokens keep the trunk's distribution; only the speed and the drafts change.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

import numpy as np

from .adaptive import WIDTHS
from .acceptance import ACCEPTANCES
from .decoding import CHAINS, HEAD_CACHES
from .errors import UsageError
from .mtp import MTPHead
from .sampling import Sampling
from .sampling import resolve as resolve_sampling

MAX_N_DRAFT = 8
DRAFTING_N_DRAFT = "auto"  # `chat --use-mtp` and `serve` with a head: the width chosen per step from its costs
SEEDS = 2**64  # a seed is a non-negative integer below this
HIDDEN = ("post", "pre")  # the trunk state the head reads: after the trunk's final norm, or before it
ROLLBACKS = ("record", "replay")


class ArgumentError(UsageError, TypeError):
    """Arguments that do not fit the function's signature (a keyword it does not take, one positional argument
    too many, one given twice): a UsageError as every other refusal of a value is, and still the TypeError
    that Python raises for it, so code that catches either keeps working."""


def checked_arguments(function):
    """`function`, refusing arguments its signature does not take with an ArgumentError that names them (and
    the argument a misspelt keyword is closest to) before any of its own code runs."""
    signature = inspect.signature(function)
    label = function.__qualname__.removesuffix(".__init__")
    keywords = [name for name, p in signature.parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in ("self", "cls")]

    @functools.wraps(function)
    def checked(*args, **kwargs):
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            unknown = next((k for k in kwargs if k not in keywords), None)
            if unknown is None:
                raise ArgumentError(f"{label}: {err}") from None
            close = difflib.get_close_matches(str(unknown), keywords, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (it takes {', '.join(keywords)})"
            raise ArgumentError(f"{label} has no argument {unknown!r:.40}{hint}") from None
        return function(*args, **kwargs)

    return checked


def _integer(name: str, value, auto: bool = False) -> int | str:
    """An int (numpy integers included) or, where allowed, "auto"; a UsageError for anything else (MLX and
    range checks would raise a bare TypeError on them)."""
    if auto and isinstance(value, str) and value == "auto":  # an array's == is an array, no truth value
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageError(f"{name}={value!r:.40} must be an integer" + (" or 'auto'" if auto else ""))
    return int(value)


def check_n_draft(n_draft) -> int | str:
    """n_draft as every entry point takes it (`generate`, the batch, `chat --n-draft`, the server's field): a
    whole number of tokens per trunk pass from 1 (plain decoding) to MAX_N_DRAFT, or "auto"."""
    n_draft = _integer("n_draft", n_draft, auto=True)
    if n_draft != "auto" and not 1 <= n_draft <= MAX_N_DRAFT:
        raise UsageError(f"n_draft={n_draft} is out of range: use 1 (plain decoding) to {MAX_N_DRAFT}, or 'auto'")
    return n_draft


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if isinstance(stops, (bytes, Mapping, Set)) or not isinstance(stops, (list, tuple)):
        raise UsageError(f"stop={stop!r:.40}: give a string or a list of strings")
    if not all(isinstance(s, str) and s for s in stops):
        raise UsageError(f"stop={stop!r:.60}: every stop string must be non-empty text")
    return tuple(stops)


@dataclass(frozen=True)
class Settings:
    """What a user asks of one generation. Build it with `Settings.of(...)`, which checks every value.

    - max_tokens: new tokens at most.
    - n_draft: tokens per trunk pass counting the trunk's own (1 = plain decoding, 2 = one head draft; vLLM's
      num_speculative_tokens is n_draft - 1), or "auto".
    - sampling: None (greedy), "model" (the checkpoint's generation_config.json) or a `qmtp.Sampling`, with
      `overrides` (the sampler's fields given one by one) replacing its fields.
    - seed: the sampler's seed; stop: strings that end the text; stop_at_eos: False ignores the end ids."""

    max_tokens: int = 64
    n_draft: int | str = 1
    sampling: Sampling | str | None = None
    overrides: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True

    @classmethod
    @checked_arguments
    def of(cls, max_tokens: int = 64, n_draft: int | str = 1, seed: int = 0, stop=None, stop_at_eos: bool = True,
           sampling: Sampling | str | None = None, temperature: float | None = None, top_k: int | None = None,
           top_p: float | None = None, min_p: float | None = None, presence_penalty: float | None = None,
           frequency_penalty: float | None = None, repetition_penalty: float | None = None) -> Settings:
        """The settings, each checked now (the model-dependent ones, in `sampler` and `check_for`)."""
        max_tokens = _integer("max_tokens", max_tokens)
        n_draft = check_n_draft(n_draft)
        if isinstance(temperature, bool) or not isinstance(temperature, (type(None), int, float, np.integer,
                                                                         np.floating)):
            raise UsageError(f"temperature={temperature!r:.40} must be a number")
        if temperature is not None and not (temperature >= 0 and math.isfinite(temperature)):  # NaN fails >=
            raise UsageError(f"temperature={temperature} must be a finite number >= 0")
        if max_tokens < 1:
            raise UsageError(f"max_tokens={max_tokens} must be at least 1")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEEDS:
            raise UsageError(f"seed={seed!r:.40} must be a non-negative integer below 2**64")
        if not isinstance(stop_at_eos, (bool, np.bool_)):
            raise UsageError(f"stop_at_eos={stop_at_eos!r:.40} must be True or False")
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty)
        overrides = tuple((name, value) for name, value in given.items() if value is not None)
        if sampling is not None and not isinstance(sampling, (Sampling, str)):
            raise UsageError(f"sampling: give None, 'model' or a qmtp.Sampling, not {type(sampling).__name__}")
        if sampling != "model":  # the model's own sampler is read by `sampler`, when the model is known
            resolve_sampling(None, sampling, **dict(overrides))
        return cls(max_tokens, n_draft, sampling, overrides, int(seed), _stop_strings(stop), bool(stop_at_eos))

    @property
    def widest(self) -> int:
        """The widest pass these settings may verify ("auto" chooses among 1..5)."""
        return max(WIDTHS) if self.n_draft == "auto" else self.n_draft

    def sampler(self, model) -> Sampling:
        """The sampler for `model`: `sampling` (its generation_config.json for "model") with the overrides."""
        return resolve_sampling(model, self.sampling, **dict(self.overrides))

    def check_for(self, model) -> Sampling:
        """What only the model can tell (a head to draft with, a tokenizer for stop strings, its own sampler):
        a UsageError now rather than after the prefill; the sampler."""
        if self.n_draft != 1:
            model.require_head()
        if self.stop and model.tokenizer is None:
            raise UsageError("stop strings are matched in the decoded text, and this model has no tokenizer")
        return self.sampler(model)

    def check_room(self, model) -> None:
        """For settings used with prompts not yet known (a conversation's turns): a reply of `max_tokens` and its
        drafts must leave room for a prompt of one token in the context."""
        widest, limit = self.widest, model.config.max_position_embeddings
        if self.max_tokens + widest > limit:
            drafts = f" and {widest - 1} drafted ahead" if widest > 1 else ""
            raise UsageError(f"max_tokens={self.max_tokens}: a reply of {self.max_tokens} tokens{drafts} leaves no "
                             f"room for a prompt in the context of {limit} positions: ask for at most "
                             f"{limit - widest}")


@dataclass(frozen=True)
class Engine:
    """How the decoding loop runs: the switches the book's ablations flip. Users keep the defaults.

    - head: a replacement drafter (e.g. `mtp.without_routed_experts(model.mtp)`); None: the model's own head.
    - hidden: "post" feeds the head the trunk state after its final norm (as vLLM and SGLang do), "pre" before it.
    - head_cache: "keep" keeps the head's KV cache across steps (vLLM, SGLang); "reset" empties it at every step
      (lemon-mlx-engine), so the head attends only to the position it drafts from.
    - chain: "post" feeds a chained draft (n_draft >= 3) the head's own output after its final norm; "pre" before.
    - rollback: "record" keeps each position's linear-attention state during verification; "replay" runs the
      accepted tokens again from the state before the pass.
    - acceptance: how a sampled draft is kept. "coupled": each position's token is chosen with noise made from
      the seed and the position alone, shared by the draft, so a seed gives the same tokens at every n_draft,
      "auto" included (`acceptance.Coupled`); "rejection": Leviathan et al.'s rejection sampling, random per step
      (`acceptance.Rejection`), which keeps about 1% more first drafts. Both keep the trunk's law exactly.
    - track_experts: count the distinct experts each verify pass reads (`Stats.experts_per_pass`): what the
      book's union-of-experts measurements read, off for everyone else (it keeps every pass's choices).
    - compiled, queue_ahead: False runs each step eagerly (graph built op by op, not replayed from a trace), or
      reads each step's tokens before queueing the next: what the two buy (`bench.mtp`'s ablation).
    - timer: a `qmtp.speculative.PhaseTimer` to add the loop's phases to (profiling)."""

    head: object = None  # an MTPHead
    hidden: str = "post"
    head_cache: str = "keep"
    chain: str = "post"
    rollback: str = "record"
    acceptance: str = "coupled"
    track_experts: bool = False
    compiled: bool = True
    queue_ahead: bool = True
    timer: object = field(default=None, compare=False)

    def __post_init__(self):
        if self.head is not None and not isinstance(self.head, MTPHead):
            raise UsageError(f"head: give an MTP head (e.g. qmtp.mtp.without_routed_experts(model.mtp)), not "
                             f"{type(self.head).__name__}")
        for name, allowed in (("hidden", HIDDEN), ("head_cache", HEAD_CACHES), ("chain", CHAINS),
                              ("rollback", ROLLBACKS), ("acceptance", ACCEPTANCES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:  # `in` would compare an array elementwise
                raise UsageError(f"{name}={value!r:.40}: use {' or '.join(map(repr, allowed))}")
        for name in ("track_experts", "compiled", "queue_ahead"):  # "no" would be truthy: on
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise UsageError(f"{name}={value!r:.40} must be True or False")
            object.__setattr__(self, name, bool(value))  # a numpy bool as Python's: engines compare equal
        if self.timer is not None and not callable(self.timer):
            raise UsageError("timer: give a qmtp.speculative.PhaseTimer (or None)")

    def drafter(self, model):
        """The head that drafts: this engine's, or the model's own."""
        return self.head if self.head is not None else model.mtp


# A dataclass's own __init__ raises a bare TypeError for a misspelt field: refuse it as the calls taking them do.
# (Sampling is sampling.py's, which cannot import this module: this one imports it.)
Engine.__init__ = checked_arguments(Engine.__init__)
Sampling.__init__ = checked_arguments(Sampling.__init__)

DEFAULT_ENGINE = Engine()
