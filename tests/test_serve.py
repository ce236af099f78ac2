"""`qmtp serve` as its users run it: the official `openai` client against a server on a free local port.

The server runs in this process (uvicorn in a thread) over the bundled tiny model; every answer at temperature
0 (or with a seed) is compared with `qmtp.generate` over the same messages or prompt and the same settings
(the server's sampler is vLLM's defaults, `protocol.defaults`, with the request's fields over it: temperature,
top_p, top_k, min_p and repetition_penalty from generation_config.json, the penalties the API's 0).
"""

import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

import qmtp  # noqa: E402
from qmtp.errors import NonFiniteLogitsError  # noqa: E402
from qmtp import continuous  # noqa: E402
from qmtp.serve import protocol  # noqa: E402
from qmtp.serve.main import build, engine_class, parser  # noqa: E402

N_DRAFT = 3
HELLO = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def model():
    return qmtp.load()


@contextlib.contextmanager
def running(app):
    """The app on a free port of 127.0.0.1, in a thread; its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def url(model):
    with running(build(model, n_draft=N_DRAFT, max_queue=64)) as base:
        yield base


def client(base: str, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=60, max_retries=0)


def expected(model, **kwargs):
    """What `generate` gives with the server's settings (its sampler: `protocol.defaults`)."""
    kwargs.setdefault("temperature", 0)
    return qmtp.generate(model, sampling=protocol.defaults(model), n_draft=N_DRAFT, **kwargs)


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=10).json()


def wait_idle(base: str, seconds: float = 15) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        state = health(base)
        if state["active"] == 0 and state["waiting"] == 0:
            return state
        assert time.monotonic() < deadline, f"rows still held: {state}"
        time.sleep(0.05)


def joined_stream(stream, kind: str = "chat"):
    """(reasoning, content, finish_reason, usage) of a streamed response."""
    reasoning, content, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if kind == "chat":
                reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
                content.append(choice.delta.content or "")
            else:
                content.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(reasoning), "".join(content), finish, usage


# ---- what comes back equals generate ------------------------------------------------------------------------
def test_chat_whole_and_streamed_equal_generate_with_thinking_apart(model, url):
    g = expected(model, messages=HELLO, max_tokens=40)
    assert "</think>" in g.text  # the template opens thinking and the reply closes it within 40 tokens
    thought, answer = g.text.split("</think>", 1)
    api = client(url)
    whole = api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, temperature=0)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(g.prompt_tokens), len(g.tokens))
    stream = api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    reasoning, content, finish, usage = joined_stream(stream)
    assert reasoning + "</think>" + content == g.text and (reasoning, content) == (thought, answer)
    assert finish == "length" and usage.completion_tokens == len(g.tokens)
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_without_thinking_and_with_a_stop_string_equals_generate(model, url):
    stop = ["sea", "e s"]
    g = expected(model, messages=HELLO, max_tokens=60, enable_thinking=False, stop=stop, seed=5)
    api = client(url)
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=60, temperature=0, stop=stop, seed=5,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = api.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == g.text
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None
    assert whole.choices[0].finish_reason == ("length" if g.finish_reason == "length" else "stop")
    reasoning, content, finish, _ = joined_stream(api.chat.completions.create(stream=True, **kwargs))
    assert (reasoning, content) == ("", g.text) and finish == whole.choices[0].finish_reason


def test_completions_whole_and_streamed_equal_generate(model, url):
    prompt = "Once upon a time"
    g = expected(model, prompt=prompt, max_tokens=50, stop_at_eos=False)
    api = client(url)
    whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=50, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text == g.text and whole.usage.completion_tokens == 50
    _, content, finish, usage = joined_stream(api.completions.create(
        model="tiny", prompt=prompt, max_tokens=50, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}), kind="completion")
    assert content == g.text and finish == "length" and usage.completion_tokens == 50


