"""Chat: the model's chat template rendered as transformers renders it, the ids that end a reply, and a reply
split into its thinking and its answer.

Qwen3.5 and 3.6 are chat models: a conversation reaches them as `<|im_start|>ROLE\\n...<|im_end|>\\n` turns,
rendered from a list of messages by the checkpoint's chat template, a Jinja program (`chat_template.jinja`,
or `chat_template` in `tokenizer_config.json`). The template decides everything the model sees: the system
message, the tools, whether the reply starts inside `<think>` (thinking on, the default) or after an empty
`<think>\\n\\n</think>` (`enable_thinking=False`), and whether the thinking of earlier turns is kept.

`render` runs a template exactly as transformers' `apply_chat_template(..., tokenize=False)` does (checked
against it in tests/test_chat.py): a sandboxed Jinja environment (`ImmutableSandboxedEnvironment`, with
`trim_blocks` and `lstrip_blocks`, the loop-controls extension and the `{% generation %}` tag), its
`raise_exception`, its `tojson` (no HTML escaping, non-ASCII kept), `strftime_now`, `dict` and a
`namespace` that refuses underscore names; messages are copied as plain JSON data with the keys whose
value is None dropped, and a message's `reasoning` or `thinking` is also passed as `reasoning_content`
(and the other way round), as transformers 5 does; the tokenizer's named special tokens (`eos_token`,
...) are variables, which keyword arguments override.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from .checkpoint import read_json
from . import template_bounds
from .errors import CheckpointError, QmtpError, TemplateError, TemplateRefusedError, TemplateTimeoutError, UsageError
from .template_bounds import TemplateLimits, bounded

__all__ = ["GENERATION_CONFIG", "TEMPLATE_FILE", "end_ids", "opens_thinking", "render", "split_thinking"]

TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
MAX_TEMPLATE_BYTES = 1024 * 1024  # Qwen3.6's template is about 8 KB
MAX_JSON_INDENT = 64
THINK, END_THINK = "<think>", "</think>"
# The names transformers passes a message's reasoning under (it fills all of them from whichever is given)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ---- where the template comes from ------------------------------------------------------------------------
def load_template(directory: str | os.PathLike[str] | None, config: Mapping) -> str | None:
    """The template of a model directory: `chat_template.jinja` if it exists (transformers gives it priority),
    else `chat_template` in tokenizer_config.json (a string, or a list of named templates of which "default"
    is used), else None."""
    if directory is not None:
        path = Path(directory) / TEMPLATE_FILE
        if path.exists() or path.is_symlink():
            from .checkpoint import open_regular

            with open_regular(path, what=TEMPLATE_FILE) as f:
                data = f.read(MAX_TEMPLATE_BYTES + 1)
            if len(data) > MAX_TEMPLATE_BYTES:
                raise CheckpointError(f"{path}: more than {MAX_TEMPLATE_BYTES} bytes, too large for a chat template")
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise CheckpointError(f"{path}: not UTF-8 text (byte {err.start})") from None
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    return named_templates(config).get("default")  # without one, a chat must name its template (or use raw text)


def named_templates(config: Mapping) -> dict[str, str]:
    """The named templates of tokenizer_config.json's `chat_template` when it is a list
    ([{"name": "default", "template": "..."}, {"name": "tool_use", ...}], as transformers saves several); {} when
    it is one string or absent. A list whose entries are not {name, template} pairs of text is damaged."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return {}
    entries = value if isinstance(value, list) else None
    if entries is None or not all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                  and isinstance(t.get("template"), str) for t in entries):
        raise CheckpointError("tokenizer_config.json: chat_template must be a string or a list of "
                              f"{{'name': ..., 'template': ...}} entries, got {value!r:.60}")
    return {t["name"]: t["template"] for t in entries}


