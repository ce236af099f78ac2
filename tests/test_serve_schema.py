"""Fuzzing `qmtp serve`'s request schema: no body may get a 5xx, nor change what a later request gets.

Hypothesis builds, for /v1/chat/completions and /v1/completions, a valid body from the documented fields (odd
but valid text: NUL, right-to-left marks, emoji, the template's own special tokens; tool calls; unknown and
ignored fields of any JSON), then sets up to two fields, documented or refused by name, to anything: wrong
types, boundary and non-finite numbers, numbers past a float's range, lone surrogates, broken messages and
prompts. Bodies go as JSON (NaN and Infinity as Python's json writes them) to the app in this process
(Starlette's TestClient runs its lifespan, so the engine thread runs as under uvicorn). Every answer is a 2xx (a
whole reply, or a stream ending in [DONE] with no error in it) or a 4xx in the API's error shape; an unchanged
body gets a 200, a body with one field changed a 200 or a 4xx naming that field; and every CHECK_EVERY
examples, and once after them, a greedy and a seeded request get exactly what they got first, alone.

Each sampler the engine has not seen costs a compiled step (seconds): valid bodies take their sampler fields
from a few whole profiles, so that the examples are many and the compiled steps few. max_tokens is always
there and at most 8 when valid (left out, a reply is the rest of the context).

The default budget keeps this file under about 40 s on a busy 2-core machine, deterministic
(`derandomize=True`, no example database). To hunt deeper:

    QMTP_FUZZ_EXAMPLES=2000 pytest tests/test_serve_schema.py          # more examples, still reproducible
    QMTP_FUZZ_SEED=123 QMTP_FUZZ_EXAMPLES=2000 pytest ...               # a different random stream
"""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("sse_starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

import qmtp  # noqa: E402
from qmtp.serve import protocol  # noqa: E402
from qmtp.serve.main import build  # noqa: E402
from conftest import event, fuzz  # noqa: E402

CHECK_EVERY = 25
MAX_TOKENS = 8




# ---- values -------------------------------------------------------------------------------------------------
ODD_TEXT = st.sampled_from([
    "", " ", "\ud800", "a\udfffb", "\udc00\ud800", "\x00", "nul\x00byte", "\u202eevil\u202c", "\u200f\u200e",
    "\U0001f600\U0001f415\u200d\U0001f9ba", "\ufeff", "e\u0301", "\U0010ffff", "\ufffd", "<|im_end|>",
    "<|im_start|>assistant\n", "<|endoftext|>", "<think>", "</think>", "{{ 1 / 0 }}", "{% for %}", "\n" * 8,
    "Once upon a time",
])
SURROGATE = st.characters(categories=["Cs"])
TEXT = st.one_of(
    ODD_TEXT,
    st.text(max_size=24),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=6), SURROGATE, st.text(max_size=6)),
)
ODD_NUMBERS = st.sampled_from([
    math.nan, math.inf, -math.inf, 10**400, -(10**400), 2**31, 2**63, 2**64, -(2**63), 1e308, -1e308, 5e-324,
    -0.0, 0, -1, -2, 0.5, 2.5, 1e-45, 1e300,
])
SCALARS = st.one_of(st.none(), st.booleans(), ODD_NUMBERS, st.integers(), st.floats(), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
WRONG = st.one_of(st.none(), st.booleans(), TEXT, st.lists(SCALARS, max_size=3),
                  st.dictionaries(TEXT, SCALARS, max_size=2))


VOCAB = 1028  # the bundled tiny model's (checked by the server fixture)
# the valid text: odd, but text (no lone surrogate)
VALID_TEXT = st.one_of(ODD_TEXT.filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)), st.text(max_size=24))
NAME = st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=12)
ARGUMENT_VALUES = st.one_of(VALID_TEXT, st.integers(-10**6, 10**6), st.booleans(), st.none(),
                            st.lists(st.integers(0, 9), max_size=3))


