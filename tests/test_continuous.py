"""The continuous batch: requests join at step boundaries and leave when done, each row its own run; cancel,
streaming, the engine thread, chunked prefill, and a shared prefix cache whose memory stays flat."""

import threading

import mlx.core as mx
import numpy as np
import pytest

import qmtp
from qmtp import ContinuousBatch, Settings
from qmtp import chat, continuous
from qmtp.errors import UsageError
from test_speculative import model, small_vocab_model  # noqa: F401 (fixtures)


def alone(model, prompt, settings):
    return qmtp.decode(model, prompt, settings).tokens


def test_requests_join_while_others_run_and_equal_their_own_runs(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 11, 1, 7, 5)]
    settings = [Settings.of(max_tokens=m, n_draft=n) for m, n in ((12, 1), (9, 3), (14, "auto"), (6, 5), (10, 2))]
    batch = ContinuousBatch(model, max_batch=3)
    requests = [batch.submit(p, s) for p, s in zip(prompts[:2], settings[:2])]
    for _ in range(3):
        batch.step()
    requests += [batch.submit(p, s) for p, s in zip(prompts[2:], settings[2:])]
    assert batch.waiting >= 2
    while batch.step():
        assert batch.active <= 3
    for request, prompt, s in zip(requests, prompts, settings):
        assert request.done.is_set() and request.finish_reason == "length"
        assert request.tokens == alone(model, prompt, s)
        assert request.generation().tokens == request.tokens
    assert batch.counters["max_rows_in_a_step"] == 3


def test_requests_wait_only_for_rows_that_are_taken(model):
    batch = ContinuousBatch(model, max_batch=2)
    requests = [batch.submit([5, 6, 7], Settings.of(max_tokens=40)) for _ in range(3)]
    assert (batch.active, batch.waiting) == (0, 1)  # queued, not yet admitted: two of them have rows to go to
    batch.step()
    assert (batch.active, batch.waiting) == (2, 1)
    requests[0].cancel()
    batch.step()
    assert (batch.active, batch.waiting) == (2, 0)
    while batch.step():
        pass
    assert (batch.active, batch.waiting) == (0, 0)


def test_cancel_streaming_and_the_engine_thread(model):
    batch = ContinuousBatch(model, max_batch=4)
    stop = threading.Event()
    engine = threading.Thread(target=batch.run, args=(stop,))
    engine.start()
    try:
        streamed = []
        kept = batch.submit([4, 5, 6], Settings.of(max_tokens=20, n_draft=3), on_tokens=streamed.extend)
        cancelled = batch.submit([7, 8], Settings.of(max_tokens=4000))
        cancelled.cancel()
        assert kept.done.wait(60) and cancelled.done.wait(60)
    finally:
        stop.set()
        engine.join(60)
    assert cancelled.finish_reason == "cancelled"
    assert streamed == kept.tokens == alone(model, [4, 5, 6], Settings.of(max_tokens=20))


def test_a_long_prompt_joins_in_chunks_without_changing_any_row(model, monkeypatch):
    monkeypatch.setattr(continuous, "PREFILL_CHUNK", 8)
    rng = np.random.default_rng(2)
    long_prompt, short = rng.integers(0, 97, 100).tolist(), [9, 8, 7]
    batch = ContinuousBatch(model, join="chunks")
    first = batch.submit(short, Settings.of(max_tokens=30, n_draft=2))
    batch.step()
    joining = batch.submit(long_prompt, Settings.of(max_tokens=8, n_draft=3))
    chunks = batch.counters["prefill_chunks"]
    while batch.step():
        pass
    assert batch.counters["prefill_chunks"] - chunks >= 100 // continuous.MAX_CHUNK + 2  # it took several steps
    assert first.tokens == alone(model, short, Settings.of(max_tokens=30))
    assert joining.tokens == alone(model, long_prompt, Settings.of(max_tokens=8))


@pytest.mark.parametrize("n_draft", [1, 3])
def test_a_next_turn_resumes_from_the_shared_prefix_cache(model, n_draft):
    batch = ContinuousBatch(model, cache_entries=2)
    settings = Settings.of(max_tokens=10, n_draft=n_draft)
    turn = batch.submit([3, 1, 4, 1, 5], settings)
    while batch.step():
        pass
    follow_up = [3, 1, 4, 1, 5] + turn.tokens + [9, 2, 6]
    nxt = batch.submit(follow_up, settings)
    while batch.step():
        pass
    assert nxt.cached_tokens == 5 + len(turn.tokens) - 1
    assert nxt.stats.prefilled_tokens == len(follow_up) - nxt.cached_tokens
    assert nxt.tokens == alone(model, follow_up, Settings.of(max_tokens=10))


