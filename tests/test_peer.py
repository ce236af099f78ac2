"""mlx-vlm as a peer engine on the bundled model: its plain greedy tokens are qmtp's, its MTP decoding is
lossless, and its drafter proposes what qmtp's head proposes (an independent implementation of the head)."""

import pytest

import qmtp
from qmtp.book import peer
from qmtp.errors import UsageError

pytestmark = pytest.mark.skipif(peer.available() is not None, reason=peer.available() or "")

TEXTS = ["Once upon a time", "She said that"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return qmtp.load()


@pytest.fixture(scope="module")
def engine(model):
    return peer.MlxVlmEngine(model.path, model.dtype)


@pytest.fixture(scope="module")
def prompts(model):
    return [model.tokenizer.encode(t) for t in TEXTS] + [[model.tokenizer.encode(TEXTS[0])[0]]]


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return [engine.generate(prompt, MAX_TOKENS, 1) for prompt in prompts]


def test_available_when_installed():
    assert peer.available() is None


def test_plain_greedy_equals_qmtp(model, prompts, plain):
    for prompt, theirs in zip(prompts, plain):
        ours = qmtp.generate(model, prompt, max_tokens=MAX_TOKENS, n_draft=1, stop_at_eos=False)
        assert theirs["tokens"] == ours.tokens
        assert theirs["acceptance"] is None and theirs["passes"] == MAX_TOKENS - 1 and theirs["seconds"] > 0


@pytest.mark.parametrize("n_draft", [2, 3])
def test_mtp_greedy_equals_plain(engine, prompts, plain, n_draft):
    for prompt, reference in zip(prompts, plain):
        spec = engine.generate(prompt, MAX_TOKENS, n_draft)
        assert spec["tokens"] == reference["tokens"]
        assert spec["passes"] < MAX_TOKENS - 1, "no draft was accepted: MTP drafting did not run"
        assert 0 < spec["acceptance"] <= 1 and len(spec["acceptance_per_position"]) == n_draft - 1


def test_one_draft_per_pass_drafts_what_qmtp_drafts(model, engine, prompts):
    """With one draft per pass both engines fill the head's cache from the trunk's verified states only, so
    they must accept the same drafts in the same passes. (With more, mlx-vlm keeps the cache entries its
    head wrote for accepted drafts from its own output, and qmtp recomputes them from the trunk's states:
    both lossless, their acceptances differ.)"""
    for prompt in prompts:
        theirs = engine.generate(prompt, MAX_TOKENS, 2)
        ours = qmtp.generate(model, prompt, max_tokens=MAX_TOKENS, n_draft=2, stop_at_eos=False).stats
        assert theirs["passes"] == ours.trunk_passes
        assert (theirs["proposed"], theirs["accepted"]) == (ours.drafted, ours.accepted)
        assert theirs["acceptance"] == pytest.approx(ours.acceptance_rate)


def test_bad_input_is_a_usage_error(engine):
    for args in [([], 4, 1), ([1], 0, 1), ([1], 4, 0)]:
        with pytest.raises(UsageError):
            engine.generate(*args)
