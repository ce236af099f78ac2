"""Batched decoding is exact per row: a greedy row is its own `generate` run token for token, a sampled row keeps
the trunk's law with its own seed, and bad input is refused naming the row before any work."""

import mlx.core as mx
import numpy as np
import pytest

from conftest import small_config
import qmtp
from qmtp import Sampling
from qmtp.errors import UsageError
from test_speculative import chi_square_p_value, model, small_vocab_model  # noqa: F401 (fixtures)
from test_sampling import rejects, sequence_law

PROMPTS = [[0], [1, 2], [3, 0, 1, 2, 3], [2, 2, 2, 1], [1, 3, 0, 0, 2, 1, 3, 3, 0]]


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4, 5, "auto"])
def test_greedy_rows_equal_their_own_runs(small_vocab_model, n_draft):
    batch = qmtp.generate_batch(small_vocab_model, PROMPTS, max_tokens=24, n_draft=n_draft)
    partial = 0
    for prompt, row in zip(PROMPTS, batch):
        assert row.tokens == qmtp.generate(small_vocab_model, prompt, max_tokens=24).tokens
        assert row.stats.generated == len(row.tokens) == 24
        partial += sum(0 < s.accepted < len(s.drafts) for s in row.stats.steps)
    if n_draft in (3, 4, 5):
        assert partial > 0, "no row ever kept part of its drafts"


def test_greedy_rows_on_a_wider_vocabulary_with_per_row_settings(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, rng.integers(1, 12)).tolist() for _ in range(4)]
    widths, lengths = [1, 2, 5, "auto"], [16, 5, 12, 9]
    batch = qmtp.generate_batch(model, prompts, max_tokens=lengths, n_draft=widths)
    for prompt, row, n, length in zip(prompts, batch, widths, lengths):
        assert row.tokens == qmtp.generate(model, prompt, max_tokens=length).tokens
        assert row.stats.n_draft == n
        assert all(len(s.drafts) <= (4 if n == "auto" else n - 1) for s in row.stats.steps)


def test_a_finished_row_leaves_the_batch(small_vocab_model):
    batch = qmtp.generate_batch(small_vocab_model, PROMPTS[:4], max_tokens=[2, 2, 2, 30])
    totals = batch.totals
    # after the three short rows end, the long one steps alone
    assert totals["rows_stepped"] <= 3 * 2 + totals["steps"]
    assert totals["tokens"] == 36


def test_sampled_rows_are_their_own_seeded_runs(small_vocab_model):
    """Each row draws with its own key, split as a single run splits it: at a fixed width the row's tokens are
    its own run's with that seed, whatever else is in the batch."""
    seeds = [3, 7, 11, 19]
    batch = qmtp.generate_batch(small_vocab_model, PROMPTS[:4], max_tokens=12, n_draft=3, temperature=1.5,
                                seed=seeds)
    for prompt, row, seed in zip(PROMPTS, batch, seeds):
        alone = qmtp.generate(small_vocab_model, prompt, max_tokens=12, n_draft=3, temperature=1.5, seed=seed)
        assert row.tokens == alone.tokens


def test_top_k_1_rows_are_greedy(model):
    prompts = [[5, 6, 7], [1], [40, 41, 42, 43, 44, 45]]
    batch = qmtp.generate_batch(model, prompts, max_tokens=10, n_draft=3, temperature=1.0, top_k=1, seed=[1, 2, 3])
    for prompt, row in zip(prompts, batch):
        assert row.tokens == qmtp.generate(model, prompt, max_tokens=10).tokens


PENALTIES = [{"presence_penalty": 1.5}, {"frequency_penalty": 0.7}, {"repetition_penalty": 1.3},
             {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}]


@pytest.mark.parametrize("penalty, n_draft", list(zip(PENALTIES, [3, 1, "auto", 5])), ids=lambda p: "+".join(p)
                         if isinstance(p, dict) else str(p))