@pytest.mark.parametrize("n_draft", [1, 3])
def test_a_chats_next_turn_resumes_from_where_its_last_turn_started(n_draft):
    """With thinking on, Qwen's template renders the reply without its thinking in the next turn's history,
    so the finished row's ids are no prefix of it: the state held at the generation prompt's start is."""
    bundled = qmtp.load()
    tokenizer = bundled.tokenizer
    batch = ContinuousBatch(bundled, cache_entries=4)
    settings = Settings.of(max_tokens=12, n_draft=n_draft)
    messages = [{"role": "user", "content": "Tell me about the cat."}]
    first_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, enable_thinking=True))
    turn = chat.generation_prompt_start(tokenizer, messages, first_prompt, enable_thinking=True)
    first = batch.submit(first_prompt, settings, marks=(turn,))
    while batch.step():
        pass
    history = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the dog?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(history, enable_thinking=True))
    assert 0 < turn < len(first_prompt)
    assert prompt[:turn] == first_prompt[:turn] and prompt[:len(first_prompt)] != first_prompt
    nxt = batch.submit(prompt, settings)
    while batch.step():
        pass
    assert nxt.cached_tokens == turn
    assert nxt.tokens == alone(bundled, prompt, Settings.of(max_tokens=12))


def test_the_prefix_cache_is_bounded_and_memory_stays_flat(small_vocab_model):
    rng = np.random.default_rng(3)
    batch = ContinuousBatch(small_vocab_model, max_batch=4, cache_entries=4)
    settings = Settings.of(max_tokens=4, n_draft=2, stop_at_eos=False)
    memory = []
    for i in range(200):
        batch.submit(rng.integers(0, 4, rng.integers(1, 20)).tolist(), settings)
        if i % 4 == 3:
            while batch.step():
                pass
            mx.clear_cache()
            memory.append(mx.get_active_memory())
        assert len(batch._cache) <= 4
    assert max(memory[-10:]) <= 1.1 * max(memory[5:15]) + 1e6


def test_submit_refuses_bad_requests_at_once(model):
    batch = ContinuousBatch(model)
    with pytest.raises(UsageError, match="the prompt is empty"):
        batch.submit([], Settings.of())
    with pytest.raises(UsageError, match="settings: give a qmtp.Settings"):
        batch.submit([1], {"max_tokens": 3})
    with pytest.raises(UsageError, match="prompt token id 500 is outside the vocabulary"):
        batch.submit([1, 500], Settings.of())
    assert batch.waiting == 0


def test_chunk_sizes_never_leap_past_what_was_timed():
    """Noisy times of one-token chunks (a few of two) can fit a slope below zero: the chunk proposed must not
    jump to the largest size (once seen: a 1,024-token chunk stalling the rows 100-fold)."""
    costs = continuous.ChunkCosts()
    for tokens, seconds in [(1, 0.030), (1, 0.012), (2, 0.010), (1, 0.025), (2, 0.011), (1, 0.028)]:
        costs.observe(tokens, seconds)
    assert all(1 <= (costs.tokens_within(0.02) or 0) <= 4 for _ in range(4))
    costs = continuous.ChunkCosts()
    for tokens in (8, 16, 8, 16):
        costs.observe(tokens, 0.001 + 0.0005 * tokens)
    assert costs.tokens_within(1.0) == 32  # a fit that would allow 2,000 grows by doubling
    assert costs.smallest() == (8, 0.005)


