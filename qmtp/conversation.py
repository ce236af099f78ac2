"""A conversation that keeps its decoding state between turns, so a turn prefills only what it adds.

Each turn renders the whole history with the model's chat template, as a chat without a cache would, and
generates over those ids with a `PrefixCache`: the state the last turn left is kept up to the longest
prefix the new ids share with the ids it holds, and only the rest is prefilled. The template may render the
history differently from what was decoded (Qwen's drops a reply's thinking once a later question follows),
so the cache is told where each turn's generation prompt starts, the position from which the history of the
next turn usually differs, and snapshots the linear-attention state there.

A turn's tokens are those of `generate` over the same ids: turn n (counting from 0, and from the last
`reset`) is seeded with `seed + n`, so a sampled turn equals `generate(model, g.prompt_tokens, seed=seed + n,
...)` with the conversation's settings, and the turns draw different random numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import replace

from . import chat
from .errors import UsageError
from .model import Model
from .options import SEEDS, Settings, checked_arguments
from .prefix_cache import PrefixCache, common_prefix
from .sampling import Sampling
from .speculative import Generation, _prompt_tokens, decode


class Conversation:
    """A chat with `model` that keeps its decoding state between turns::

        conv = qmtp.Conversation(model, "Be brief.", enable_thinking=False, n_draft=3, max_tokens=256)
        g = conv.send("Why is the sky blue?")       # a Generation, as generate returns
        g = conv.send("And at sunset?")             # prefills only what the history adds
        g.stats.prompt_tokens, g.stats.prefilled_tokens

    `system`: a system message opening the conversation; `enable_thinking`, `chat_template_kwargs`: as for
    `generate(messages=...)`. The other arguments are `generate`'s decoding settings, the same for every turn.
    A reply enters the history as the chat CLI records it: its answer as `content`, its thinking (if any) as
    `reasoning_content`, which the template keeps or drops.

    `raw=True` is a conversation without a template (a model without one, like the bundled tiny model):
    each message (text or token ids) is appended to the ids of the messages and replies before it.
    """

    @checked_arguments
    def __init__(self, model: Model, system: str | None = None, *, enable_thinking: bool | None = None,
                 chat_template_kwargs: Mapping | None = None, raw: bool = False, max_tokens: int = 256,
                 n_draft: int | str = 1, seed: int = 0, stop=None, stop_at_eos: bool = True,
                 sampling: Sampling | str | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, min_p: float | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, repetition_penalty: float | None = None):
        if not isinstance(model, Model):
            raise UsageError(f"model: give a qmtp Model (qmtp.load(path)), not {type(model).__name__}")
        if not isinstance(raw, bool):
            raise UsageError(f"raw={raw!r:.40} must be True or False")
        if raw:
            used = [name for name, value in (("system", system), ("enable_thinking", enable_thinking),
                                             ("chat_template_kwargs", chat_template_kwargs)) if value is not None]
            if used:
                raise UsageError(f"{used[0]} shapes a chat template's prompt, which raw=True leaves out")
        else:
            if model.tokenizer is None or model.tokenizer.chat_template is None:
                where = f"{model.path}: " if model.path else ""
                raise UsageError(f"{where}the model has no chat template: Conversation(model, raw=True) continues "
                                 f"raw text or token ids instead")
            if system is not None and not isinstance(system, str):
                raise UsageError(f"system: give the system message's text, not {type(system).__name__}")
            if enable_thinking is not None and not isinstance(enable_thinking, bool):
                raise UsageError(f"enable_thinking={enable_thinking!r:.40} must be True, False or None")
            if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
                raise UsageError(f"chat_template_kwargs: give a dict of the template's variables, not "
                                 f"{type(chat_template_kwargs).__name__}")
        # the settings are checked now, not at the first message
        settings = Settings.of(max_tokens, n_draft, seed, stop, stop_at_eos, sampling, temperature, top_k, top_p,
                               min_p, presence_penalty, frequency_penalty, repetition_penalty)
        settings.check_for(model)
        settings.check_room(model)
        self.model, self.raw, self.seed = model, raw, int(seed)
        self.system = system
        self.enable_thinking, self.template_kwargs = chat.generation_variables(enable_thinking, chat_template_kwargs)
        self.settings = settings  # seeded per turn: see `send`
        self.cache = PrefixCache()
        self._sending = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Start a new conversation (the system message kept); the kept decoding state is dropped."""
        self._messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        self._tokens: list[int] = []
        self.turns = 0
        self.cache.clear()

    @property
    def messages(self) -> list[dict]:
        """The history so far (a copy), the system message, then each user message and reply."""
        return [dict(m) for m in self._messages]

    @property
    def tokens(self) -> list[int]:
        """With raw=True, the ids of the messages and replies so far (a copy)."""
        return list(self._tokens)

    @checked_arguments
    def next_prompt(self, message) -> str:
        """The prompt's text that sending `message` next would generate after (a chat shows the reply's
        thinking apart when this prompt opens a think block: `qmtp.chat.opens_thinking`)."""
        if self.raw:
            return self.model.tokenizer.decode(self._prompt_ids(message)) if self.model.tokenizer else ""
        return self._render(self._with(message), add_generation_prompt=True)

    @checked_arguments
    def send(self, message, *, on_tokens=None) -> Generation:
        """Add a user message, generate the reply (streamed to `on_tokens`, as in `generate`), add it to the
        history, and return the generation. A message the template or the model refuses leaves the history
        as it was."""
        if not self._sending.acquire(blocking=False):
            raise UsageError("this conversation is already answering a message: send the next when it is done")
        try:
            seed = (self.seed + self.turns) % SEEDS
            if self.raw:
                ids = self._prompt_ids(message)
                g = decode(self.model, ids, replace(self.settings, seed=seed), prefix_cache=self.cache,
                           on_tokens=on_tokens)
                self._tokens = ids + g.tokens
            else:
                messages = self._with(message)
                text = self._render(messages, add_generation_prompt=True)
                ids = self.model.tokenizer.encode(text)
                # where the generation prompt starts: the next turn's history parts from this one there or later
                history = self.model.tokenizer.encode(self._render(messages, add_generation_prompt=False))
                self.cache.mark(common_prefix(history, ids))
                g = decode(self.model, ids, replace(self.settings, seed=seed), prefix_cache=self.cache,
                           on_tokens=on_tokens)
                thinking, answer = chat.split_thinking(g.text, chat.opens_thinking(text))
                reply = {"role": "assistant", "content": answer}
                if thinking:
                    reply["reasoning_content"] = thinking
                self._messages = messages + [reply]
            self.turns += 1
            return g
        finally:
            self.cache.take_marks()  # a generation refused before its prefill leaves its mark behind
            self._sending.release()

    def _with(self, message) -> list[dict]:
        if not isinstance(message, str):
            raise UsageError(f"message: give the user's text, not {type(message).__name__} {message!r:.40}")
        if not message.strip():
            raise UsageError("the message is empty: give some text")
        return self._messages + [{"role": "user", "content": message}]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.model.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        enable_thinking=self.enable_thinking, **self.template_kwargs)

    def _prompt_ids(self, message) -> list[int]:
        if isinstance(message, str) and not message:
            raise UsageError("the message is empty: give some text or token ids")
        ids = _prompt_tokens(self.model, message)
        if not ids:
            raise UsageError("the message is empty: give some text or token ids")
        return self._tokens + ids