def generation_variables(enable_thinking, variables: Mapping | None) -> tuple[bool | None, dict]:
    """`generate`'s `enable_thinking` and `chat_template_kwargs` as one setting: the kwargs may name
    enable_thinking (as OpenAI-style servers take it) when the argument is not given otherwise; they may name
    add_generation_prompt and tokenize only as True, what a prompt to generate from is. Returns
    (enable_thinking, the other variables)."""
    rest = dict(variables or {})
    bad = next((k for k in rest if not isinstance(k, str)), None)
    if bad is not None:
        raise UsageError(f"chat_template_kwargs: {bad!r:.40} is not a variable name (give text keys)")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):  # the template tests `is false`
        raise UsageError(f"enable_thinking={enable_thinking!r:.40} must be True, False or None")
    if "enable_thinking" in rest:
        given = rest.pop("enable_thinking")
        if given is not None and not isinstance(given, bool):
            raise UsageError(f"chat_template_kwargs: enable_thinking={given!r:.40} must be True, False or None")
        if enable_thinking is not None and given is not enable_thinking:
            raise UsageError(f"enable_thinking is given twice: {enable_thinking!r} as an argument and {given!r:.20} in "
                             f"chat_template_kwargs; give it once")
        enable_thinking = given
    for name in ("add_generation_prompt", "tokenize"):
        if name in rest and rest.pop(name) is not True:
            raise UsageError(f"chat_template_kwargs: {name} must be True here (generation starts from the "
                             f"tokenized prompt with its generation prompt), or left out")
    # Checked here, where the variables are first taken, so that a Conversation refuses them when it is made
    # (not at its first message) and a batch names the row: what rendering would refuse later, or what
    # `apply_chat_template`'s own parameters would take as theirs.
    clash = next((name for name in ("messages", "template", "special_tokens") if name in rest), None)
    if clash is not None:
        raise UsageError(f"chat_template_kwargs: {clash} cannot be a template variable here: apply_chat_template sets it")
    if "chat_template" in rest and not isinstance(rest["chat_template"], str):
        raise UsageError(f"chat_template_kwargs: chat_template must be a template's text or name, not "
                         f"{type(rest['chat_template']).__name__}")
    _check_tools(rest.get("tools"), "chat_template_kwargs: tools")
    return enable_thinking, _plain(rest, "chat_template_kwargs")


# ---- the Jinja environment, as transformers builds it -----------------------------------------------------
def compile_template(source: str, limits: TemplateLimits | None = None):
    """The compiled template; a syntax error is one line naming the template's line. Compiling runs under
    `limits` (default `template_bounds.LIMITS`): a template nested too deeply for the parser is one error."""
    if not isinstance(source, str):
        raise UsageError(f"chat_template: give the template's text, not {type(source).__name__}")
    limits = limits or template_bounds.LIMITS
    compiled = bounded(limits, "the chat template does not compile", lambda: _compile(source))
    failure = _probe(source, limits)
    if failure is not None:
        raise TemplateError(failure)
    return compiled


PROBE = ({"role": "user", "content": "Hello"},)


