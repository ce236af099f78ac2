"""`generate_batch`: several prompts decoded together, each row exactly its own `generate` run.

A thin call of `qmtp.continuous.ContinuousBatch`: every prompt is checked first (one error naming the row,
before any work), then all are submitted and the batch stepped until every row is done. Each setting is one
value for all rows or a list or tuple with one value per row; `stop`, whose one value may itself be a list,
is per row when given as a list of lists (or None) with one entry per prompt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from .continuous import ContinuousBatch
from .errors import QmtpError, UsageError
from .model import Model, release_at_thread_exit
from .options import DEFAULT_ENGINE, Engine, Settings, _integer, checked_arguments
from .speculative import Generation, _chat_prompt

SETTINGS = ("max_tokens", "n_draft", "seed", "stop", "stop_at_eos", "sampling", "temperature", "top_k", "top_p",
            "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")  # `Settings.of`'s, in its order


class BatchResult(list):
    """One `Generation` per prompt, in order, with the batch's totals (`totals`: steps, rows per step, tokens,
    wall seconds, aggregate tokens per second) and each row's error (`errors`: None, or the exception that ended
    that row alone, its `finish_reason` then "error")."""

    def __init__(self, generations: list[Generation], errors: list, totals: dict):
        super().__init__(generations)
        self.errors = errors
        self.totals = totals


def _per_row(name: str, value, rows: int) -> list:
    """One value per row: `value` repeated, or the list given (its length checked)."""
    per_row = isinstance(value, (list, tuple))
    if name == "chat_template_kwargs":  # one value is a dict; per row, a list of dicts (or None)
        per_row = per_row and all(v is None or isinstance(v, Mapping) for v in value)
    if name == "stop":  # one stop list is a list of strings; per row, a list of lists (or None)
        per_row = per_row and bool(value) and all(v is None or isinstance(v, (list, tuple)) for v in value)
    if not per_row:
        return [value] * rows
    if len(value) != rows:
        raise UsageError(f"{name}: {len(value)} values for {rows} prompts: give one value, or one per prompt")
    return list(value)


def _is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


def _prompt_of(model: Model, prompt, enable_thinking, chat_template_kwargs) -> list[int]:
    """A row's token ids: text, ids, or a message list rendered by the chat template (`generate`'s checks: the
    template's arguments are for message lists only)."""
    if _is_messages(prompt):
        return _chat_prompt(model, None, list(prompt), enable_thinking, chat_template_kwargs)
    return _chat_prompt(model, prompt, None, enable_thinking, chat_template_kwargs)


@checked_arguments
def generate_batch(model: Model, prompts=None, max_tokens=64, n_draft=1, temperature=None, seed=0, *,
                   messages=None, enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None,
                   stop=None, stop_at_eos=True, sampling=None, top_k=None, top_p=None, min_p=None,
                   presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                   max_batch: int | None = None, engine: Engine = DEFAULT_ENGINE) -> BatchResult:
    """Decode every prompt (text, token ids, or a message list for the chat template) as one row of a batch.

    The arguments are `generate`'s, each one value or one per row (see the module's docs); `messages`, instead
    of `prompts`, is one conversation per row (`generate(messages=...)`'s), and `enable_thinking` and
    `chat_template_kwargs` apply to the rows given as message lists. A greedy row's tokens are its own
    `generate` run's, for every n_draft; a sampled row keeps its distribution, drawn with its own seed.
    `max_batch`: rows decoding at once (default: all). Returns a `BatchResult`."""
    if not isinstance(model, Model):
        raise UsageError(f"model: give a qmtp Model (qmtp.load(path)), not {type(model).__name__}")
    if max_batch is not None:  # not `max_batch or rows`: 0 or False would have meant every row at once
        max_batch = _integer("max_batch", max_batch)
        if max_batch < 1:
            raise UsageError(f"max_batch={max_batch} must be at least 1 (None: every row at once)")
    if messages is not None:
        if prompts is not None:
            raise UsageError("give prompts or messages (one conversation per row), not both")
        if not isinstance(messages, (list, tuple)) or not messages or not all(map(_is_messages, messages)):
            raise UsageError("messages: give a non-empty list of conversations, one per row, each a list of "
                             "{'role': ..., 'content': ...} messages")
        prompts = messages
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise UsageError("prompts: give a non-empty list of prompts (text, token ids or message lists)")
    rows = len(prompts)
    given = dict(max_tokens=max_tokens, n_draft=n_draft, seed=seed, stop=stop, stop_at_eos=stop_at_eos,
                 sampling=sampling, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                 repetition_penalty=repetition_penalty)
    columns = {name: _per_row(name, given[name], rows) for name in SETTINGS}
    template = {name: _per_row(name, value, rows) for name, value in
                (("enable_thinking", enable_thinking), ("chat_template_kwargs", chat_template_kwargs))}
    if (enable_thinking is not None or chat_template_kwargs is not None) and not any(map(_is_messages, prompts)):
        raise UsageError("enable_thinking and chat_template_kwargs shape a chat template's prompt: give message "
                         "lists (messages=[...] or prompts that are message lists) to use them")
    batch = ContinuousBatch(model, max_batch=rows if max_batch is None else max_batch, engine=engine)
    requests = []
    for row, prompt in enumerate(prompts):
        try:
            thinking, variables = template["enable_thinking"][row], template["chat_template_kwargs"][row]
            if not _is_messages(prompt):  # the template's arguments shape the message lists among the rows
                thinking = variables = None
            tokens = _prompt_of(model, prompt, thinking, variables)
            settings = Settings.of(**{name: columns[name][row] for name in SETTINGS})
            requests.append(batch.check(tokens, settings))
        except QmtpError as error:
            raise type(error)(f"row {row}: {error}") from None
    release_at_thread_exit()
    started = time.perf_counter()
    with model.lock:
        batch.enqueue(requests)
        while batch.step():
            pass
    seconds = time.perf_counter() - started
    generated = sum(len(r.tokens) for r in requests)
    totals = {**batch.counters, "rows": rows, "seconds": seconds, "tokens": generated,
              "tokens_per_second": generated / seconds if seconds else float("nan")}
    return BatchResult([r.generation() for r in requests], [r.error for r in requests], totals)
