"""`qmtp serve` under the fifth reliability round (issue 45): one test per class, against the app in this process.

The app runs under Starlette's TestClient (its lifespan starts the engine thread, as uvicorn's does), over the
bundled tiny model, whose generation_config.json has presence_penalty 1.5: what a request that leaves the
penalties out must not get.
"""

import json
import logging
import uuid

import pytest

pytest.importorskip("starlette")
pytest.importorskip("sse_starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

import qmtp  # noqa: E402
from qmtp.serve import protocol  # noqa: E402
from qmtp.serve.main import build  # noqa: E402

N_DRAFT = 3
HELLO = [{"role": "user", "content": "Tell me about the sea."}]
# a conversation whose greedy reply the presence penalty of generation_config.json changes within 48 tokens
PENALISED = [{"role": "user", "content": "List the days of the week."}]


@pytest.fixture(scope="module")
def model():
    return qmtp.load()


@pytest.fixture(scope="module")
def api(model):
    with TestClient(build(model, n_draft=N_DRAFT), raise_server_exceptions=False) as client:
        yield client


def chat(api, **body):
    return api.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 5, **body})


def refused(response, param: str) -> dict:
    """The error of a 400 naming `param`, in the API's shape."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


# ---- 2: defaults for omitted sampler fields -----------------------------------------------------------------
def test_an_omitted_penalty_is_zero_and_temperature_0_equals_generate(model, api):
    assert qmtp.Sampling.of_model(model).presence_penalty == 1.5  # what would change the reply if it applied
    wanted = qmtp.generate(model, messages=PENALISED, max_tokens=48, n_draft=N_DRAFT)  # greedy, no penalty
    penalised = qmtp.generate(model, messages=PENALISED, max_tokens=48, n_draft=N_DRAFT, sampling="model",
                              temperature=0)
    assert penalised.text != wanted.text
    reply = api.post("/v1/chat/completions", json={"messages": PENALISED, "max_tokens": 48, "temperature": 0})
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning_content"] + "</think>" + message["content"] == wanted.text
    given = api.post("/v1/chat/completions", json={"messages": PENALISED, "max_tokens": 48, "temperature": 0,
                                                   "presence_penalty": 1.5}).json()["choices"][0]["message"]
    assert given["reasoning_content"] + "</think>" + given["content"] == penalised.text


def test_defaults_take_what_vllm_takes_from_generation_config_and_models_says_so(api, tmp_path):
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 40, "min_p": 0.05,
              "repetition_penalty": 1.2, "presence_penalty": 1.5, "frequency_penalty": 0.3}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))

    class Checkpoint:
        path = tmp_path

    assert protocol.defaults(Checkpoint()) == qmtp.Sampling(temperature=0.7, top_p=0.8, top_k=40, min_p=0.05,
                                                          repetition_penalty=1.2)
    entry = api.get("/v1/models").json()["data"][0]
    assert entry["sampler_defaults"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                         "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                         "repetition_penalty": 1.0}
    assert entry["sampler_defaults_from"]["presence_penalty"] == "api"
    assert entry["sampler_defaults_from"]["top_k"] == "generation_config.json"


# ---- 3: numbers out of range --------------------------------------------------------------------------------
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGER_FIELDS = ("top_k", "max_tokens", "seed", "n_draft", "n", "best_of", "top_logprobs", "min_tokens",
                  "logprobs", "truncate_prompt_tokens", "length_penalty")
NOT_FINITE = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400")
BEYOND_FLOAT = "1" + "0" * 400  # an integer no float holds


# max_completion_tokens is chat's (/v1/completions refuses it by name, below); token ids are /v1/completions'
NUMERIC = [(endpoint, field) for endpoint in ("chat", "completions") for field in FLOAT_FIELDS + INTEGER_FIELDS] + \
    [("chat", "max_completion_tokens"), ("completions", "prompt")]


@pytest.mark.parametrize("endpoint,field", NUMERIC, ids=[f"{e}-{f}" for e, f in NUMERIC])
def test_a_number_out_of_range_is_a_400_naming_its_field(api, endpoint, field):
    head = '{"messages": [{"role": "user", "content": "Hi"}]' if endpoint == "chat" else '{"prompt": "Hi"'
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    literals = NOT_FINITE + (BEYOND_FLOAT, "-" + BEYOND_FLOAT)
    if field in INTEGER_FIELDS + ("max_completion_tokens", "prompt"):
        literals += ("2.5",)
    if field in INTEGER_FIELDS + ("max_completion_tokens", "prompt") and field != "top_k":
        literals += ("1e300",)  # the integer 10**300: out of every range but top_k's (past the vocabulary: no filter)
    for literal in literals:
        value = f"[5, {literal}]" if field == "prompt" else literal
        bound = ', "max_tokens": 3' if field not in ("max_tokens", "max_completion_tokens") else ""
        raw = f'{head}{bound}, "{field}": {value}}}' if field != "prompt" else f'{{"max_tokens": 3, "prompt": {value}}}'
        response = api.post(path, content=raw)
        assert response.status_code == 400, (literal, response.text)
        assert response.json()["error"]["param"] == field, (literal, response.text)


# ---- 4: a prompt the tokenizer refuses ----------------------------------------------------------------------
def test_a_prompt_the_tokenizer_refuses_is_a_400_on_both_endpoints(model, api, monkeypatch):
    lone = '"a\\ud800b"'  # a lone surrogate: valid JSON, no UTF-8 text
    for stream in ("false", "true"):
        response = api.post("/v1/completions", content=f'{{"prompt": {lone}, "max_tokens": 3, "stream": {stream}}}')
        assert "surrogate" in refused(response, "prompt")["message"]
    response = api.post("/v1/chat/completions",
                        content=f'{{"messages": [{{"role": "user", "content": {lone}}}], "max_tokens": 3}}')
    refused(response, "messages")

    def refuse(text):  # as the Rust tokenizer would raise, not a QmtpError
        raise RuntimeError("the tokenizer fell over")

    for raw in ('{"model": "\\ud800", "prompt": "Hi"}', '{"prompt": "Hi", "n": "\\udfff"}'):
        response = api.post("/v1/completions", content=raw)  # the error's message quotes the lone surrogate
        assert response.status_code in (400, 404) and "\\ud" in response.text, response.text
        assert response.json()["error"]["param"] in ("model", "n")

    monkeypatch.setattr(model.tokenizer, "encode", refuse)
    assert "fell over" in refused(api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}),
                                  "prompt")["message"]
    refused(chat(api), "messages")


# ---- 6: unknown harmless fields -----------------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_logged_once_and_output_changing_ones_refused(api, caplog):
    plain = chat(api, temperature=0).json()["choices"][0]["message"]
    trace = f"x_trace_{uuid.uuid4().hex[:8]}"  # a name no earlier test logged
    extra = {"truncate_prompt_tokens": None, "cache_salt": "s", trace: {"span": 1}, "user": "me"}
    with caplog.at_level(logging.WARNING, logger="qmtp.serve"):
        for _ in range(2):
            response = chat(api, temperature=0, **extra)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"] == plain
    logged = [r.getMessage() for r in caplog.records if r.name == "qmtp.serve"]
    assert [m for m in logged if trace in m] == [f"qmtp serve ignores the request field {trace!r} (it changes "
                                                 f"nothing qmtp gives back)"]
    assert not [m for m in logged if "cache_salt" in m or "'user'" in m]  # known to change nothing: not logged
    for field, value in (("truncate_prompt_tokens", 5), ("use_beam_search", True), ("logit_bias", {"5": 1})):
        assert refused(chat(api, **{field: value}), field)["code"] == "unsupported_field"
    response = api.post("/v1/completions", json={"prompt": "Hi", "max_completion_tokens": 3})
    assert "/v1/chat/completions" in refused(response, "max_completion_tokens")["message"]
    refused(chat(api, prompt="Hi"), "prompt")


# ---- 8: loose ends ------------------------------------------------------------------------------------------
def test_empty_stop_strings_are_ignored_alone_or_in_a_list(model, api):
    body = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    plain = api.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert plain == qmtp.generate(model, "Once upon a time", max_tokens=20, n_draft=N_DRAFT, stop_at_eos=False).text
    for stop in ("", [""], ["", ""], []):
        assert api.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]["text"] == plain
    word = plain.split()[2]
    cut = api.post("/v1/completions", json={**body, "stop": ["", word]}).json()["choices"][0]
    assert cut["text"] == plain[:plain.index(word)] and cut["finish_reason"] == "stop"
    refused(api.post("/v1/completions", json={**body, "stop": ["", 5]}), "stop")


def test_a_number_equal_to_an_integer_is_that_integer_in_every_integer_field(api):
    ints = {"n": 1, "max_tokens": 5, "seed": 3, "top_k": 20, "n_draft": 2, "best_of": 1, "min_tokens": 0,
            "top_logprobs": 0, "logprobs": 0}
    floats = {k: float(v) for k, v in ints.items()}
    body = {"prompt": "The little fox", "temperature": 0.9}
    got = [api.post("/v1/completions", json={**body, **fields}) for fields in (ints, floats)]
    assert [r.status_code for r in got] == [200, 200], got[1].text
    assert got[0].json()["choices"] == got[1].json()["choices"]
    assert got[1].json()["usage"]["completion_tokens"] == 5
    tokens = api.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
    as_floats = api.post("/v1/completions", json={"prompt": [5.0, 6.0, 7.0], "max_tokens": 4.0, "temperature": 0})
    assert tokens.json()["choices"] == as_floats.json()["choices"]
    refused(chat(api, max_completion_tokens=2.5), "max_completion_tokens")


def test_a_model_by_id_is_the_models_entry_and_another_id_a_404_in_the_error_shape(model, api):
    entry = api.get("/v1/models/tiny")
    assert entry.status_code == 200 and entry.json() == api.get("/v1/models").json()["data"][0]
    assert entry.json()["object"] == "model" and entry.json()["id"] == "tiny"
    for name in ("gpt-4", "Qwen/Qwen3.6-35B-A3B"):
        missing = api.get(f"/v1/models/{name}")
        error = missing.json()["error"]
        assert missing.status_code == 404 and set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "model_not_found" and name in error["message"]
    with TestClient(build(model, n_draft=N_DRAFT, api_key="secret"), raise_server_exceptions=False) as keyed:
        assert keyed.get("/v1/models/tiny").status_code == 401
        assert keyed.get("/v1/models/tiny", headers={"Authorization": "Bearer secret"}).status_code == 200


WEATHER = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": [1, 2]})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_an_assistant_tool_call_in_the_openai_form_is_rendered_by_the_template(model, api):
    parsed = [dict(m) for m in WEATHER]
    parsed[1] = {**WEATHER[1], "tool_calls": [{**WEATHER[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]}
    text = model.tokenizer.apply_chat_template(parsed)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n[1, 2]" in text
    wanted = qmtp.generate(model, messages=parsed, max_tokens=12, n_draft=N_DRAFT)
    response = api.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(model.tokenizer.encode(text))
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] + message["content"] == wanted.text.replace("</think>", "", 1)
    call = WEATHER[1]["tool_calls"][0]
    for arguments, why in (("{not json", "is not JSON"), ("[1, 2]", "JSON object")):
        broken = [WEATHER[0], {**WEATHER[1], "tool_calls": [{**call, "function": {**call["function"],
                                                                                  "arguments": arguments}}]}]
        error = refused(api.post("/v1/chat/completions", json={"messages": broken, "max_tokens": 3}),
                        "messages[1].tool_calls[0].function.arguments")
        assert why in error["message"]
    nameless = [WEATHER[0], {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}]
    refused(api.post("/v1/chat/completions", json={"messages": nameless, "max_tokens": 3}),
            "messages[1].tool_calls[0]")
