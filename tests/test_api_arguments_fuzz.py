"""Fuzzing the Python API's arguments (issue 45): `generate_batch`, `Conversation` and `generate` take whatever a
caller may pass and either return a well-formed result or raise ONE `QmtpError` naming the argument (and, in a
batch, the row), never a TypeError, ValueError, IndexError, KeyError, AttributeError or MLX error, a crash or a
hang. A refused call leaves nothing behind: a fixed greedy batch gives the tokens it gives alone, checked every
few examples and at the end.

The values are those a caller gets wrong: the wrong type (text for a number, a list for a scalar, a dict, None, a
bool), numbers at the edges (0, -1, huge, NaN, +-inf, a float for an int, numpy scalars), odd text (a lone
surrogate, NUL, emoji, bidi marks, special tokens, the empty string), token ids outside the vocabulary or not
integers, malformed messages, per-row lists of the wrong length and keywords that do not exist. Most values
are good, so that a call usually has one or two bad ones and many calls run.

Deterministic and bounded as tests/test_fuzz.py (`derandomize=True`, no example database); more examples with
QMTP_FUZZ_EXAMPLES=N (each property runs N), another random stream with QMTP_FUZZ_SEED.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import strategies as st

import qmtp
from qmtp import Engine, Sampling, Settings
from qmtp.batch import SETTINGS, BatchResult
from qmtp.errors import QmtpError
from qmtp.speculative import Generation
from conftest import event, fuzz

MAX_TOKENS = 6  # every generated call asks for at most this many tokens, so that examples stay fast
SLOW_CALL = 30  # seconds: far beyond what a call of <= 6 tokens on the tiny model takes on a busy machine
CHECK_EVERY = 20  # examples between two checks that a good call still gives its tokens
REFERENCE = ["Once upon a time", [5, 6, 7, 8]]
FINISH_REASONS = {"length", "end", "stop", "error"}


@pytest.fixture(scope="module")
def model():
    """The bundled tiny model: a tokenizer, a chat template and an MTP head, as a real checkpoint has."""
    return qmtp.load()


@pytest.fixture(scope="module")
def reference(model):
    """What a fixed greedy batch gives before any fuzzed call, and a check that it still gives it."""
    alone = [row.tokens for row in qmtp.generate_batch(model, REFERENCE, max_tokens=MAX_TOKENS, n_draft=[1, 3])]
    assert alone == [qmtp.generate(model, p, max_tokens=MAX_TOKENS).tokens for p in REFERENCE]
    seen = {"examples": 0}

    def check(force: bool = False):
        seen["examples"] += 1
        if force or seen["examples"] % CHECK_EVERY == 0:
            again = [row.tokens for row in qmtp.generate_batch(model, REFERENCE, max_tokens=MAX_TOKENS,
                                                                n_draft=[1, 3])]
            assert again == alone, "a fuzzed call changed what a later good call gives"
            assert qmtp.generate(model, REFERENCE[0], max_tokens=MAX_TOKENS).tokens == alone[0]

    return check


# ---- values -----------------------------------------------------------------------------------------------------
HUGE = [2**31, 2**32, 2**53 + 1, 2**63, 2**64, 2**70, 10**30, -(2**63), -(2**70)]
FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, 1.0, 2.5, 1e308, -1e308, 5e-324, 1e-45, 3.5e38, -3.5e38]
NUMPY = [np.int64(2), np.int32(-1), np.uint8(3), np.uint64(2**64 - 1), np.float32(0.5), np.float64(np.nan),
         np.float16(np.inf), np.float32(-np.inf), np.bool_(True), np.bool_(False), np.int64(2**62), np.float64(1e300)]
WORDS = ["auto", "model", "1", "", "nan", "inf", "greedy", "None", "True", " 2 "]
CHARS = ["\ud800", "\udfff", "\x00", "\U0001f600", "\u202e", "\u200f", "\ufeff", "e\u0301", "\U0010ffff", "\ufffd",
         "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "\n", "{{", "{%", "a", " ", "fox"]


class Opaque:
    """An object no API knows (its repr says so in a failing example)."""

    def __repr__(self):
        return "Opaque()"


junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(HUGE), st.sampled_from(FLOATS),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(NUMPY), st.sampled_from(WORDS),
    st.text(max_size=4), st.binary(max_size=3), st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=1),
    st.sampled_from([1 + 2j, frozenset({1}), (1, 2), [None], [[1]], np.array([1, 2]), np.array(3), Opaque(),
                     Sampling(), Engine(), range(2), {"temperature": 1.0}]),
)


def one_in(odds: int):
    """True one time in `odds`. (Hypothesis starts from, and leans to, the smallest choices: those are the
    plain ones here, so that the odds hold and a failure shrinks towards good values.)"""
    return st.integers(0, odds - 1).map(lambda i: i == odds - 1)


def sometimes(good, bad=junk, odds: int = 8):
    """`bad` one time in `odds`, else `good`."""
    return one_in(odds).flatmap(lambda b: bad if b else good)


odd_text = st.one_of(
    st.sampled_from(["Hello", "Once upon a time", "", " ", "\x00", "\ud800", "\u202eolleH", "\U0001f600" * 3]),
    st.text(max_size=12),
    st.lists(st.sampled_from(CHARS), max_size=6).map("".join),
)
token_ids = st.one_of(
    st.lists(st.integers(0, 1027), min_size=1, max_size=8),
    st.lists(st.one_of(st.integers(0, 1027), st.sampled_from([-1, 1028, 2**31, 2**64, -(2**70)])), max_size=6),
    st.lists(st.one_of(st.integers(0, 9), junk), min_size=1, max_size=3),
    st.lists(st.integers(0, 1027), min_size=1, max_size=4).map(tuple),
    st.lists(st.integers(0, 1027), min_size=1, max_size=4).map(np.array),
    st.lists(st.integers(0, 1027), min_size=1, max_size=4).map(lambda ids: [np.int64(i) for i in ids]),
    st.sampled_from([[], [2] * 5000, [[1, 2]], np.zeros((2, 2), int), range(3), [1.0, 2.0]]),
)
ROLES = ["user", "system", "assistant", "tool", "robot", "", "USER", None, 3]
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant", "system"]), "content": odd_text}),
    st.fixed_dictionaries(
        {},
        optional={"role": st.sampled_from(ROLES), "content": sometimes(odd_text),
                  "reasoning_content": sometimes(odd_text), "name": sometimes(odd_text),
                  "tool_calls": junk, "extra": junk},
    ),
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}),
                                               max_size=2)}),
    junk,
)
message_lists = st.lists(message, min_size=1, max_size=3)
prompts_row = st.one_of(odd_text, token_ids, message_lists, junk)
unknown_keywords = st.sampled_from(["max_new_tokens", "temprature", "prompt", "stream", "n", "top_a", "", "seed ",
                                    "logprobs", "system"])


def setting_values(name: str):
    """A value for one of `Settings.of`'s arguments: mostly within range, sometimes at an edge or junk."""
    good = {
        "max_tokens": st.integers(1, MAX_TOKENS),
        "n_draft": st.sampled_from([1, 2, 3, "auto"]),
        "seed": st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**64 - 1])),
        "stop": st.one_of(st.none(), odd_text, st.lists(odd_text, max_size=2)),
        "stop_at_eos": st.sampled_from([True, False, np.bool_(False)]),
        "sampling": st.sampled_from([None, "model", Sampling(), Sampling(temperature=0.8, top_k=5),
                                     Sampling(presence_penalty=1.5), "Model", "greedy"]),
        "temperature": st.one_of(st.sampled_from([0, 0.0, 0.7, 1.0, 2.0]), st.floats(0, 1e308)),
        "top_k": st.one_of(st.integers(0, 40), st.sampled_from([1027, 1028, 1029, 2**40, 10**30, 5.0])),
        "top_p": st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0, 5e-324, 1e-300, 1 - 1e-16])),
        "min_p": st.one_of(st.floats(0, 1), st.sampled_from([0.0, 1.0, 5e-324, 1 - 1e-16])),
        "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([1e30, -1e30, 3.4e38, -3.4e38, 1e300])),
        "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([1e30, -1e30, 3.4e38, -3.4e38, 1e300])),
        "repetition_penalty": st.one_of(st.floats(0.5, 2), st.sampled_from([1e-300, 1e-45, 1e-38, 1e38, 1e300])),
    }[name]
    return sometimes(good)


