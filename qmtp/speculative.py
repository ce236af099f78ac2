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
import numpy as np

from .errors import UsageError
from . import chat
from .model import Model, release_at_thread_exit
from .options import DEFAULT_ENGINE, Engine, Settings, checked_arguments
from .generation import (ExpertRecorder, Generation, PhaseTimer, Stats, Step,  # noqa: F401 (the API's names)
                         _end_set, _nonfinite, _untimed, _validate)
from .prefix_cache import PrefixCache
from .sampling import Sampling


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