@pytest.mark.parametrize("n_draft", [1, 3, "auto"])
def test_buffers_grow_as_rows_decode_and_every_row_stays_its_own_run(model, n_draft):
    """The KV buffers start at the prompt's size and double as rows decode past them (attention reads its whole
    buffer, so buffers sized for max_tokens up front cost every step from the first); the tokens are those of
    each row's own run, whose buffers were sized for max_tokens at once."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 40)]
    settings = [Settings.of(max_tokens=m, n_draft=n_draft, stop_at_eos=False) for m in (150, 60)]
    batch = ContinuousBatch(model, max_batch=2)
    requests = [batch.submit(p, s) for p, s in zip(prompts, settings)]
    capacities = []
    while batch.step():
        capacities.append(batch._capacity)
    first = next(c for c in capacities if c)
    assert first < continuous.decoding.capacity_for(40 + 60) and max(capacities) >= 5 + 150
    for request, prompt, s in zip(requests, prompts, settings):
        assert request.tokens == alone(model, prompt, s)


def _join_as_row(model, running, joining, join="rows", max_batch=4, cache_entries=16):
    """Rows `running` (prompt, settings) decode a few steps, then `joining` prompts join as rows of their pass."""
    batch = ContinuousBatch(model, max_batch=max_batch, join=join, cache_entries=cache_entries)
    rows = [batch.submit(p, s) for p, s in running]
    for _ in range(2):
        batch.step()
    joined = [batch.submit(row[0], row[1], marks=row[2] if len(row) > 2 else ()) for row in joining]
    while batch.step():
        pass
    return batch, rows, joined


@pytest.mark.parametrize("n_draft", [1, 3, "auto"])
def test_a_prompt_read_as_a_row_of_the_rows_pass_changes_no_row(model, n_draft):
    """A joining prompt reads its tokens as a row of the running rows' pass (its drafts replaced by the prompt's
    next tokens, all kept, the last piece shorter than the width): every row, and the joining one, equal their
    own runs."""
    rng = np.random.default_rng(11)
    running = [(rng.integers(0, 97, n).tolist(), Settings.of(max_tokens=80, n_draft=d, stop_at_eos=False))
               for n, d in ((4, n_draft), (9, 2))]
    joining = [(rng.integers(0, 97, n).tolist(), Settings.of(max_tokens=12, n_draft=d))
               for n, d in ((61, n_draft), (30, 1))]
    batch, rows, joined = _join_as_row(model, running, joining)
    assert batch.counters["prompt_rows_stepped"] >= 2 * 8  # both read most of their prompts in the rows' pass
    for request, (prompt, settings) in zip(rows + joined, running + joining):
        assert request.finish_reason in ("length", "end") and request.tokens == alone(model, prompt, settings)


@pytest.mark.parametrize("acceptance", ["coupled", "rejection"])
def test_a_seeded_prompt_read_as_a_row_is_its_own_seeded_run(small_vocab_model, acceptance):
    """Its first token is picked from its last position's logits with its seed's key, as its own prefill
    picks it, and its key goes on as its own run's: the same tokens whatever else is in the batch."""
    engine = qmtp.Engine(acceptance=acceptance)
    rng = np.random.default_rng(12)
    prompt = rng.integers(0, 4, 37).tolist()
    settings = Settings.of(max_tokens=15, n_draft=3, temperature=1.3, seed=21)
    batch = ContinuousBatch(small_vocab_model, max_batch=3, engine=engine, join="rows")
    other = batch.submit([1, 2, 3], Settings.of(max_tokens=60, n_draft=2, temperature=0.9, seed=4,
                                                stop_at_eos=False))
    batch.step(), batch.step()
    joined = batch.submit(prompt, settings)
    while batch.step():
        pass
    assert batch.counters["prompt_rows_stepped"] > 0
    assert joined.tokens == qmtp.decode(small_vocab_model, prompt, settings, engine).tokens
    assert other.tokens == qmtp.decode(small_vocab_model, [1, 2, 3], other.settings, engine).tokens


def test_a_prompt_row_goes_back_to_chunks_when_no_row_decodes(model):
    """The only decoding row finishes while a long prompt is still being read in its pass: nobody waits any
    more, so the rest is read in chunks of its own (from the row's state), and it is still its own run."""
    rng = np.random.default_rng(13)
    running = [([5, 6], Settings.of(max_tokens=6, n_draft=2, stop_at_eos=False))]
    joining = [(rng.integers(0, 97, 300).tolist(), Settings.of(max_tokens=10, n_draft=3))]
    batch, rows, joined = _join_as_row(model, running, joining)
    assert 0 < batch.counters["prompt_rows_stepped"] < 300 // 4
    for request, (prompt, settings) in zip(rows + joined, running + joining):
        assert request.tokens == alone(model, prompt, settings)


@pytest.mark.parametrize("n_draft", [1, 3])
def test_a_chat_read_as_a_row_holds_its_turn_start_for_the_next_turn(n_draft):
    bundled = qmtp.load()
    tokenizer = bundled.tokenizer
    settings = Settings.of(max_tokens=12, n_draft=n_draft)
    messages = [{"role": "user", "content": "Tell me about the cat and the dog and the bird."}]
    first_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, enable_thinking=True))
    busy = ([7, 8, 9], Settings.of(max_tokens=400, n_draft=n_draft, stop_at_eos=False))
    turn = chat.generation_prompt_start(tokenizer, messages, first_prompt, enable_thinking=True)
    batch, _, (first,) = _join_as_row(bundled, [busy], [(first_prompt, settings, (turn,))], cache_entries=4)
    assert batch.counters["prompt_rows_stepped"] > 0
    history = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(history, enable_thinking=True))
    nxt = batch.submit(prompt, settings)
    while batch.step():
        pass
    assert nxt.cached_tokens == turn
    assert first.tokens == alone(bundled, first_prompt, settings)
    assert nxt.tokens == alone(bundled, prompt, Settings.of(max_tokens=12))


def test_the_join_mode_is_checked(model):
    with pytest.raises(UsageError, match="join='row'"):
        ContinuousBatch(model, join="row")


def test_a_request_calls_back_once_it_has_ended_after_its_last_tokens(small_vocab_model):
    """The server waits on this callback instead of polling every row's `done`."""
    batch = ContinuousBatch(small_vocab_model, max_batch=2)
    events = {0: [], 1: []}
    rows = [batch.submit([1, 2, 3], Settings.of(max_tokens=n, n_draft=3), on_tokens=events[i].append,
                         on_done=lambda i=i: events[i].append("done")) for i, n in enumerate((5, 12))]
    while batch.step():
        pass
    for i, row in enumerate(rows):
        assert events[i][-1] == "done" and events[i].count("done") == 1
        assert sum(events[i][:-1], []) == row.tokens
    with pytest.raises(UsageError, match="on_done"):
        batch.submit([1], Settings.of(), on_done=3)