TEMPLATE_KWARGS = [None, {}, {"preserve_thinking": True}, {"enable_thinking": False}, {"enable_thinking": "no"},
                   {1: 2}, {"messages": []}, {"tokenize": False}, {"add_generation_prompt": 0}, {"tools": "x"},
                   {"tools": [{"type": "function"}]}, {"documents": 3}, {"\ud800": 1}, {"x": Opaque()}]
template_kwargs = sometimes(st.sampled_from(TEMPLATE_KWARGS))
thinking = sometimes(st.sampled_from([None, True, False]))


def optional(values, odds: int = 3):
    """(a value,) one time in `odds`, else None: the argument left out."""
    return one_in(odds).flatmap(lambda given: values.map(lambda v: (v,)) if given else st.none())


def per_row(values, rows: int):
    """One value, or (one time in four) a list or tuple of values, one per row (one time in ten of those, one
    too many or too few)."""
    lengths = st.integers(0, 9).map(lambda i: rows if i < 9 else max(rows - 1, 0) if rows % 2 else rows + 1)
    lists = lengths.flatmap(lambda n: st.lists(values, min_size=n, max_size=n))
    return one_in(4).flatmap(lambda listed: st.tuples(lists, st.booleans()).map(
        lambda v: tuple(v[0]) if v[1] else v[0]) if listed else values)


