"""The OpenAI API's requests and responses, as vLLM's OpenAI server takes and gives them.

`parse_chat` and `parse_completion` turn a request's JSON into a `Parsed`: the prompt's token ids, a
`qmtp.Settings` and how to answer. Every field is checked here, and anything wrong raises `ApiError`, which
the app answers in the API's error shape (`{"error": {"message", "type", "param", "code"}}`) with a 400
naming the field: a field that would change the output and is not supported (`tools`, `logit_bias`, ...)
included. Any other field qmtp does not know (`user`, `cache_salt`, a tracing id...) changes nothing: it is
accepted and ignored, with one warning per field name, as vLLM does.

Sampler fields left out take vLLM's defaults (`defaults`): temperature, top_p, top_k, min_p and
repetition_penalty from the model's generation_config.json, and the API's own for the rest (presence and
frequency penalties 0), so a temperature-0 request is `qmtp.generate`'s greedy decoding. `max_tokens` left
out is the rest of the context. A JSON number equal to an integer (`5.0`) is that integer in every integer
field; NaN, Infinity and numbers beyond a float's range are a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .. import chat
from ..adaptive import WIDTHS
from ..errors import CheckpointError, QmtpError, TemplateError, TemplateTimeoutError, UsageError
from ..options import SEEDS, Settings, check_n_draft
from ..sampling import Sampling

log = logging.getLogger("qmtp.serve")

SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
# what vLLM reads from generation_config.json; the penalties it leaves at the API's 0, and so does the server
FROM_MODEL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# fields clients commonly send that change nothing qmtp gives back: ignored without a warning
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                     "prompt_cache_key", "request_id", "priority", "skip_special_tokens",
                     "spaces_between_special_tokens", "cache_salt"})
# fields that would change the output: refused unless they hold the value that changes nothing (an integer
# written as a float, `n: 1.0`, counts as that integer)
UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "min_tokens": (None, 0), "stop_token_ids": (None, []),
    "include_stop_str_in_output": (None, False), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    # vLLM's own fields that change the prompt, the tokens or the text
    "truncate_prompt_tokens": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1),
    "bad_words": (None, []), "allowed_token_ids": (None,), "prompt_logprobs": (None, 0),
    "logits_processors": (None,), "chat_template": (None,), "documents": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False), "mm_processor_kwargs": (None,), "vllm_xargs": (None,),
}
COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "seed", "stop", "n_draft", "ignore_eos",
                    *SAMPLER_FIELDS})
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON | {"prompt"}
ENDPOINT_FIELDS = CHAT_FIELDS | COMPLETION_FIELDS
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
    marks: tuple = ()  # where the chat's next turn parts from this prompt (`chat.generation_prompt_start`)


@dataclass(frozen=True)
class Served:
    """What the server serves: the model, its name, the default draft width, and the sampler a request's
    fields go over (None: `defaults(model)`, read at every request)."""

    model: object
    name: str
    n_draft: int | str = 1
    sampling: Sampling | None = None


def defaults(model) -> Sampling:
    """The sampler a request's fields go over, as vLLM's: FROM_MODEL from the model's generation_config.json
    (`do_sample: false` is temperature 0), the penalties at the API's defaults. Unlike `generate(...,
    sampling="model")`, which keeps the whole file (the model card's presence_penalty included)."""
    declared = Sampling.of_model(model)
    return replace(Sampling(), **{name: getattr(declared, name) for name in FROM_MODEL})


def describe_defaults(served: Served) -> dict:
    """What /v1/models says of the sampler fields a request leaves out: each default and where it comes from."""
    sampler = served.sampling or defaults(served.model)
    return {"sampler_defaults": {name: getattr(sampler, name) for name in SAMPLER_FIELDS},
            "sampler_defaults_from": {name: "generation_config.json" if name in FROM_MODEL else "api"
                                      for name in SAMPLER_FIELDS}}


# ---- one field at a time ------------------------------------------------------------------------------------
FLOAT_MAX = sys.float_info.max


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    """A value as an error message shows it: short, and never the repr of a whole (maybe deeply nested) list."""
    if isinstance(value, (list, Mapping)):
        return f"<{'a list' if isinstance(value, list) else 'an object'} of {len(value)}>"
    return f"{value!r:.40}"


def _whole(value):
    """A float equal to an integer as that integer: clients that write every number as a float send 5.0."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


_warned: set[str] = set()
_warned_lock = threading.Lock()  # requests are parsed on one event loop, but tests call parse_* from threads
MAX_WARNED = 1000  # a client may send any number of distinct names: the set stays bounded


def _ignore(name: str) -> None:
    with _warned_lock:
        name = name[:60]
        if name in _warned or len(_warned) > MAX_WARNED:
            return
        _warned.add(name)
        full = len(_warned) > MAX_WARNED
    log.warning("qmtp serve ignores the request field %r (it changes nothing qmtp gives back)%s", name,
                "; no more unknown field names will be logged" if full else "")


def _check_fields(body: Mapping, known: frozenset) -> dict:
    """The body without the fields it ignores (each unknown name logged once); a 400 for a field that would
    change the output and is not supported, or one of the other endpoint."""
    checked = {}
    for name, value in body.items():
        if _is_int(value) and abs(value) > FLOAT_MAX and (name in known or name in UNSUPPORTED):
            # no field takes such a number, and the sampler's float checks would overflow on it
            raise ApiError(f"{name}: {str(value)[:20]}... ({len(str(abs(value)))} digits) is beyond a float's "
                           f"range", name)
        if name in UNSUPPORTED:
            value = _whole(value)
            if not any(value == allowed and type(value) is type(allowed) for allowed in UNSUPPORTED[name]):
                raise ApiError(f"{name}={_shown(value)} is not supported by qmtp serve "
                               f"(it would change the output; leave it out)", name, code="unsupported_field")
        elif name in ENDPOINT_FIELDS - known:  # a client that sends it expects it honoured: say where it is
            other = "/v1/completions" if name in COMPLETION_FIELDS else "/v1/chat/completions"
            raise ApiError(f"{name} is a field of {other}, not of this endpoint", name, code="unsupported_field")
        elif name not in known:
            if name not in IGNORED:
                _ignore(name)
            continue
        checked[name] = value
    return checked


def _optional_int(body: Mapping, name: str, least: int) -> int | None:
    value = _whole(body.get(name))
    if value is None:
        return None
    if not _is_int(value) or value < least:
        raise ApiError(f"{name}={_shown(value)} must be an integer >= {least}", name)
    return value


def _optional_bool(body: Mapping, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(f"{name}={_shown(value)} must be true or false", name)
    return value


def _sampler(body: Mapping, vocab: int) -> dict:
    given = {}
    for name in SAMPLER_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(f"{name}={_shown(value)} must be a number", name)
        if name == "top_k":
            value = _whole(value)
            if not _is_int(value) or value < -1:
                raise ApiError(f"top_k={_shown(value)} must be a whole number >= -1 (-1 or 0: no top-k filter)",
                               name)
            # vLLM's -1 is no filter, as 0 here, and so is any k past the vocabulary (10**400 included: it
            # overflows a float in the sampler's checks)
            value = 0 if value == -1 or value >= vocab else value
        else:
            try:  # an integer beyond a float's range (10**400) overflows here, not deep in the sampler
                value = float(value)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                raise ApiError(f"{name}={value!r} must be a finite number", name)
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
        raise ApiError(f"model={_shown(name)} must be a string", "model")
    if name != served.name:
        raise ApiError(f"The model `{name[:80]}` does not exist: this server serves `{served.name}`", "model",
                       status=404, code="model_not_found")


def _stop(stop) -> list[str] | None:
    """The stop strings, the empty ones left out: "" can end nothing (vLLM and OpenAI accept it)."""
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError("stop must be a string or a list of strings", "stop")
    return [s for s in stops if s] or None


# ---- the settings -------------------------------------------------------------------------------------------
def _settings(body: Mapping, served: Served, prompt_tokens: list[int], max_tokens: int | None,
              max_tokens_field: str = "max_tokens") -> Settings:
    model = served.model
    n_draft = _whole(body.get("n_draft", None))
    if n_draft is None:
        n_draft = served.n_draft
    try:
        n_draft = check_n_draft(n_draft)
    except UsageError as error:
        raise ApiError(str(error), "n_draft") from None
    limit = model.config.max_position_embeddings
    if len(prompt_tokens) > limit:
        raise ApiError(f"the prompt is {len(prompt_tokens)} tokens, longer than the model's context of {limit} "
                       f"tokens", "messages" if "messages" in body else "prompt", code="context_length_exceeded")
    widest = max(WIDTHS) if n_draft == "auto" else n_draft
    room = limit - len(prompt_tokens) - (widest - 1)
    if max_tokens is None:
        if room < 1:
            raise ApiError(f"the prompt is {len(prompt_tokens)} tokens: the model's context of {limit} tokens "
                           f"leaves no room for a reply", "messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(f"the prompt is {len(prompt_tokens)} tokens and {max_tokens_field} asks for {max_tokens} "
                       f"more: the model's context is {limit} tokens (ask for at most {max(room, 0)})",
                       max_tokens_field,
                       code="context_length_exceeded")
    seed = _whole(body.get("seed"))
    if seed is None:
        seed = secrets.randbelow(SEEDS)  # as the API: a request without a seed is not reproducible
    elif not _is_int(seed) or not 0 <= seed < SEEDS:
        raise ApiError(f"seed={_shown(seed)} must be an integer from 0 to 2**64 - 1", "seed")
    stop = _stop(body.get("stop"))
    ignore_eos = _optional_bool(body, "ignore_eos")
    try:
        settings = Settings.of(max_tokens=max_tokens, n_draft=n_draft, seed=seed, stop=stop,
                               stop_at_eos=not ignore_eos, sampling=served.sampling or defaults(model),
                               **_sampler(body, model.config.vocab_size))
        settings.check_for(model)  # the model's own sampler with the overrides, the head for drafting
    except UsageError as error:
        message = str(error)
        param = next((f for f in (*SAMPLER_FIELDS, "stop", "n_draft") if message.startswith(f)), None)
        raise ApiError(message, param) from None
    return settings


# ---- the two requests ---------------------------------------------------------------------------------------
def _head(body, served: Served, known: frozenset) -> tuple[dict, bool, bool]:
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object")
    body = _check_fields(body, known)
    _check_model(body, served)
    stream = bool(_optional_bool(body, "stream"))
    return body, stream, _stream_options(body, stream)


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects", "messages")
    out = []
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
        if message.get("tool_calls") is not None:
            message = {**message, "tool_calls": _tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")}
        out.append(message)
    return out


def _tool_calls(calls, where: str) -> list:
    """The API sends a call's arguments as a JSON string; Qwen's template reads them as an object (its
    parameters one by one), so they are parsed here, as vLLM does before rendering."""
    if not isinstance(calls, list):
        raise ApiError(f"{where} must be a list of {{\"id\", \"type\": \"function\", \"function\": ...}} objects",
                       where)
    out = []
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ApiError(f"{here} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           f"\"arguments\": ...}}}}", here)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as error:
                raise ApiError(f"{here}.function.arguments is not JSON: {str(error)[:120]}",
                               f"{here}.function.arguments") from None
        if arguments is not None and not isinstance(arguments, Mapping):
            raise ApiError(f"{here}.function.arguments must be a JSON object of the call's parameters",
                           f"{here}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _encode(tokenizer, text: str, param: str) -> list[int]:
    """Text's ids; text no tokenizer can encode (a lone surrogate...) is the client's to fix."""
    try:
        return tokenizer.encode(text)
    except Exception as error:  # the Rust tokenizer's own errors are not QmtpErrors
        raise ApiError(f"{param}: the tokenizer cannot encode this text: {str(error)[:200]}", param) from None


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


def _render(tokenizer, messages: list, enable_thinking, variables: dict) -> str:
    """The prompt's text. A template that does not compile, or fails on a one-message conversation, is the
    server's fault (a 500); one that fails only on these messages (it writes past its limit of characters, it
    divides by a number they hold) is theirs: a UsageError, a 400."""
    chat.compile_template(tokenizer.chat_template)  # cached: no cost after the first request
    try:
        return tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking, **variables)
    except TemplateTimeoutError:
        raise
    except TemplateError as error:
        raise UsageError(str(error)) from None


def parse_chat(body, served: Served) -> Parsed:
    """A /v1/chat/completions request, checked: its messages rendered by the model's chat template."""
    body, stream, include_usage = _head(body, served, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    variables = _template_variables(body)
    tokenizer = served.model.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise ApiError(f"the model `{served.name}` has no chat template: use /v1/completions with a prompt",
                       "messages", code="no_chat_template")
    enable_thinking = variables.pop("enable_thinking", None)
    try:
        text = _render(tokenizer, messages, enable_thinking, variables)
    except UsageError as error:
        raise ApiError(str(error), "messages") from None
    except TemplateTimeoutError as error:  # perhaps only a busy machine: worth a retry
        raise ApiError(str(error), "messages", status=503, kind="server_error", code="template_timeout") from None
    except (CheckpointError, TemplateError) as error:  # the server's template is broken: not the client's fault
        raise ApiError(str(error), None, status=500, kind="server_error") from None
    prompt_tokens = _encode(tokenizer, text, "messages")
    names = ("max_completion_tokens", "max_tokens")
    given = [(_optional_int(body, name, 1), name) for name in names]
    max_tokens, field = next(((n, name) for n, name in given if n is not None), (None, "max_tokens"))
    settings = _settings(body, served, prompt_tokens, max_tokens, field)
    turn = chat.generation_prompt_start(tokenizer, messages, prompt_tokens, enable_thinking, **variables)
    return Parsed("chat", prompt_tokens, settings, stream, include_usage, chat.opens_thinking(text), (turn,))


def _prompt(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise ApiError("this model has no tokenizer: give the prompt as token ids", "prompt")
        return _encode(tokenizer, prompt, "prompt")
    if isinstance(prompt, list):
        prompt = [_whole(t) for t in prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("prompt: qmtp serve takes one prompt per request (n = 1)", "prompt")
    raise ApiError("prompt must be non-empty text or a list of token ids", "prompt")


def parse_completion(body, served: Served) -> Parsed:
    """A /v1/completions request, checked: its prompt as text or token ids."""
    body, stream, include_usage = _head(body, served, COMPLETION_FIELDS)
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