# ---- a valid body ---------------------------------------------------------------------------------------------
# Sampler fields come as whole profiles: each distinct sampler is a compiled step (seconds) the first time
PROFILES = st.sampled_from([
    {}, {"temperature": 0}, {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20, "min_p": 0.05, "presence_penalty": 1.5, "frequency_penalty": 0.5,
     "repetition_penalty": 1.2},
])
VALID_TOOL_CALL = st.fixed_dictionaries({
    "id": NAME, "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": NAME,
                                       "arguments": st.dictionaries(NAME, ARGUMENT_VALUES, max_size=2).map(json.dumps)})})
VALID_TURN = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": VALID_TEXT}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": VALID_TEXT}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": VALID_TEXT},
                          optional={"reasoning_content": VALID_TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": st.lists(VALID_TOOL_CALL, min_size=1, max_size=2)}),
)
VALID_MESSAGES = st.builds(
    lambda system, turns, question: system + turns + [{"role": "user", "content": question}],
    st.one_of(st.just([]), st.builds(lambda t: [{"role": "system", "content": t}], VALID_TEXT)),
    st.lists(VALID_TURN, max_size=2), VALID_TEXT)
VALID_COMMON = {
    "model": st.just("tiny"), "seed": st.integers(0, 2**64 - 1), "ignore_eos": st.booleans(),
    "stop": st.one_of(VALID_TEXT, st.lists(VALID_TEXT, max_size=3)), "n_draft": st.sampled_from([1, 3, "auto"]),
}
VALID_PROMPT = st.one_of(VALID_TEXT.filter(bool), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                         VALID_TEXT.filter(bool).map(lambda t: [t]),
                         st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4).map(lambda ids: [ids]))
# unknown names, and those known to change nothing: ignored, whatever they hold
HARMLESS = st.dictionaries(
    st.one_of(st.sampled_from(sorted(protocol.IGNORED) + ["truncate_prompt_tokens", "x-request-id", "traceparent"]),
              TEXT.filter(lambda name: name not in protocol.ENDPOINT_FIELDS and name not in protocol.UNSUPPORTED)),
    JSON, max_size=2).map(lambda extra: {k: v for k, v in extra.items()
                                         if k != "truncate_prompt_tokens" or v is None})


def valid(required: dict, optional: dict) -> st.SearchStrategy:
    """A body every field of which is valid: a 200 (streamed with stream_options only when stream is true)."""
    def assemble(base, profile, extra, stream, usage):
        body = {**extra, **profile, **base}
        if stream is not None:
            body["stream"] = stream
            if stream and usage is not None:
                body["stream_options"] = {"include_usage": usage}
        return body

    return st.builds(assemble, st.fixed_dictionaries(required, optional=optional), PROFILES, HARMLESS,
                     st.one_of(st.none(), st.booleans()), st.one_of(st.none(), st.booleans()))


VALID_CHAT = valid({"messages": VALID_MESSAGES, "max_tokens": st.integers(1, MAX_TOKENS)},
                   {**VALID_COMMON, "max_completion_tokens": st.integers(1, MAX_TOKENS),
                    "chat_template_kwargs": st.fixed_dictionaries({}, optional={
                        "enable_thinking": st.booleans(), "preserve_thinking": st.booleans()})})
VALID_COMPLETION = valid({"prompt": VALID_PROMPT, "max_tokens": st.integers(1, MAX_TOKENS)}, VALID_COMMON)


# ---- what a field may be turned into ----------------------------------------------------------------------------
ARGUMENTS = st.one_of(st.dictionaries(TEXT, SCALARS, max_size=2).map(json.dumps), TEXT, WRONG,
                      st.dictionaries(TEXT, SCALARS, max_size=2))
TOOL_CALL = st.one_of(
    st.fixed_dictionaries({"id": TEXT, "type": st.just("function"),
                           "function": st.fixed_dictionaries({"name": st.one_of(TEXT, WRONG)},
                                                             optional={"arguments": ARGUMENTS})}),
    WRONG)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                 st.fixed_dictionaries({"type": TEXT}, optional={"text": SCALARS}), WRONG)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), TEXT, WRONG)},
        optional={"content": st.one_of(TEXT, st.none(), st.lists(PART, max_size=2), WRONG),
                  "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), WRONG),
                  "reasoning_content": TEXT, "name": TEXT, "tool_call_id": TEXT}),
    WRONG)
