"""The trunk against mlx-lm's own model, and incremental decoding against the full forward."""

import numpy as np
import pytest

import mlx.core as mx

import qmtp
from helpers import relative_error
from qmtp.tiny import synthetic


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synthetic.write_checkpoint(tmp_path_factory.mktemp("ckpt"), synthetic.small_config(), dtype="F32")


@pytest.fixture(scope="module")
def model(checkpoint):
    return qmtp.load(checkpoint)


TOKENS = mx.array([[5, 17, 3, 88, 41, 2, 60, 9, 33, 71, 12, 50, 8, 1, 94, 27]])


@pytest.mark.parametrize("layout", ["released", "next"])
def test_trunk_matches_mlx_lm(tmp_path, layout):
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    config = synthetic.small_config()
    path = synthetic.write_checkpoint(tmp_path, config, layout=layout, dtype="F32", seed=3)
    ours = qmtp.load(path)(TOKENS)
    reference, _ = mlx_lm_utils.load_model(path)
    theirs = reference(TOKENS).astype(mx.float32)
    assert relative_error(ours, theirs) < 1e-4


def test_mlx_lm_sees_the_conv_fix_as_done_after_our_load(tmp_path):
    """mlx-lm decides by the conv shape whether to shift the norms; both engines must agree on raw input."""
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    path = synthetic.write_checkpoint(tmp_path, synthetic.small_config(), dtype="F32", seed=4)
    reference, _ = mlx_lm_utils.load_model(path)
    norm = reference.language_model.model.norm.weight
    stored = qmtp.Checkpoint(path).load("model.language_model.norm.weight")
    assert np.allclose(np.array(norm), np.array(stored) + 1.0)


def chunked_logits(model, tokens, cuts):
    cache = model.make_cache()
    pieces, start = [], 0
    for end in list(cuts) + [tokens.shape[1]]:
        pieces.append(np.array(model(tokens[:, start:end], cache)))
        start = end
    return np.concatenate(pieces, axis=1)


@pytest.mark.parametrize("cuts", [[], [1], [5], [4, 5, 6, 7], list(range(1, 16)), [3, 11]])
def test_prefill_and_decode_match_the_full_forward(model, cuts):
    full = np.array(model(TOKENS))
    assert relative_error(chunked_logits(model, TOKENS, cuts), full) < 1e-5


def test_batched_rows_match_single_rows(model):
    batch = mx.concatenate([TOKENS, TOKENS[:, ::-1]], axis=0)
    together = np.array(model(batch))
    for row in range(2):
        assert relative_error(together[row], np.array(model(batch[row: row + 1]))[0]) < 1e-5


def test_snapshot_restore_is_exact(model):
    cache = model.make_cache()
    model(TOKENS[:, :6], cache)
    snapshot = cache.snapshot()
    first = np.array(model(TOKENS[:, 6:10], cache))
    cache.restore(snapshot)
    again = np.array(model(TOKENS[:, 6:10], cache))
    assert np.array_equal(first, again)


def test_recorded_states_rewind_to_any_prefix(model):
    """The decoding step's roll back: a pass over 4 tokens recording every position, cut back to `keep` of them,
    then the rest of the tokens: the full forward's logits."""
    from qmtp import decoding

    full = np.array(model(TOKENS))
    state = decoding.empty_state(model, 32, head=False)
    _, _, _, state["layers"] = decoding.trunk_step(model, TOKENS[:, :6], state, record=False)
    state["offset"] = mx.array([6], mx.int32)
    _, _, _, recorded = decoding.trunk_step(model, TOKENS[:, 6:10], state, record=True)
    for keep in range(1, 5):
        kept = {"layers": decoding.keep_prefix(model, recorded, mx.array([keep])), "offset": mx.array([6 + keep])}
        _, post, _, _ = decoding.trunk_step(model, TOKENS[:, 6 + keep:], kept, record=False)
        assert relative_error(np.array(model.logits(post)), full[:, 6 + keep:]) < 1e-5


def test_mtp_logits_shape_and_prenorm_option(model):
    post = model.mtp_logits(TOKENS)
    pre = model.mtp_logits(TOKENS, prenorm=True)
    assert post.shape == (1, TOKENS.shape[1] - 1, model.config.vocab_size)
    assert not np.allclose(np.array(post), np.array(pre))


def test_fixes_are_recorded_and_raw_differs(checkpoint, model):
    assert model.fixes_applied == ("norm", "conv")
    with pytest.warns(UserWarning, match="'norm' fix"):
        raw_norm_only = qmtp.load(checkpoint, fixes=("conv",))
    assert raw_norm_only.fixes_applied == ("conv",)
    assert relative_error(raw_norm_only(TOKENS), model(TOKENS)) > 0.1