@functools.lru_cache(maxsize=8)
def _probe(source: str, limits: TemplateLimits) -> str | None:
    """How the template fails on a one-message conversation by running past a bound or raising from its own
    computation (`{{ 1 / 0 }}`), or None: so that `doctor` and every later call learn it at once. A refusal of
    the probe's messages is no failure; running out of time is raised, not remembered (a busy machine is no
    verdict on the template)."""
    compiled = _compile(source)
    data = dict(messages=[dict(m) for m in PROBE], tools=None, documents=None, add_generation_prompt=True)
    try:
        bounded(limits, "the chat template fails", lambda: _render_bounded(compiled, data, limits.chars))
    except TemplateTimeoutError:
        raise
    except TemplateError as err:
        return str(err)
    except QmtpError:
        pass
    return None


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; rendering
        keeps the text as it is (what transformers renders when it does not track the spans)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        if width > MAX_JSON_INDENT:  # each line of the JSON repeats it once per level
            template_bounds.refuse(f"indents JSON by {width} characters a level, more than {MAX_JSON_INDENT}")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` in a template, without the class's attributes
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template cannot store {name!r} (underscore) on a namespace")

    env = template_bounds.environment_class()(trim_blocks=True, lstrip_blocks=True, optimized=False,
                                              finalize=template_bounds.check_output,
                                              extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = template_bounds.bounded_filters(env.filters)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise CheckpointError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None
    except (RecursionError, SyntaxError, MemoryError) as err:  # Python's own compiler on deeply nested blocks
        raise TemplateError(f"the chat template does not compile: it nests too deeply ({type(err).__name__}: "
                            f"{err})") from None


# ---- the data a template sees -------------------------------------------------------------------------------
MAX_DATA_DEPTH = 200  # nesting of the lists and dicts a template is given (JSON schemas nest a few levels)


def _plain(value, where: str, _inside: tuple = ()):
    """`value` rebuilt from plain JSON types (what the sandbox may read); anything else is a usage error, and so
    is text with a lone surrogate (no tokenizer can encode it), a list or dict that contains itself, or data
    nested deeper than MAX_DATA_DEPTH."""
    if type(value) is str:
        if not value.isascii():
            refuse_surrogates(value, where)
        return value
    if isinstance(value, str):  # a subclass (an enum...) may carry methods: back to the base type
        refuse_surrogates(value, where)
        return str(value)
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    for kind in (int, float):
        if isinstance(value, kind):  # a subclass (an enum...) may carry methods: back to the base type
            return kind(value)
    if isinstance(value, (Mapping, list, tuple)):
        if any(value is outer for outer in _inside):
            raise UsageError(f"{where}: contains itself (a list or dict inside itself has no text)")
        if len(_inside) >= MAX_DATA_DEPTH:
            raise UsageError(f"{where}: nested more than {MAX_DATA_DEPTH} levels deep")
        inside = (*_inside, value)
        if isinstance(value, Mapping):
            return {_plain(k, where, inside): _plain(v, f"{where}[{k!r:.40}]", inside) for k, v in value.items()}
        return type(value)(_plain(v, f"{where}[{i}]", inside) for i, v in enumerate(value))
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and getattr(value, "shape", None) == ():
        return _plain(item(), where)
    raise UsageError(f"{where}: a chat template reads text, numbers, lists and dicts, not {type(value).__name__}")


def refuse_surrogates(text: str, where: str) -> None:
    """A lone surrogate ("\\ud800", half of a UTF-16 pair) is not a character: no UTF-8 encodes it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UsageError(f"{where}: holds a lone surrogate {text[err.start]!r} at character {err.start}, which is "
                         f"not text (decode the bytes it came from as UTF-8 with errors='replace')") from None


def _messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise UsageError(f"messages: give a list of {{'role': ..., 'content': ...}} dicts, not "
                         f"{type(messages).__name__} {messages!r:.40}")
    if not messages:
        raise UsageError("messages: the conversation is empty: give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise UsageError(f"messages[{i}]: give a dict with 'role' and 'content', not {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise UsageError(f"messages[{i}]: needs a 'role' (system, user, assistant or tool), got {role!r:.40}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise UsageError(f"messages[{i}] ({role}): 'content' must be text or a list of parts, not "
                             f"{type(content).__name__}")
        plain = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        reasoning = next((plain[k] for k in REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:  # as transformers 5: every template finds it under the name it reads
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _check_tools(tools, where: str) -> None:
    if tools is None:
        return
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise UsageError(f"{where}: give a list of JSON schemas (dicts), not {type(tools).__name__}")
    bad = next((t for t in tools if not isinstance(t, Mapping)), None)
    if bad is not None:
        raise UsageError(f"{where}: each tool is a JSON schema (a dict), not {type(bad).__name__} {bad!r:.40}")


def render(template: str, messages, *, tools=None, documents=None, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str] | None = None, **kwargs) -> str:
    """The text of `messages` (and `tools`, JSON schemas) under `template`; `kwargs` (enable_thinking,
    preserve_thinking, ...) are the template's variables. A template that refuses the conversation
    (`raise_exception`, a missing field) raises UsageError with its message."""
    import jinja2

    chat = _messages(messages)
    _check_tools(tools, "tools")
    variables = _plain({**(special_tokens or {}), **kwargs}, "template argument")
    data = dict(messages=chat, tools=_plain(tools, "tools"), documents=_plain(documents, "documents"),
                add_generation_prompt=add_generation_prompt, **variables)
    limits = template_bounds.LIMITS
    compiled = compile_template(template, limits)
    text = bounded(limits, "the chat template fails", lambda: _render_bounded(compiled, data, limits.chars))
    refuse_surrogates(text, "the chat template's output")
    return text


def _render_bounded(compiled, data: dict, max_chars: int) -> str:
    """The template's text, streamed so that it stops as soon as it has written more than `max_chars`; an
    exception from inside the template is one error naming its type."""
    import jinja2

    parts, written = [], 0
    try:
        for part in compiled.generate(**data):
            written += len(part)
            if written > max_chars:
                raise TemplateError(f"the chat template fails: it writes more than its limit of {max_chars:,} "
                                    f"characters")
            parts.append(part)
    except jinja2.exceptions.TemplateError as err:  # raise_exception, undefined names, the sandbox
        raise TemplateRefusedError(f"the chat template refuses these messages: {err.message or type(err).__name__}") \
            from None
    except (RecursionError, MemoryError, TemplateError):
        raise  # `bounded` says which, or this function already did
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:  # e.g. content of a wrong kind
        raise TemplateRefusedError(f"the chat template fails on these messages: {type(err).__name__}: "
                                   f"{_line(err)}") from None
    except Exception as err:  # a division by zero, an overflow... whatever the template computes
        raise TemplateError(f"the chat template fails: {type(err).__name__}: {_line(err)}") from None
    return "".join(parts)


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{text.splitlines()[0]:.200}" if text else "(no message)"


# ---- where a reply ends -------------------------------------------------------------------------------------
def end_ids(model) -> frozenset[int]:
    """Every id that ends a reply: the tokenizer's (`<|endoftext|>` and its config's `eos_token`) and the
    `eos_token_id` of the checkpoint's generation_config.json (one id or a list: Qwen3.6 lists `<|im_end|>`
    and `<|endoftext|>`)."""
    ids = set(model.tokenizer.end_ids) if model.tokenizer is not None else set()
    path = Path(model.path) / GENERATION_CONFIG if getattr(model, "path", None) else None
    if path is not None and (path.exists() or path.is_symlink()):
        config = read_json(path, what=GENERATION_CONFIG)
        value = config.get("eos_token_id") if isinstance(config, dict) else None
        declared = value if isinstance(value, list) else [value] if value is not None else []
        for token in declared:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.config.vocab_size:
                raise CheckpointError(f"{path}: eos_token_id {value!r:.60} must be an id (or a list of ids) below "
                                      f"the vocabulary size {model.config.vocab_size}")
            ids.add(token)
    return frozenset(ids)


# ---- thinking and answer ------------------------------------------------------------------------------------
def opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt leaves the reply inside a `<think>` block (the template's generation prompt with
    thinking on): then the reply's text up to `</think>` is its thinking."""
    return prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK)


def split_thinking(text: str, opened: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a reply, cut as Qwen's template cuts an assistant message: the thinking is what
    comes before `</think>` (after any `<think>`), newlines trimmed; the answer what follows it, leading
    newlines dropped. A reply with no `</think>` is all thinking when the prompt `opened` a think block (it
    ran out of tokens while thinking) or it starts one itself, else all answer."""
    if END_THINK in text:
        head, _, answer = text.partition(END_THINK)
        return head.split(THINK)[-1].strip("\n"), answer.lstrip("\n")
    if opened or text.lstrip().startswith(THINK):
        return text.split(THINK, 1)[-1].strip("\n") if not opened else text.strip("\n"), ""
    return "", text


def generation_prompt_start(tokenizer, messages, prompt_tokens: list[int], enable_thinking: bool | None = None,
                            **variables) -> int:
    """Where the generation prompt starts in `prompt_tokens` (`messages` rendered with it): the tokens the
    template's render without it shares with them. A chat's next turn renders this turn's reply otherwise than it
    was generated (Qwen's template drops its thinking), so the next prompt continues this one up to there: a
    state held at that position (`ContinuousBatch.submit(..., marks=...)`) serves it. Found from the template's
    own renders, never from a token's spelling; 0 when the template refuses the render (no mark)."""
    from .prefix_cache import common_prefix

    try:
        history = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False,
                                                enable_thinking=enable_thinking, tokenize=True, **variables)
    except QmtpError:
        return 0
    return common_prefix(list(history), list(prompt_tokens))