MESSAGES = st.one_of(
    st.builds(lambda before, text: before + [{"role": "user", "content": text}], st.lists(MESSAGE, max_size=2),
              TEXT),  # most end with a user's question: the template renders them, or the text is refused
    st.lists(MESSAGE, min_size=1, max_size=3), WRONG)
PROMPT = st.one_of(TEXT, st.lists(st.integers(-3, 2 * VOCAB), max_size=6),
                   st.lists(st.one_of(st.integers(0, VOCAB - 1), ODD_NUMBERS, st.sampled_from([5.0, 6.0])),
                            max_size=4),
                   st.lists(TEXT, min_size=1, max_size=2),
                   st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=3), max_size=2), WRONG)
STREAM_OPTIONS = st.one_of(
    st.fixed_dictionaries({}, optional={"include_usage": st.one_of(st.booleans(), WRONG),
                                        "continuous_usage_stats": st.booleans()}),
    st.dictionaries(TEXT, SCALARS, max_size=2), WRONG)
TEMPLATE_KWARGS = st.one_of(
    st.fixed_dictionaries({}, optional={"enable_thinking": st.one_of(st.booleans(), WRONG),
                                        "preserve_thinking": st.one_of(st.booleans(), WRONG)}),
    st.dictionaries(TEXT, SCALARS, max_size=2), WRONG)
def small_or_refused(x) -> bool:
    """max_tokens values that are refused or small: never a long reply."""
    number = isinstance(x, (int, float)) and not isinstance(x, bool)
    return not (number and MAX_TOKENS < x < 10**5)  # NaN compares false, 10**400 as an integer


ANY = st.one_of(ODD_NUMBERS, WRONG, JSON, st.floats(), st.integers())
WILD = {
    "max_tokens": st.one_of(ODD_NUMBERS, WRONG, st.floats(), st.integers()).filter(
        lambda x: x is not None and small_or_refused(x)),
    "max_completion_tokens": st.one_of(ODD_NUMBERS, WRONG, st.floats(), st.integers()).filter(small_or_refused),
    "messages": MESSAGES,
    "prompt": PROMPT,
    "stop": st.one_of(TEXT, st.lists(st.one_of(TEXT, SCALARS), max_size=3), WRONG),
    "model": st.one_of(TEXT, WRONG),
    "stream_options": STREAM_OPTIONS,
    "chat_template_kwargs": TEMPLATE_KWARGS,
    "n_draft": st.one_of(ODD_NUMBERS, WRONG, st.sampled_from([0, 9, 2.5, "AUTO", 2.0])),
}
ODD_VALUES_OF_REFUSED = st.one_of(st.sampled_from([None, [], {}, 0, 1, 1.0, 2, False, True, "none", "text"]), ANY)


def mutations(fields: list[str]) -> st.SearchStrategy:
    """Up to two fields set to anything: wrong types, boundary and non-finite numbers, odd text."""
    names = st.one_of(st.sampled_from(fields), st.sampled_from(sorted(protocol.UNSUPPORTED)))  # half each
    one = names.flatmap(lambda name: st.tuples(st.just(name), WILD.get(
        name, ODD_VALUES_OF_REFUSED if name in protocol.UNSUPPORTED else ANY)))
    return st.lists(one, max_size=2, unique_by=lambda pair: pair[0])


CHAT_FIELDS = sorted(protocol.CHAT_FIELDS) + ["prompt"]
COMPLETION_FIELDS = sorted(protocol.COMPLETION_FIELDS) + ["messages", "max_completion_tokens", "chat_template_kwargs"]


# ---- the server and what it answers -------------------------------------------------------------------------
GREEDY = ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0,
                              "ignore_eos": True})
SEEDED = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                                   "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": 7, "ignore_eos": True})


