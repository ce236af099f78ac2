"""The OpenAI API's requests and responses, as vLLM's OpenAI server takes and gives them.

`parse_chat` and `parse_completion` turn a request's JSON into a `Parsed`: the prompt's token ids, a
`qmtp.Settings` and how to answer. Every field is checked here, and anything wrong raises `ApiError`, which
the app answers in the API's error shape (`{"error": {"message", "type", "param", "code"}}`) with a 400
naming the field: a field that would change the output and is not supported (`tools`, `logit_bias`, ...)
included. Fields clients send that change nothing (`user`, ...) are accepted and ignored; sampler fields
left out come from the model's generation_config.json, and `max_tokens` left out is the rest of the context.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from .. import chat
from ..errors import CheckpointError, QmtpError, UsageError
from ..options import MAX_N_DRAFT, SEEDS, Settings
from ..sampling import Sampling

SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
# fields that change nothing qmtp gives back: accepted, and ignored
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                     "prompt_cache_key", "request_id", "priority", "skip_special_tokens",
                     "spaces_between_special_tokens"})
# fields that would change the output: refused unless they hold the value that changes nothing
UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "min_tokens": (None, 0), "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
}
COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "seed", "stop", "n_draft", "ignore_eos",
                    *SAMPLER_FIELDS})
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON | {"prompt"}
TEMPLATE_VARIABLES = ("enable_thinking", "preserve_thinking")


class ApiError(QmtpError):
    """A request answered with an error: `status`, and the API's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """A checked request: what to decode and how to answer."""

    kind: str  # "chat" or "completion"
    prompt_tokens: list[int]
    settings: Settings
    stream: bool
    include_usage: bool
    opened_thinking: bool  # the prompt leaves the reply inside <think>: reasoning_content comes apart


@dataclass(frozen=True)
class Served:
    """What the server serves: the model, its name, the default draft width, and the sampler a request's
    fields go over (None: the model's generation_config.json, read at every request)."""

    model: object
    name: str
    n_draft: int | str = 1
    sampling: Sampling | None = None


# ---- one field at a time ------------------------------------------------------------------------------------
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(body: Mapping, known: frozenset) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED:
            if not any(value == allowed and type(value) is type(allowed) for allowed in UNSUPPORTED[name]):
                raise ApiError(f"{name} is not supported by qmtp serve (it would change the output; leave it out)",
                               name, code="unsupported_field")
        elif name not in known and name not in IGNORED:
            raise ApiError(f"unknown field {name!r:.60}", str(name)[:60], code="unknown_field")


