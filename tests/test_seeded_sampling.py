"""A seed decides the sampled tokens: with coupled acceptance (the default) each position's randomness is made from
the seed and the position alone, shared by the draft and the trunk, so the tokens are the same at every width,
"auto" included (whose widths follow the clock), run after run; the law stays the trunk's (`test_sampling.py`'s
chi-square tests cover both acceptances)."""

import mlx.core as mx
import pytest

import qmtp
from qmtp import Sampling, acceptance
from qmtp.errors import UsageError

from test_chat import model_dir
from test_speculative import PROMPTS, CyclingPlanner, model, small_vocab_model  # noqa: F401 (fixtures)

SETTINGS = {
    "temperature": dict(temperature=0.8),
    "filters and penalties": dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, presence_penalty=1.5,
                                  repetition_penalty=1.1),
}


@pytest.fixture(scope="module")
def bundled():
    return qmtp.load()


@pytest.mark.parametrize("settings", list(SETTINGS))
def test_a_seed_gives_the_same_tokens_at_every_width(bundled, settings):
    """n_draft 1..5 and "auto" (twice) give one sequence per seed; the drafts were kept and refused alike, so the
    widths mattered to the passes, not to the tokens."""
    prompt = "Once upon a time"
    partial = 0
    for seed in (0, 7):
        runs = {}
        for n_draft in (1, 2, 3, 4, 5, "auto", "auto"):
            g = qmtp.generate(bundled, prompt, max_tokens=40, n_draft=n_draft, seed=seed, stop_at_eos=False,
                              **SETTINGS[settings])
            runs.setdefault(tuple(g.tokens), []).append(n_draft)
            partial += sum(0 < s.accepted < len(s.drafts) or s.accepted == 0 < len(s.drafts) for s in g.stats.steps)
        assert len(runs) == 1, runs
    assert partial > 0, "no draft was refused: the test cannot tell"
    greedy = qmtp.generate(bundled, prompt, max_tokens=40, stop_at_eos=False).tokens
    assert list(next(iter(runs))) != greedy  # it sampled


def test_auto_is_reproducible_run_after_run(model):
    """Five runs of "auto" with one seed: the same tokens (rejection sampling gave them in 1 of 5), though the
    planner's widths, timed on a shared machine, need not be the same."""
    for prompt in PROMPTS[2:4]:
        runs = [qmtp.generate(model, prompt, max_tokens=30, n_draft="auto", temperature=1.0, seed=11,
                              stop_at_eos=False) for _ in range(5)]
        assert all(r.tokens == runs[0].tokens for r in runs)


def test_switching_widths_step_by_step_keeps_the_sampled_tokens(small_vocab_model):
    """Widths changing at every step, then plain decoding (every switch a planner can make): the tokens of
    sampling plainly, with either roll back."""
    from conftest import decode_planned

    for prompt in PROMPTS:
        plain = qmtp.generate(small_vocab_model, prompt, max_tokens=30, stop_at_eos=False, temperature=1.0,
                              top_p=0.95, presence_penalty=0.5, seed=4).tokens
        for rollback in ("record", "replay"):
            g = decode_planned(small_vocab_model, prompt, CyclingPlanner([3, 5, 2, 4, 2, 5, 5, 3, 4]), rollback,
                               max_tokens=30, temperature=1.0, top_p=0.95, presence_penalty=0.5, seed=4)
            assert g.tokens == plain, (prompt, rollback)
            assert len(set(g.stats.tokens_per_pass)) > 3


def test_rejection_sampling_stays_available_and_differs_across_widths(small_vocab_model):
    """acceptance="rejection" draws per step: its tokens depend on the widths (what the coupled default fixes)."""
    differ = 0
    for seed in range(4):
        runs = {n: qmtp.generate(small_vocab_model, [1, 2, 3], max_tokens=20, n_draft=n, temperature=1.0, seed=seed,
                                 engine=qmtp.Engine(acceptance="rejection"), stop_at_eos=False).tokens for n in (1, 3)}
        differ += runs[1] != runs[3]
    assert differ > 0
    with pytest.raises(UsageError, match="acceptance"):
        qmtp.generate(small_vocab_model, [1], max_tokens=2, temperature=1.0, engine=qmtp.Engine(acceptance="gumbel"))


@pytest.mark.parametrize("acceptance", ["coupled", "rejection"])
def test_top_k_1_is_greedy_under_either_acceptance(model, acceptance):
    for prompt in PROMPTS[1:4]:
        greedy = qmtp.generate(model, prompt, max_tokens=16, stop_at_eos=False).tokens
        for n_draft in (1, 3, "auto"):
            sampled = qmtp.generate(model, prompt, max_tokens=16, n_draft=n_draft, temperature=1.5, top_k=1, seed=2,
                                    engine=qmtp.Engine(acceptance=acceptance), stop_at_eos=False)
            assert sampled.tokens == greedy


def test_neighbouring_seeds_do_not_share_shifted_noise():
    """A conversation seeds turn n with seed + n: the noise of seed s + 1 at position t must not be that of seed s
    at a nearby position (as a key built as seed + position would make it)."""
    def noise(seed, position):
        return acceptance.gumbel_noise(acceptance.position_key(mx.random.key(seed), position), 64)

    base = noise(5, 100)
    assert mx.array_equal(base, noise(5, 100))  # a function of (seed, position)
    others = [noise(5, 101), noise(6, 100), noise(6, 99), noise(4, 101), noise(2**64 - 1, 100)]
    assert not any(mx.allclose(base, o) for o in others)
    compiled = mx.compile(lambda key, position: acceptance.gumbel_noise(acceptance.position_key(key, position), 64))
    assert mx.array_equal(compiled(mx.random.key(5), mx.array(100, mx.int32)), base)  # inside a compiled step too


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    return qmtp.load(model_dir(tmp_path_factory.mktemp("templated")))


def test_a_conversation_turn_with_auto_is_generate_with_seed_plus_n(templated):
    """The README's promise: turn n of a sampled conversation equals generate(ids, seed=seed + n), at "auto" too,
    and at any other width."""
    conversation = qmtp.Conversation(templated, "Tell stories.", n_draft="auto", seed=5, max_tokens=24,
                                     temperature=0.9, top_p=0.95)
    for turn, text in enumerate(["A story about a fox.", "And a rabbit?", "Who wins?"]):
        g = conversation.send(text)
        for n_draft in ("auto", 1, 3):
            fresh = qmtp.generate(templated, g.prompt_tokens, seed=5 + turn, n_draft=n_draft, max_tokens=24,
                                  temperature=0.9, top_p=0.95)
            assert fresh.tokens == g.tokens, (turn, n_draft)


def test_every_drafting_option_keeps_the_sampled_tokens(small_vocab_model):
    """The engines' drafting choices change the drafts only: sampled, the tokens are plain sampling's too."""
    options = [dict(head_cache="reset"), dict(hidden="pre"), dict(chain="pre"), dict(rollback="replay")]
    for prompt in PROMPTS[:3]:
        plain = qmtp.generate(small_vocab_model, prompt, max_tokens=20, temperature=1.0, seed=3).tokens
        for opts in options:
            for n_draft in (2, 4):
                g = qmtp.generate(small_vocab_model, prompt, max_tokens=20, n_draft=n_draft, temperature=1.0, seed=3,
                                  engine=qmtp.Engine(**opts))
                assert g.tokens == plain, (opts, n_draft)