def test_a_sampled_request_with_a_seed_and_the_extra_fields_equals_generate(model, url):
    fields = dict(temperature=0.9, top_p=0.9, seed=11, presence_penalty=0.5)
    extra = dict(top_k=30, min_p=0.05, repetition_penalty=1.1, n_draft=2)
    g = qmtp.generate(model, "The little fox", max_tokens=30, sampling=protocol.defaults(model), **fields, **extra)
    whole = client(url).completions.create(model="tiny", prompt="The little fox", max_tokens=30, extra_body=extra,
                                           **fields)
    assert whole.choices[0].text == g.text


def test_a_conversations_next_turn_reuses_the_cached_prefix(url):
    api = client(url)
    kwargs = dict(model="tiny", max_tokens=20, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    first = api.chat.completions.create(messages=HELLO, **kwargs)
    history = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And the sky?"}]
    second = api.chat.completions.create(messages=history, **kwargs)
    # the template renders the reply as history otherwise than as generated: the shared part is the first
    # turn's prompt up to its generation prompt at least
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 2 <= cached < second.usage.prompt_tokens


# ---- concurrency and clients that leave ---------------------------------------------------------------------
def test_sixteen_concurrent_streams_all_get_their_text(model, url):
    prompts = [f"{start} {thing}" for start in ("Once upon a time", "The old dog") for thing in
               ("a cat", "the moon", "a boat", "rain")]
    wanted = {p: expected(model, prompt=p, max_tokens=24).text for p in prompts}
    api = client(url)

    def one(prompt):
        stream = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return joined_stream(stream, kind="completion")[1]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts * 2))
    assert got == [wanted[p] for p in prompts * 2]
    wait_idle(url)


def test_a_dropped_stream_frees_its_row_and_the_server_goes_on(url):
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        assert health(url)["active"] == 1
    wait_idle(url)  # long before 3000 tokens: the row left at its next step
    assert client(url).completions.create(model="tiny", prompt="Hi", max_tokens=5).choices[0].text
    with pytest.raises(httpx.ReadTimeout):  # a whole response the client stops waiting for
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(10, read=1))
    wait_idle(url)


# ---- hostile and unlucky clients ----------------------------------------------------------------------------
BAD_CHAT = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 2}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ["", 5]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"n_draft": 99}, "n_draft"),
    ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    ({"prompt": "Hi"}, "prompt"),
    ({"messages": HELLO + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": "no question"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
]


@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_an_invalid_field_is_a_400_naming_it(url, change, param):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 5, **change}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_a_prompt_longer_than_the_context_names_both_lengths(model, url):
    ids = [5] * (model.config.max_position_embeddings + 10)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 5}, timeout=30)
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and str(len(ids)) in message
    assert str(model.config.max_position_embeddings) in message


def test_bodies_that_are_not_requests_are_400s_and_the_client_raises(url):
    for raw in (b"not json", b"[1, 2]", b'"text"', b"\xff\xfe", b"[" * 100_000, b'{"prompt": NaN}'):
        response = httpx.post(f"{url}/v1/completions", content=raw, timeout=10)
        assert response.status_code == 400 and "error" in response.json()
    for prompt in (["a", "b"], [], 3, [[1, 2], [3]]):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt}, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        client(url).chat.completions.create(model="tiny", messages=HELLO, logit_bias={"1": 5})
    assert httpx.get(f"{url}/v1/nowhere", timeout=10).status_code == 404
    assert httpx.get(f"{url}/v1/chat/completions", timeout=10).status_code == 405


def test_models_names_the_model_and_another_name_is_refused(url):
    api = client(url)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="Hi", max_tokens=3)


def test_a_chat_request_to_a_model_without_a_template_is_a_400(model, url, monkeypatch):
    monkeypatch.setattr(model.tokenizer, "chat_template", None)
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO}, timeout=10)
    assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]


