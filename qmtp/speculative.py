"""Speculative decoding with the MTP head as the drafter.

One step, with the trunk's cache holding x_0..x_t and the trunk's choice x_{t+1} ("pending") not yet fed:

1. draft: the head turns (h_t, x_{t+1}) into a guess d_1 for x_{t+2}; fed its own post-norm output and
   d_1 it guesses d_2, and so on: `n_draft - 1` drafts.
2. verify: one trunk pass over [x_{t+1}, d_1, ..., d_k] gives the trunk's own choice after each of them.
3. accept: the longest prefix of drafts the trunk agrees with, plus the trunk's next token. Greedy: the
   argmaxes. Sampling (`qmtp.Engine(acceptance="coupled")`, the default): the trunk's token and the draft at a position
   are argmaxes of their log-probabilities plus the same Gumbel noise, made from the seed and the position,
   so the tokens do not depend on the widths. `Engine(acceptance="rejection")`: each draft kept with probability
   min(1, p/q) and a resample from max(0, p - q) at the first rejection (Leviathan et al. 2023). Every way,
   the output has exactly the trunk's distribution.
4. roll back: every cache is cut back to the accepted tokens, as if only they had been decoded.

`n_draft` follows lemon-mlx-engine's convention: it counts the trunk's own token, so `n_draft=1` is plain
decoding and `n_draft=2` verifies one head draft per step (vLLM's num_speculative_tokens = n_draft - 1).
`n_draft="auto"` lets `qmtp.adaptive.DraftPlanner` choose it step by step.
"""

from __future__ import annotations

import functools
import operator
import os
import time
from collections.abc import Mapping, Set
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .errors import NonFiniteLogitsError, UsageError
from . import chat
from .model import Model, release_at_thread_exit
from .options import DEFAULT_ENGINE, Engine, Settings, checked_arguments
from .prefix_cache import PrefixCache
from .sampling import Sampling


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


def _prompt_tokens(model: Model, prompt) -> list[int]:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise UsageError("this model has no tokenizer: pass the prompt as a list of token ids")
        if not prompt:
            raise UsageError("the prompt is empty: give at least one token of text")
        chat.refuse_surrogates(prompt, "prompt")
        return model.tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)):  # iterating bytes gives ints: they would pass as token ids
        raise UsageError("prompt: give text (str) or a list of token ids, not bytes (decode them first)")
    if isinstance(prompt, (Mapping, Set)):  # iterating gives keys, in no order a prompt has
        raise UsageError(f"prompt: give text or a sequence of integer token ids, not a {type(prompt).__name__}")
    try:
        tokens = list(prompt)
        if any(isinstance(t, (bool, np.bool_)) for t in tokens):  # True is 1 to operator.index
            raise UsageError(f"prompt: give integer token ids, not booleans ({prompt!r:.60})")
        return [operator.index(t) for t in tokens]
    except (TypeError, ValueError):
        raise UsageError(f"prompt: give text or a sequence of integer token ids, not {prompt!r:.60}") from None


def _chat_prompt(model: Model, prompt, messages, enable_thinking, chat_template_kwargs) -> list[int]:
    """The prompt's token ids: `prompt` as given, or `messages` rendered by the model's chat template."""
    if messages is None:
        if enable_thinking is not None or chat_template_kwargs is not None:
            raise UsageError("enable_thinking and chat_template_kwargs shape a chat template's prompt: give messages "
                             "(not a prompt) to use them")
        if prompt is None:
            raise UsageError("give a prompt (text or token ids) or messages=[{'role': 'user', 'content': ...}]")
        return _prompt_tokens(model, prompt)
    if prompt is not None:
        raise UsageError("give a prompt or messages, not both")
    if model.tokenizer is None:
        raise UsageError("this model has no tokenizer, so no chat template: pass the prompt as a list of token ids")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise UsageError(f"chat_template_kwargs: give a dict of the template's variables, not "
                         f"{type(chat_template_kwargs).__name__}")
    enable_thinking, variables = chat.generation_variables(enable_thinking, chat_template_kwargs)
    return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                                               tokenize=True, **variables)


def _one_call_at_a_time(generate):
    """`generate` on a `Model` only, one call per model at a time (its lock; a callback from `on_tokens` may call
    again, on the same thread); a thread that calls it frees its MLX state when it ends (`release_at_thread_exit`)."""

    @functools.wraps(generate)
    def serialised(model, *args, **kwargs):
        if not isinstance(model, Model):
            hint = " (load it first: qmtp.load(path))" if isinstance(model, (str, bytes, os.PathLike)) else ""
            raise UsageError(f"model: give a qmtp Model{hint}, not {type(model).__name__} {model!r:.60}")
        release_at_thread_exit()
        with model.lock:
            return generate(model, *args, **kwargs)

    return checked_arguments(serialised)  # a misspelt keyword is a UsageError before the lock is taken