def _optional_int(body: Mapping, name: str, least: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < least:
        raise ApiError(f"{name}={value!r:.40} must be an integer >= {least}", name)
    return value


def _optional_bool(body: Mapping, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(f"{name}={value!r:.40} must be true or false", name)
    return value


def _sampler(body: Mapping) -> dict:
    given = {}
    for name in SAMPLER_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(f"{name}={value!r:.40} must be a number", name)
        if name == "top_k":
            if value != int(value):
                raise ApiError(f"top_k={value!r} must be a whole number (-1 or 0: no top-k filter)", name)
            value = max(int(value), 0) if value >= -1 else value  # vLLM's -1: no filter, as 0 here
        given[name] = value
    return given


def _stream_options(body: Mapping, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise ApiError("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(f"stream_options.{unknown[0]} is not supported", f"stream_options.{unknown[0]}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError("stream_options.include_usage must be true or false", "stream_options.include_usage")
    return include


def _check_model(body: Mapping, served: Served) -> None:
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise ApiError(f"model={name!r:.40} must be a string", "model")
    if name != served.name:
        raise ApiError(f"The model `{name[:80]}` does not exist: this server serves `{served.name}`", "model",
                       status=404, code="model_not_found")


# ---- the settings -------------------------------------------------------------------------------------------
def _settings(body: Mapping, served: Served, prompt_tokens: list[int], max_tokens: int | None) -> Settings:
    model = served.model
    n_draft = body.get("n_draft", None)
    if n_draft is None:
        n_draft = served.n_draft
    elif n_draft != "auto" and (not _is_int(n_draft) or not 1 <= n_draft <= MAX_N_DRAFT):
        raise ApiError(f"n_draft={n_draft!r:.40} must be an integer from 1 (plain decoding) to {MAX_N_DRAFT}, "
                       f"or \"auto\"", "n_draft")
    limit = model.config.max_position_embeddings
    if len(prompt_tokens) > limit:
        raise ApiError(f"the prompt is {len(prompt_tokens)} tokens, longer than the model's context of {limit} "
                       f"tokens", "messages" if "messages" in body else "prompt", code="context_length_exceeded")
    widest = 5 if n_draft == "auto" else n_draft
    room = limit - len(prompt_tokens) - (widest - 1)
    if max_tokens is None:
        if room < 1:
            raise ApiError(f"the prompt is {len(prompt_tokens)} tokens: the model's context of {limit} tokens "
                           f"leaves no room for a reply", "messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(f"the prompt is {len(prompt_tokens)} tokens and max_tokens asks for {max_tokens} more: the "
                       f"model's context is {limit} tokens (ask for at most {max(room, 0)})", "max_tokens",
                       code="context_length_exceeded")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(SEEDS)  # as the API: a request without a seed is not reproducible
    elif not _is_int(seed) or not 0 <= seed < SEEDS:
        raise ApiError(f"seed={seed!r:.40} must be an integer from 0 to 2**64 - 1", "seed")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise ApiError("stop must be a string or a list of strings", "stop")
    ignore_eos = _optional_bool(body, "ignore_eos")
    try:
        settings = Settings.of(max_tokens=max_tokens, n_draft=n_draft, seed=seed, stop=stop or None,
                               stop_at_eos=not ignore_eos, sampling=served.sampling or "model",
                               **_sampler(body))
        settings.check_for(model)  # the model's own sampler with the overrides, the head for drafting
    except UsageError as error:
        message = str(error)
        param = next((f for f in (*SAMPLER_FIELDS, "stop", "n_draft") if message.startswith(f)), None)
        raise ApiError(message, param) from None
    return settings


# ---- the two requests ---------------------------------------------------------------------------------------
def _head(body, served: Served, known: frozenset) -> tuple[bool, bool]:
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object")
    _check_fields(body, known)
    _check_model(body, served)
    stream = bool(_optional_bool(body, "stream"))
    return stream, _stream_options(body, stream)


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ApiError(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type", "text") != "text" or not isinstance(
                        part.get("text"), str):
                    raise ApiError(f"messages[{i}].content[{j}]: qmtp serve reads text parts only "
                                   f"({{\"type\": \"text\", \"text\": ...}})", f"messages[{i}].content")
    return messages


def _template_variables(body: Mapping) -> dict:
    given = body.get("chat_template_kwargs")
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ApiError("chat_template_kwargs must be an object", "chat_template_kwargs")
    for name, value in given.items():
        if name not in TEMPLATE_VARIABLES:
            raise ApiError(f"chat_template_kwargs.{name!s:.40} is not supported (only "
                           f"{', '.join(TEMPLATE_VARIABLES)})", f"chat_template_kwargs.{name!s:.40}")
        if value is not None and not isinstance(value, bool):
            raise ApiError(f"chat_template_kwargs.{name} must be true or false", f"chat_template_kwargs.{name}")
    return {k: v for k, v in given.items() if v is not None}


def parse_chat(body, served: Served) -> Parsed:
    """A /v1/chat/completions request, checked: its messages rendered by the model's chat template."""
    stream, include_usage = _head(body, served, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    variables = _template_variables(body)
    tokenizer = served.model.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise ApiError(f"the model `{served.name}` has no chat template: use /v1/completions with a prompt",
                       "messages", code="no_chat_template")
    enable_thinking = variables.pop("enable_thinking", None)
    try:
        text = tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking, **variables)
    except UsageError as error:
        raise ApiError(str(error), "messages") from None
    except CheckpointError as error:  # the server's template is broken: not the client's fault
        raise ApiError(str(error), None, status=500, kind="server_error") from None
    prompt_tokens = tokenizer.encode(text)
    given = [_optional_int(body, name, 1) for name in ("max_completion_tokens", "max_tokens")]
    max_tokens = next((n for n in given if n is not None), None)
    settings = _settings(body, served, prompt_tokens, max_tokens)
    return Parsed("chat", prompt_tokens, settings, stream, include_usage, chat.opens_thinking(text))


def _prompt(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise ApiError("this model has no tokenizer: give the prompt as token ids", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("prompt: qmtp serve takes one prompt per request (n = 1)", "prompt")
    raise ApiError("prompt must be non-empty text or a list of token ids", "prompt")


def parse_completion(body, served: Served) -> Parsed:
    """A /v1/completions request, checked: its prompt as text or token ids."""
    stream, include_usage = _head(body, served, COMPLETION_FIELDS)
    prompt_tokens = _prompt(body.get("prompt"), served.model.tokenizer)
    vocab = served.model.config.vocab_size
    outside = next((t for t in prompt_tokens if not 0 <= t < vocab), None)
    if outside is not None:
        raise ApiError(f"prompt token id {outside} is outside the vocabulary (0..{vocab - 1})", "prompt")
    settings = _settings(body, served, prompt_tokens, _optional_int(body, "max_tokens", 1))
    return Parsed("completion", prompt_tokens, settings, stream, include_usage, False)


# ---- responses ----------------------------------------------------------------------------------------------
def finish_reason(reason: str | None) -> str:
    """The API's finish_reason: "length" when max_tokens ended it, else "stop" (an end id or a stop string)."""
    return "length" if reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shapes:
    """The response objects of one request (its id and creation time shared by every chunk)."""

    def __init__(self, kind: str, model_name: str):
        self.kind, self.model_name = kind, model_name
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, extra: dict | None = None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name, "choices": choices,
                **(extra or {})}

    def chunk(self, reasoning: str = "", content: str = "", finish: str | None = None, role: bool = False) -> dict:
        """A streamed chunk: new text (chat: a delta, thinking apart) and, last, the finish reason."""
        if self.kind == "completion":
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
            return self._envelope("text_completion", [choice])
        delta = {"role": "assistant", "content": ""} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, counts: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], {"usage": counts})

    def whole(self, reasoning: str | None, content: str, finish: str, counts: dict) -> dict:
        """The whole response of a request that did not stream."""
        if self.kind == "completion":
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
            return self._envelope("text_completion", [choice], {"usage": counts})
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return self._envelope("chat.completion", [choice], {"usage": counts})