def test_a_broken_template_or_nonfinite_logits_fail_that_request_only(model, url, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(model.tokenizer, "chat_template", "{% if %}")
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO}, timeout=10)
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    real = continuous._prefill_row
    tripping_ids = model.tokenizer.encode("NaN please")

    def tripping(model, head, tokens, *args):  # the prompt's logits come out non-finite, as damaged weights give
        state, h_last, first, finite = yield from real(model, head, tokens, *args)
        return state, h_last, first, finite and tokens[-len(tripping_ids):] != tripping_ids

    monkeypatch.setattr(continuous, "_prefill_row", tripping)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "NaN please", "max_tokens": 5}, timeout=10)
    assert response.status_code == 500 and "NaN or Inf logits" in response.json()["error"]["message"]
    body = {"prompt": "NaN please", "max_tokens": 5, "stream": True}
    events = httpx.post(f"{url}/v1/completions", json=body, timeout=10).text
    assert '"error"' in events and events.rstrip().endswith("data: [DONE]")
    assert client(url).completions.create(model="tiny", prompt="Hi", max_tokens=5).choices[0].text


def test_the_api_key_and_a_full_queue(model, monkeypatch):
    real_step = continuous.ContinuousBatch._decode_step

    def slow_step(self):  # the long rows must outlast the checks below, however fast or loaded the machine
        time.sleep(0.02)
        return real_step(self)

    monkeypatch.setattr(continuous.ContinuousBatch, "_decode_step", slow_step)
    with running(build(model, n_draft=N_DRAFT, max_batch=1, max_queue=1, api_key="secret")) as base:
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").models.list()
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "Hi"}).status_code == 401
        assert health(base)["status"] == "ok"  # /health needs no key
        api = client(base, "secret")
        assert api.models.list().data[0].id == "tiny"
        long = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        headers = {"Authorization": "Bearer secret"}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, headers=headers, timeout=30), \
                httpx.stream("POST", f"{base}/v1/completions", json=long, headers=headers, timeout=30):
            state, deadline = health(base), time.monotonic() + 10
            while state["active"] == 0 and time.monotonic() < deadline:  # the first row may still be joining
                time.sleep(0.02)
                state = health(base)
            assert (state["active"], state["waiting"]) == (1, 1)
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError):
                api.completions.create(model="tiny", prompt="Hi", max_tokens=3)
            assert time.monotonic() - started < 2
        wait_idle(base)


def test_a_burst_is_refused_only_once_every_row_is_taken_and_the_queue_is_full(model, monkeypatch):
    real_step = continuous.ContinuousBatch._decode_step

    def slow_step(self):
        time.sleep(0.02)
        return real_step(self)

    monkeypatch.setattr(continuous.ContinuousBatch, "_decode_step", slow_step)
    long = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with running(build(model, n_draft=N_DRAFT, max_batch=2, max_queue=1)) as base:
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=30) as first, \
                httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=30) as second, \
                httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=30) as third:
            assert [r.status_code for r in (first, second, third)] == [200, 200, 200]  # two rows, one waits
            deadline = time.monotonic() + 10
            state = health(base)
            while state["active"] < 2 and time.monotonic() < deadline:  # until the engine has admitted the second
                time.sleep(0.01)
                state = health(base)
            assert state["active"] == 2 and state["waiting"] == 1
            refused = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert refused.status_code == 429 and "every row is taken" in refused.json()["error"]["message"]
        wait_idle(base)


def test_four_requests_sent_at_once_share_decoding_steps(model, url):
    before = health(url)["counters"]
    api = client(url)

    def one(prompt):
        return api.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0).choices[0].text

    prompts = ["Once upon a time", "The old dog", "In a small town", "The moon was"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, prompts))
    assert got == [expected(model, prompt=p, max_tokens=32).text for p in prompts]
    after = health(url)["counters"]
    assert after["max_rows_in_a_step"] >= 2
    assert after["steps"] - before["steps"] < after["rows_stepped"] - before["rows_stepped"]