def test_penalised_rows_beside_plain_ones_equal_their_own_runs(model, penalty, n_draft):
    """Each row counts its own generated tokens: a penalised greedy row is its own run, beside rows that are
    not penalised (whose history the batch carries unread) and rows with other penalties."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, rng.integers(1, 10)).tolist() for _ in range(4)]
    rows = [Sampling(**penalty), Sampling(), Sampling(presence_penalty=2.0), Sampling(**penalty)]
    batch = qmtp.generate_batch(model, prompts, max_tokens=20, n_draft=n_draft, sampling=rows)
    for prompt, row, sampling in zip(prompts, batch, rows):
        assert row.tokens == qmtp.generate(model, prompt, max_tokens=20, n_draft=n_draft, sampling=sampling).tokens
    plain = qmtp.generate(model, prompts[0], max_tokens=20).tokens
    assert batch[0].tokens != plain, "the penalty changed nothing: the test cannot tell"


def test_sampled_penalised_rows_are_their_own_seeded_runs(small_vocab_model):
    seeds = [3, 7, 11]
    sampling = Sampling(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.3)
    batch = qmtp.generate_batch(small_vocab_model, PROMPTS[:3], max_tokens=12, n_draft=3, sampling=sampling,
                                seed=seeds)
    for prompt, row, seed in zip(PROMPTS, batch, seeds):
        alone = qmtp.generate(small_vocab_model, prompt, max_tokens=12, n_draft=3, sampling=sampling, seed=seed)
        assert row.tokens == alone.tokens


@pytest.mark.slow
def test_a_sampled_row_keeps_the_trunk_law(small_vocab_model):
    """Rows of one prompt with seeds 0..n-1, drafting two tokens a step: the continuations follow the law of
    sampling the trunk alone (and the test can tell it from the law without the filter)."""
    settings, other = Sampling(temperature=2.0, top_k=2), Sampling(temperature=2.0)
    prompt, n = [1, 0, 3], 600
    batch = qmtp.generate_batch(small_vocab_model, [prompt] * n, max_tokens=3, n_draft=3, sampling=settings,
                                seed=list(range(n)), stop_at_eos=False, max_batch=16)
    counts = {}
    for row in batch:
        counts[tuple(row.tokens)] = counts.get(tuple(row.tokens), 0) + 1
    assert chi_square_p_value(counts, sequence_law(small_vocab_model, prompt, settings), n) > 1e-3
    assert rejects(counts, sequence_law(small_vocab_model, prompt, other), n)


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([[1], []], {}, "row 1: the prompt is empty"),
    ([[1], [2]], {"max_tokens": [3, 4, 5]}, "max_tokens: 3 values for 2 prompts"),
    ([[1], [2]], {"n_draft": [2, 9]}, "row 1: n_draft=9 is out of range"),
    ([[1], [2] * 5000], {}, "row 1: prompt of 5000 tokens"),
    ([[1], [2]], {"temperature": [0, -1.0]}, "row 1: temperature=-1.0"),
    ([], {}, "prompts: give a non-empty list"),
])
def test_bad_input_is_refused_naming_the_row(small_vocab_model, prompts, kwargs, message):
    steps = small_vocab_model.__dict__.get("_batch_steps", {}).copy()
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        qmtp.generate_batch(small_vocab_model, prompts, **kwargs)
    assert small_vocab_model.__dict__.get("_batch_steps", {}) == steps  # refused before any work


def test_a_row_with_nonfinite_logits_ends_alone(tmp_path):
    from qmtp.tiny import synthetic

    config = small_config(vocab_size=4)
    broken = qmtp.load(synthetic.write_checkpoint(tmp_path, config, dtype="F32", seed=11))
    table = broken.embed_tokens.weight
    broken.embed_tokens.weight = mx.where(mx.arange(table.shape[0])[:, None] == 3, mx.nan, table)
    prompts = [[0, 1], [1, 3, 2], [2, 1, 0]]
    batch = qmtp.generate_batch(broken, prompts, max_tokens=6, n_draft=[1, 2, 1], stop_at_eos=False)
    assert batch[1].finish_reason == "error" and "NaN or Inf" in str(batch.errors[1])
    for row, error in ((batch[0], batch.errors[0]), (batch[2], batch.errors[2])):
        if error is None:  # a row whose own tokens reach id 3 fails too, at that position
            assert row.tokens == qmtp.generate(broken, prompts[batch.index(row)], max_tokens=6,
                                               stop_at_eos=False).tokens


@pytest.mark.slow
def test_greedy_rows_equal_their_own_runs_on_the_bundled_model():
    bundled = qmtp.load()
    texts = ["The history of the city", "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):", "Water boils at"]
    prompts = [bundled.tokenizer.encode(t) for t in texts]
    own = [qmtp.generate(bundled, p, max_tokens=40).tokens for p in prompts]
    for n_draft in [1, 2, 3, 4, 5, "auto", [1, 3, 5, "auto"]]:
        batch = qmtp.generate_batch(bundled, prompts, max_tokens=40, n_draft=n_draft)
        assert [row.tokens for row in batch] == own, f"n_draft={n_draft}"


def test_generate_batch_takes_generates_penalty_keywords(model):
    """`generate`'s penalty keywords, one value or one per row, give each row its own `generate` run (issue 45
    item 7: they were a TypeError while a `Sampling` with the same penalties worked)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 97, rng.integers(1, 10)).tolist() for _ in range(3)]
    penalties = dict(presence_penalty=[1.5, 0.0, 0.5], frequency_penalty=0.4, repetition_penalty=[1.0, 1.3, 1.1])
    batch = qmtp.generate_batch(model, prompts, max_tokens=16, n_draft=3, **penalties)
    for row, (prompt, presence, repetition) in enumerate(zip(prompts, penalties["presence_penalty"],
                                                              penalties["repetition_penalty"])):
        alone = qmtp.generate(model, prompt, max_tokens=16, n_draft=3, presence_penalty=presence,
                              frequency_penalty=0.4, repetition_penalty=repetition)
        assert batch[row].tokens == alone.tokens, f"row {row}"
    assert batch[0].tokens != qmtp.generate(model, prompts[0], max_tokens=16).tokens, "the penalty changed nothing"