@_one_call_at_a_time
def generate(model: Model, prompt=None, max_tokens: int = 64, n_draft: int | str = 1, temperature: float | None = None,
             seed: int = 0, *, messages=None, enable_thinking: bool | None = None,
             chat_template_kwargs: dict | None = None, stop=None, stop_at_eos: bool = True,
             sampling: Sampling | str | None = None, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, presence_penalty: float | None = None,
             frequency_penalty: float | None = None, repetition_penalty: float | None = None,
             prefix_cache: PrefixCache | None = None, on_tokens=None, engine: Engine = DEFAULT_ENGINE) -> Generation:
    """Generate up to `max_tokens` tokens after `prompt` (text, or a list of token ids), or after `messages`
    rendered by the model's chat template.

    It stops at any id that ends a reply (`qmtp.chat.end_ids`: the tokenizer's and generation_config.json's
    eos_token_id, one or a list), at a `stop` string, or after `max_tokens`; `finish_reason` says which.

    Args:
        n_draft: tokens per trunk pass counting the trunk's own (1 = plain decoding, 2 = one head draft),
            lemon-mlx-engine's convention; vLLM's num_speculative_tokens is n_draft - 1. "auto": chosen per
            step from 1..5 (`qmtp.adaptive`).
        temperature: 0 (the default) for greedy; otherwise the tokens have exactly the trunk's distribution,
            processed as below (`qmtp.Engine`'s acceptance: coupled by default, so a seed
            gives the same tokens at every n_draft, "auto" included).
        seed: the sampler's seed.
        messages: a conversation ([{"role": "user", "content": ...}, ...]) instead of `prompt`: the prompt is
            `model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.
        enable_thinking: for `messages`: None leaves it to the template (Qwen: thinking on), False asks the
            template for no thinking. `chat_template_kwargs`: `apply_chat_template`'s other arguments (`tools`,
            Qwen3.6's `preserve_thinking=True`, ...). `qmtp.chat.split_thinking` cuts the reply into thinking
            and answer.
        stop: a string or list of strings: generation ends once the text holds one; `text` ends before it.
        stop_at_eos: False ignores the end ids (and generates `max_tokens` tokens unless a stop string ends it).
        sampling: the sampler in one argument: None (greedy, no penalty), "model" (the checkpoint's
            generation_config.json: temperature, top_k, top_p, ... as its card recommends), or a
            `qmtp.Sampling`; the keyword arguments below, where given, replace its fields.
        top_k, top_p, min_p: filters after the temperature: the k most likely tokens (0: all), the smallest
            set of most likely tokens whose probability reaches p (1: all), the tokens at least min_p times as
            likely as the most likely (0: all). Greedy decoding is unchanged by them.
        presence_penalty, frequency_penalty: subtracted from the logit of a token once if it was GENERATED
            before (presence) and once per time it was (frequency), as vLLM and the OpenAI API count them:
            the prompt's tokens are not counted.
        repetition_penalty: as transformers applies it, to every token of the prompt AND the generated text:
            its logit divided by the penalty when positive, multiplied when negative (1: none).
            The penalties apply before the temperature, also when greedy (the argmax of the penalised
            logits), each position seeing the tokens before it, drafts included (`qmtp.sampling`).
        prefix_cache: a `qmtp.PrefixCache`: the generation starts from the state the last one with this cache
            left, prefilling only the prompt's tokens after the longest prefix it shares with the ids that
            state holds (`Stats.prefilled_tokens`), and leaves its own state there (`qmtp.Conversation` uses
            it). The tokens are those of a generation without it.
        on_tokens: called with each step's new output tokens as soon as the host has them (streaming; a
            step's tokens past `max_tokens`, an end id or the token completing a stop string are not passed).
        engine: how the loop runs (`qmtp.Engine`: the book's ablations); every choice gives the same tokens.
    """
    called = time.perf_counter()
    prompt_tokens = _chat_prompt(model, prompt, messages, enable_thinking, chat_template_kwargs)
    settings = Settings.of(max_tokens, n_draft, seed, stop, stop_at_eos, sampling, temperature, top_k, top_p, min_p,
                           presence_penalty, frequency_penalty, repetition_penalty)
    return decode(model, prompt_tokens, settings, engine, prefix_cache, on_tokens, called)


@_one_call_at_a_time
def decode(model: Model, prompt_tokens: list[int], settings: Settings, engine: Engine = DEFAULT_ENGINE,
           prefix_cache: PrefixCache | None = None, on_tokens=None, called: float | None = None) -> Generation:
    """`generate` after the prompt's ids are known, its settings in one value (`qmtp.Settings`): what every
    decoding entry point calls. `called`: when the call started (the statistics' clock), default now."""
    called = time.perf_counter() if called is None else called
    if not isinstance(settings, Settings):
        raise UsageError(f"settings: give a qmtp.Settings (Settings.of(...)), not {type(settings).__name__}")
    if not isinstance(engine, Engine):
        raise UsageError(f"engine: give a qmtp.Engine (Engine(compiled=False, ...)), not {type(engine).__name__}")
    if on_tokens is not None and not callable(on_tokens):  # else found only after the prefill
        raise UsageError(f"on_tokens={on_tokens!r:.40} must be a function of a list of token ids (or None)")
    if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
        raise UsageError(f"prefix_cache: give a qmtp.PrefixCache (or None), not {type(prefix_cache).__name__}")
    from .continuous import ContinuousBatch  # the engine: a generation is a batch of one

    batch = ContinuousBatch(model, max_batch=1, engine=engine, cache_entries=0)
    request = batch.check(prompt_tokens, settings, on_tokens, prefix_cache=prefix_cache)
    request.submitted = called
    batch.enqueue([request])
    try:
        while batch.step():
            pass
    except BaseException:  # a state cut short (an error, Ctrl-C) is not kept: the next call prefills anew
        if prefix_cache is not None:
            prefix_cache.clear()
        raise
    if request.error is not None:
        raise request.error
    return request.generation()


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