class _DeadEngine:
    active = waiting = 0
    counters = {}

    def run(self, stop):
        raise RuntimeError("the engine fell over")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_that_stopped_is_a_503_not_a_hang(model):
    with running(protocol_app(model, _DeadEngine())) as base:
        time.sleep(0.1)
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503
        response = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_stopped"


def protocol_app(model, engine):
    return build(model, n_draft=N_DRAFT, engine=engine)


# ---- the parts, without a server ----------------------------------------------------------------------------
def test_max_tokens_left_out_is_the_rest_of_the_context(model):
    served = protocol.Served(model, "tiny", N_DRAFT)
    parsed = protocol.parse_completion({"prompt": [5] * 100}, served)
    assert parsed.settings.max_tokens == model.config.max_position_embeddings - 100 - (N_DRAFT - 1)
    assert parsed.settings.sampler(model) == protocol.defaults(model) != qmtp.Sampling.of_model(model)
    assert parsed.settings.sampler(model).presence_penalty == 0 < qmtp.Sampling.of_model(model).presence_penalty
    parsed = protocol.parse_chat({"messages": HELLO, "temperature": 0, "user": "me", "max_completion_tokens": 7},
                                 served)
    assert parsed.settings.max_tokens == 7 and parsed.settings.sampler(model).temperature == 0



def test_the_engine_cancels_a_queued_row_and_refuses_what_decode_would(model):
    engine = engine_class()(model)
    settings = qmtp.Settings.of(max_tokens=5)
    with pytest.raises(qmtp.UsageError, match="longer than the context"):
        engine.submit([5] * 5000, settings)
    row = engine.submit([5, 6, 7], settings)
    row.cancel()
    assert not engine.step() and row.finish_reason == "cancelled" and row.done.is_set()
    row = engine.submit(model.tokenizer.encode("Hello"), settings)
    while engine.step():
        pass
    assert row.generation().tokens == qmtp.generate(model, "Hello", max_tokens=5).tokens


def test_the_load_bench_runs_and_prints_its_table():
    from qmtp.book import bench_serve

    report = bench_serve.run(clients=(1, 2), max_tokens=6, n_drafts=(1, 2), mlx_lm=False, repeats=2)
    assert [s["server"] for s in report["servers"]] == ["qmtp serve, n_draft 1", "qmtp serve, n_draft 2"]
    for server in report["servers"]:
        rounds = server["rounds"]
        assert [r["clients"] for r in rounds] == [1, 2] and all(r["tokens_per_request"] == 6 for r in rounds)
        assert all(r["ttft_p50"] > 0 and r["aggregate"] > 0 for r in rounds)
    assert "qmtp serve, n_draft 2" in bench_serve.table(report) and "median of 2 rounds" in bench_serve.table(report)
    with pytest.raises(qmtp.UsageError, match="repeats"):
        bench_serve.run(clients=(1,), repeats=0)


def test_a_served_cell_is_the_median_of_its_repeats():
    from qmtp.book import bench_serve

    rounds = [{"clients": 4, "aggregate": a, "ttft_p50": t} for a, t in ((300.0, 0.2), (100.0, 0.1), (200.0, 0.3))]
    assert bench_serve._median_round(rounds) == {"clients": 4, "aggregate": 200.0, "ttft_p50": 0.2}


def test_importing_qmtp_loads_no_web_stack():
    code = ("import sys, qmtp; print(' '.join(m for m in sys.modules if m.split('.')[0] in "
            "('starlette', 'uvicorn', 'sse_starlette', 'openai', 'httpx') or m.startswith('qmtp.serve')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_the_command_binds_this_machine_only_by_default_and_serves():
    assert parser().parse_args([]).host == "127.0.0.1"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "qmtp.serve", "--port", str(port), "--log-level", "warning"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 40
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"] == "ok"
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
                time.sleep(0.2)
        reply = client(f"http://127.0.0.1:{port}").completions.create(model="tiny", prompt="Hi", max_tokens=3)
        assert json.loads(reply.model_dump_json())["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.wait(20)