def test_generate_batch_takes_message_lists_and_the_templates_arguments():
    bundled = qmtp.load()
    conversations = [[{"role": "user", "content": "Tell me a story."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
    batch = qmtp.generate_batch(bundled, messages=conversations, max_tokens=12, n_draft=[1, "auto"],
                                enable_thinking=False, chat_template_kwargs=[None, {"preserve_thinking": True}])
    for row, (messages, variables) in enumerate(zip(conversations, [None, {"preserve_thinking": True}])):
        alone = qmtp.generate(bundled, messages=messages, max_tokens=12, enable_thinking=False,
                              chat_template_kwargs=variables)
        assert batch[row].tokens == alone.tokens and batch[row].prompt_tokens == alone.prompt_tokens, f"row {row}"
    with pytest.raises(UsageError, match="prompts or messages"):
        qmtp.generate_batch(bundled, ["a"], messages=conversations)
    with pytest.raises(UsageError, match="message lists"):
        qmtp.generate_batch(bundled, ["Once upon a time"], enable_thinking=False)


def test_an_unknown_keyword_is_a_usage_error_naming_it(small_vocab_model):
    """Python's own TypeError for a keyword the function does not take, found by the argument fuzz
    (tests/test_api_arguments_fuzz.py): now a UsageError naming it and the closest argument (still a TypeError)."""
    from helpers import expect

    expect(UsageError, lambda: qmtp.generate_batch(small_vocab_model, [[1]], max_new_tokens=4), "generate_batch",
           "'max_new_tokens'", "did you mean 'max_tokens'")
    expect(UsageError, lambda: qmtp.generate(small_vocab_model, [1], temprature=0.5), "generate", "'temprature'",
           "did you mean 'temperature'")
    expect(UsageError, lambda: qmtp.generate(small_vocab_model, [1], 4, prompt=[2]), "generate", "'prompt'")
    expect(UsageError, lambda: qmtp.generate(), "generate", "'model'")
    expect(UsageError, lambda: qmtp.generate_batch(small_vocab_model, [[1]], 2, 1, 0.0, 0, "extra"), "positional")
    expect(UsageError, lambda: qmtp.Settings.of(stop_at_end=False), "Settings.of", "did you mean 'stop_at_eos'")
    with pytest.raises(TypeError):  # still the TypeError Python raises for it
        qmtp.generate_batch(small_vocab_model, [[1]], top_a=0.1)


def test_a_rows_bad_template_variables_name_the_row():
    """`chat_template_kwargs={'messages': ...}` collided with apply_chat_template's own argument: a bare
    TypeError, found by the argument fuzz."""
    bundled = qmtp.load()
    conversations = [[{"role": "user", "content": "Hi."}], [{"role": "user", "content": "Hello."}]]
    with pytest.raises(UsageError, match=r"^row 1: chat_template_kwargs: messages cannot be a template variable"):
        qmtp.generate_batch(bundled, messages=conversations, max_tokens=2,
                            chat_template_kwargs=[None, {"messages": []}])
    with pytest.raises(UsageError, match=r"^row 0: chat_template_kwargs: enable_thinking='no'"):
        qmtp.generate_batch(bundled, messages=conversations, max_tokens=2,
                            chat_template_kwargs={"enable_thinking": "no"})
    with pytest.raises(UsageError, match=r"^chat_template_kwargs: messages cannot"):
        qmtp.generate(bundled, messages=conversations[0], max_tokens=2, chat_template_kwargs={"messages": []})


def test_max_batch_is_a_count_of_rows_or_none(small_vocab_model):
    """0 and False were taken as "every row at once" (`max_batch or rows`), and a numpy integer was refused
    though every other count takes one."""
    from helpers import expect

    for bad in (0, False, -1, 1.5, "2"):
        expect(UsageError, lambda: qmtp.generate_batch(small_vocab_model, [[1], [2]], max_tokens=2, max_batch=bad),
               "max_batch")
    alone = [qmtp.generate(small_vocab_model, p, max_tokens=3).tokens for p in ([1], [2], [3])]
    for fine in (None, 1, np.int64(2), 5):
        batch = qmtp.generate_batch(small_vocab_model, [[1], [2], [3]], max_tokens=3, max_batch=fine)
        assert [row.tokens for row in batch] == alone, fine