def reply(api, path: str, body: dict) -> tuple:
    """What a well-formed request gets: its text (thinking included) and how many tokens."""
    response = api.post(path, json=body)
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    text = choice["text"] if "text" in choice else \
        (choice["message"].get("reasoning_content") or "") + choice["message"]["content"]
    return text, usage["completion_tokens"]


@pytest.fixture(scope="module")
def server():
    """The app, with what the references get before any fuzzed body reached it."""
    model = qmtp.load()
    assert model.config.vocab_size == VOCAB
    with TestClient(build(model, n_draft=3), raise_server_exceptions=False) as api:
        alone = [reply(api, *ref) for ref in (GREEDY, SEEDED)]
        assert alone[0][1] == alone[1][1] == MAX_TOKENS
        yield api, alone, {"examples": 0}


def check_references(api, alone) -> None:
    assert [reply(api, *ref) for ref in (GREEDY, SEEDED)] == alone, "a fuzzed request changed a later one's reply"


def check_answer(response, body) -> None:
    """A 2xx with a reply, or a 4xx in the API's error shape: never a 5xx."""
    status = response.status_code
    assert status < 500, f"{status} for {body!r:.2000}: {response.text[:1000]}"
    if status >= 400:
        error = response.json()["error"]
        assert set(response.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
        assert error["param"] is None or isinstance(error["param"], str), error
        assert error["code"] is None or isinstance(error["code"], str), error
        return
    assert status == 200, response.text[:500]
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data:"):].strip() for line in response.text.splitlines() if line.startswith("data:")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], f"{body!r:.2000}: {response.text[-1000:]}"
        assert chunks[-1]["choices"] or chunks[-1].get("usage") is not None
        return
    answer = response.json()
    assert len(answer["choices"]) == 1 and answer["usage"]["completion_tokens"] <= MAX_TOKENS, answer


def post(server, path: str, body: dict, changes: list) -> None:
    """`body` with `changes` made, posted and checked: valid, a 200; one field changed, a 200 or a 4xx naming it
    (or one inside it: messages[0].content); always a 2xx or a 4xx in the error shape."""
    api, alone, count = server
    body = {**body, **dict(changes)}
    raw = json.dumps(body)  # NaN and Infinity as their literals, a lone surrogate as its \\u escape
    response = api.post(path, content=raw, headers={"content-type": "application/json"})
    check_answer(response, body)
    event(f"{len(changes)} changed: {response.status_code}")
    if not changes:
        assert response.status_code == 200, f"a valid body refused: {body!r:.2000}: {response.text[:1000]}"
    elif len(changes) == 1 and response.status_code >= 400 and changes[0][0] != "stream":  # stream: its options
        name, param = changes[0][0], response.json()["error"]["param"] or ""
        assert param == name or param.startswith((name + ".", name + "[")), \
            f"{name} changed, but the error names {param!r}: {response.text[:1000]}"
    count["examples"] += 1
    if count["examples"] % CHECK_EVERY == 0:
        check_references(api, alone)


@fuzz(250)
@given(body=VALID_CHAT, changes=mutations(CHAT_FIELDS))
def test_a_chat_body_gets_a_reply_or_a_4xx_in_the_error_shape(server, body, changes):
    post(server, "/v1/chat/completions", body, changes)


@fuzz(250)
@given(body=VALID_COMPLETION, changes=mutations(COMPLETION_FIELDS))
def test_a_completion_body_gets_a_reply_or_a_4xx_in_the_error_shape(server, body, changes):
    post(server, "/v1/completions", body, changes)


def test_after_every_body_the_references_are_unchanged_and_no_row_is_held(server):
    api, alone, count = server
    assert count["examples"] >= 2 * 10  # the properties above ran (hypothesis stops early only on a failure)
    check_references(api, alone)
    deadline = time.monotonic() + 15  # a row leaves the engine's count at its step after the reply is sent
    while (health := api.get("/health").json())["active"] or health["waiting"]:
        assert time.monotonic() < deadline, f"rows still held: {health}"
        time.sleep(0.05)
    assert health["status"] == "ok", health