# ---- what a call may do -----------------------------------------------------------------------------------------
ALIASES = {"prompts": ("prompt", "message"), "prompt": ("prompt",), "messages": ("message",),
           "message": ("message", "prompt"), "system": ("system", "message"), "sampling": ("sampling",),
           "stop": ("stop",), "stop_at_eos": ("stop_at_eos",), "engine": ("engine", "Engine("),
           "chat_template_kwargs": ("chat_template_kwargs", "enable_thinking", "template"),
           "enable_thinking": ("enable_thinking",), "max_tokens": ("max_tokens", "prompt")}


def names_an_argument(message: str, given: dict) -> bool:
    """Whether the message names one of the arguments given (or a key of the dict given as one)."""
    names = set()
    for name, value in given.items():
        names.update(ALIASES.get(name, (name,)))
        if name == "chat_template_kwargs" and isinstance(value, dict):
            names.update(repr(k) if not isinstance(k, str) else k for k in value)
    names.add("positional")  # too many positional arguments
    return any(n and n in message for n in names)


@contextlib.contextmanager
def deadline(seconds: float):
    """A call still running after `seconds` fails the example (a hang would otherwise stop the whole run)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def hung(signum, frame):
        raise AssertionError(f"a call has run for {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def attempt(call, given: dict, refused: list | None = None):
    """call(): its result, or None after checking the error is one QmtpError naming an argument given (and
    appending its message to `refused`)."""
    started = time.perf_counter()
    try:
        with deadline(SLOW_CALL):
            result = call()
    except QmtpError as err:
        message = str(err)
        assert message and names_an_argument(message, given), f"{type(err).__name__} names no argument: {message}"
        event(f"refused: {type(err).__name__}")
        if refused is not None:
            refused.append(message)
        return None
    finally:
        elapsed = time.perf_counter() - started
        assert elapsed < SLOW_CALL, f"a call took {elapsed:.1f} s"
    event("returned")
    return result


def check_generation(model, g, max_tokens) -> None:
    assert isinstance(g, Generation), type(g)
    vocab = model.config.vocab_size
    assert isinstance(g.tokens, list) and all(type(t) is int and 0 <= t < vocab for t in g.tokens), g.tokens
    assert isinstance(g.prompt_tokens, list) and all(type(t) is int and 0 <= t < vocab for t in g.prompt_tokens)
    assert len(g.tokens) <= max_tokens, (len(g.tokens), max_tokens)
    assert g.finish_reason in FINISH_REASONS, g.finish_reason
    assert g.finish_reason != "length" or len(g.tokens) == max_tokens
    assert isinstance(g.text, str)
    g.text.encode("utf-8")  # text a caller can print and send on: no lone surrogate


def call_keywords(draw, names, rows=None) -> dict:
    """Keyword arguments drawn for `names` (each left out two times in three), `rows` > 0 making them per-row."""
    kwargs = {}
    for name in names:
        values = setting_values(name)
        drawn = draw(optional(per_row(values, rows) if rows else values, odds=1 if name == "max_tokens" else 3))
        if drawn is not None:
            kwargs[name] = drawn[0]
    if draw(one_in(25)):
        kwargs[draw(unknown_keywords)] = draw(junk)
    return kwargs


# ---- generate_batch ---------------------------------------------------------------------------------------------
@st.composite
def batch_calls(draw):
    """(positional arguments after the model, keyword arguments) of one generate_batch call."""
    shape = draw(st.integers(0, 19))  # 19: prompts is no list of rows; 17, 18: anything in a row; 16: messages=
    rows = draw(st.integers(1, 3))
    if shape == 19:
        prompts = draw(st.one_of(junk, st.just([]), odd_text))
    else:
        prompts = draw(st.lists(prompts_row if shape >= 17 else st.one_of(odd_text, token_ids, message_lists),
                                min_size=rows, max_size=rows))
    args, kwargs = [], {}
    if shape == 16:  # one conversation per row, as messages=
        kwargs["messages"] = draw(st.lists(sometimes(message_lists), min_size=rows, max_size=rows))
    else:
        args.append(prompts)
    kwargs.update(call_keywords(draw, SETTINGS, rows))
    for name, values in (("enable_thinking", thinking), ("chat_template_kwargs", template_kwargs)):
        drawn = draw(optional(per_row(values, rows), odds=2 if shape == 16 else 6))  # shaping message rows
        if drawn is not None:
            kwargs[name] = drawn[0]
    extra = draw(st.integers(0, 11))
    if extra == 9:
        kwargs["max_batch"] = draw(sometimes(st.sampled_from([None, 1, 2, 3, np.int64(2)]), odds=3))
    elif extra == 10:
        kwargs["engine"] = draw(sometimes(st.sampled_from([Engine(), Engine(acceptance="rejection"),
                                                           Engine(rollback="replay"), Engine(compiled=False)]),
                                          odds=3))
    elif extra == 11 and draw(one_in(3)):  # a positional argument past the last
        args += [kwargs.pop(n, d) for n, d in (("max_tokens", 2), ("n_draft", 1), ("temperature", None),
                                                ("seed", 0))] + [draw(junk)]
    return args, kwargs


BATCH_LEVEL = ("prompts", "messages", "max_batch", "engine", "Engine(", "generate_batch", "values for",
               "enable_thinking and chat_template_kwargs")


def rows_of(args, kwargs) -> int:
    return len(kwargs["messages"] if "messages" in kwargs else args[0])


def value_of_row(value, row: int):
    return value[row] if isinstance(value, (list, tuple)) else value


@fuzz(250)
@given(batch_calls())
@example(([["Hello", [1, 2]]], {"max_tokens": 2, "top_k": 2**40}))
@example(([["Hi"]], {"max_tokens": 2, "max_new_tokens": 3}))  # Python's TypeError, before ArgumentError
@example(([[[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]]],
          {"max_tokens": 2, "chat_template_kwargs": [None, {"messages": []}]}))  # a TypeError from the template
@example(([[[5, 6]]], {"max_tokens": 4, "presence_penalty": 1e300}))
@example(([[[5, 6], "Hi"]], {"max_tokens": 2, "max_batch": 0}))
def test_generate_batch_arguments(model, reference, call):
    args, kwargs = call
    given_names = dict(kwargs, prompts=args[0] if args else None)
    refused = []
    result = attempt(lambda: qmtp.generate_batch(model, *args, **kwargs), given_names, refused)
    if refused:
        row = re.match(r"row (\d+): ", refused[0])
        if row is not None:  # a row's own value: the row it is in
            assert int(row[1]) < rows_of(args, kwargs), refused[0]
        else:  # else a value of the whole batch (a per-row value refused without its row would be here)
            assert any(n in refused[0] for n in BATCH_LEVEL), f"names no row: {refused[0]}"
    if result is not None:
        rows = rows_of(args, kwargs)
        assert isinstance(result, BatchResult) and len(result) == len(result.errors) == rows
        max_batch = kwargs.get("max_batch")  # 0 and False were once taken as "every row"
        assert max_batch is None or (not isinstance(max_batch, (bool, np.bool_)) and max_batch >= 1), max_batch
        max_tokens = kwargs.get("max_tokens", args[1] if len(args) > 1 else 64)
        for row, (g, error) in enumerate(zip(result, result.errors)):
            check_generation(model, g, value_of_row(max_tokens, row))
            assert (error is None) == (g.finish_reason != "error"), (row, error, g.finish_reason)
            assert error is None or isinstance(error, QmtpError), f"row {row} ended with {error!r}"
    reference()


def test_generate_batch_leaves_the_model_as_it_was(model, reference):
    """After every fuzzed call above (this file's tests run in order), the fixed batch still gives its tokens."""
    reference(force=True)


# ---- Conversation -----------------------------------------------------------------------------------------------
@st.composite
def conversations(draw):
    """(constructor keyword arguments, the messages to send)."""
    raw = draw(sometimes(st.booleans(), odds=12))
    kwargs = {} if raw is False else {"raw": raw}
    if raw is not True:
        for name, values in (("system", sometimes(odd_text)), ("enable_thinking", thinking),
                             ("chat_template_kwargs", template_kwargs)):
            drawn = draw(optional(values))
            if drawn is not None:
                kwargs[name] = drawn[0]
    elif draw(one_in(10)):  # a template's argument where raw=True leaves the template out
        kwargs["system"] = "Be brief."
    kwargs.update(call_keywords(draw, SETTINGS))
    turns = draw(st.lists(odd_text if raw is not True else st.one_of(odd_text, token_ids), min_size=1,
                          max_size=3))
    return kwargs, [draw(sometimes(st.just(t), odds=10)) for t in turns], draw(optional(sometimes(st.just("collect"), odds=2), odds=5))


@fuzz(150)
@given(conversations())
@example(({"max_tokens": 3, "system": "\ud800"}, ["Hi"], None))
@example(({"max_tokens": 3, "chat_template_kwargs": {"enable_thinking": "no"}}, ["Hi"], None))  # refused at send
@example(({"max_tokens": 3, "chat_template_kwargs": {"messages": []}}, ["Hi"], None))  # a TypeError at send
@example(({"max_tokens": 3, "temprature": 1.0}, ["Hi"], None))
@example(({"max_tokens": 3, "raw": True}, [[1, 2], "more", [-1]], ("collect",)))
def test_conversation_arguments(model, reference, call):
    kwargs, turns, on_tokens = call
    conversation = attempt(lambda: qmtp.Conversation(model, **kwargs), kwargs)
    if conversation is not None:
        assert isinstance(conversation, qmtp.Conversation)
        for text in turns:
            before = (conversation.messages, conversation.tokens, conversation.turns)
            collected = []
            streamed = {} if on_tokens is None else {"on_tokens": collected.extend if on_tokens[0] == "collect"
                                                     else on_tokens[0]}
            g = attempt(lambda: conversation.send(text, **streamed), {"message": text, **streamed})
            if g is None:
                assert (conversation.messages, conversation.tokens, conversation.turns) == before, \
                    "a refused message changed the history"
                continue
            check_generation(model, g, kwargs["max_tokens"])
            assert g.tokens[:len(collected)] == collected  # the end id or a stop's last token is not streamed
            assert conversation.turns == before[2] + 1
            attempt(lambda: conversation.next_prompt(text), {"message": text})
    reference()


# ---- generate ---------------------------------------------------------------------------------------------------
@st.composite
def generate_calls(draw):
    kind = draw(st.integers(0, 9))  # 9: messages=; 8: a prompt and messages; 6, 7: anything as the prompt
    kwargs = {}
    if kind == 9:
        kwargs["messages"] = draw(sometimes(message_lists))
    elif kind == 8:
        kwargs.update(prompt=draw(prompts_row), messages=draw(message_lists))  # both: refused
    else:
        kwargs["prompt"] = draw(st.one_of(odd_text, token_ids) if kind < 6 else prompts_row)
    if kind >= 8:
        for name, values in (("enable_thinking", thinking), ("chat_template_kwargs", template_kwargs)):
            drawn = draw(optional(values))
            if drawn is not None:
                kwargs[name] = drawn[0]
    kwargs.update(call_keywords(draw, SETTINGS))
    if draw(one_in(15)):
        kwargs[draw(st.sampled_from(["on_tokens", "prefix_cache", "engine"]))] = draw(junk)
    return kwargs


def penalised_greedy(kwargs) -> bool:
    """Whether the call is greedy with penalties that count generated tokens only (its first token is then
    the unpenalised one, whatever the penalties' values)."""
    return (not {"temperature", "sampling", "repetition_penalty"} & set(kwargs)
            and bool({"presence_penalty", "frequency_penalty"} & set(kwargs)))


@fuzz(150)
@given(generate_calls())
@example({"prompt": "Hello world hello", "max_tokens": 6, "stop_at_eos": False, "presence_penalty": 1e300})
@example({"prompt": [5, 6], "max_tokens": 6, "frequency_penalty": -1e300})
def test_generate_arguments(model, reference, kwargs):
    g = attempt(lambda: qmtp.generate(model, **kwargs), kwargs)
    if g is not None:
        check_generation(model, g, kwargs["max_tokens"])
        if penalised_greedy(kwargs) and g.tokens:  # a penalty past float32 once made every logit NaN
            assert g.tokens[0] == qmtp.generate(model, g.prompt_tokens, max_tokens=1, stop_at_eos=False).tokens[0]
    reference()


SAMPLER_FIELDS = ["temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"]


ENGINE_FIELDS = ["head", "hidden", "head_cache", "chain", "rollback", "acceptance", "track_experts", "compiled",
                 "queue_ahead", "timer"]


@fuzz(500)
@given(st.dictionaries(st.sampled_from(SAMPLER_FIELDS), junk, max_size=3),
       st.dictionaries(st.sampled_from([*SETTINGS, "temprature", "max_new_tokens"]), junk, max_size=3),
       st.dictionaries(st.sampled_from([*ENGINE_FIELDS, "rollbak"]), junk, max_size=2))
@example({}, {"n_draft": np.array([1, 2])}, {"hidden": np.array([1, 2])})  # `==` gave an array: a ValueError
@example({}, {}, {"compiled": "no"})  # taken as True
def test_sampler_and_settings_arguments(fields, settings, engine):
    """`Sampling(...)`, `Settings.of(...)` and `Engine(...)` on junk alone: cheap, so many more values than a call
    can try."""
    sampling = attempt(lambda: Sampling(**fields), fields)
    if sampling is not None:
        assert all(type(getattr(sampling, f)) is (int if f == "top_k" else float) for f in SAMPLER_FIELDS)
        assert all(math.isfinite(getattr(sampling, f)) for f in SAMPLER_FIELDS)
    made = attempt(lambda: Settings.of(**settings), settings)
    if made is not None:
        assert isinstance(made, Settings) and type(made.max_tokens) is int and made.max_tokens >= 1
    made = attempt(lambda: Engine(**engine), engine)
    if made is not None:
        assert all(type(getattr(made, f)) is bool for f in ("track_experts", "compiled", "queue_ahead"))
        assert all(type(getattr(made, f)) is str for f in ("hidden", "head_cache", "chain", "rollback", "acceptance"))


def test_the_model_is_still_as_it_was(model, reference):
    reference(force=True)
