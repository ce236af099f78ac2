"""The trunk (by the decoding path) against mlx-lm's own model, and incremental decoding against the full forward."""

import numpy as np
import pytest

import mlx.core as mx

from conftest import run_trunk, small_config, trunk_logits, trunk_state
import qmtp
from helpers import relative_error
from qmtp.tiny import synthetic


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synthetic.write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), dtype="F32")


@pytest.fixture(scope="module")
def model(checkpoint):
    return qmtp.load(checkpoint)


TOKENS = mx.array([[5, 17, 3, 88, 41, 2, 60, 9, 33, 71, 12, 50, 8, 1, 94, 27]])


@pytest.mark.parametrize("layout", ["released", "next"])
def test_trunk_matches_mlx_lm(tmp_path, layout):
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    config = small_config()
    path = synthetic.write_checkpoint(tmp_path, config, layout=layout, dtype="F32", seed=3)
    ours = trunk_logits(qmtp.load(path), TOKENS)
    reference, _ = mlx_lm_utils.load_model(path)
    theirs = reference(TOKENS).astype(mx.float32)
    assert relative_error(ours, theirs) < 1e-4


def test_mlx_lm_sees_the_conv_fix_as_done_after_our_load(tmp_path):
    """mlx-lm decides by the conv shape whether to shift the norms; both engines must agree on raw input."""
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    path = synthetic.write_checkpoint(tmp_path, small_config(), dtype="F32", seed=4)
    reference, _ = mlx_lm_utils.load_model(path)
    norm = reference.language_model.model.norm.weight
    stored = qmtp.Checkpoint(path).load("model.language_model.norm.weight")
    assert np.allclose(np.array(norm), np.array(stored) + 1.0)


def chunked_logits(model, tokens, cuts):
    """The decoding path over `tokens` in chunks ending at `cuts`, each from the state the last left."""
    state = trunk_state(model, tokens.shape[0], 32)
    pieces, start = [], 0
    for end in list(cuts) + [tokens.shape[1]]:
        _, post, state = run_trunk(model, tokens[:, start:end], state)
        pieces.append(np.array(model.logits(post)))
        start = end
    return np.concatenate(pieces, axis=1)


@pytest.mark.parametrize("cuts", [[], [1], [5], [4, 5, 6, 7], list(range(1, 16)), [3, 11]])
def test_prefill_and_decode_match_the_full_forward(model, cuts):
    full = np.array(trunk_logits(model, TOKENS))
    assert relative_error(chunked_logits(model, TOKENS, cuts), full) < 1e-5


def test_batched_rows_match_single_rows(model):
    batch = mx.concatenate([TOKENS, TOKENS[:, ::-1]], axis=0)
    together = np.array(trunk_logits(model, batch))
    for row in range(2):
        assert relative_error(together[row], np.array(trunk_logits(model, batch[row: row + 1]))[0]) < 1e-5


def test_recorded_states_rewind_to_any_prefix(model):
    """The decoding step's roll back: a pass over 4 tokens recording every position, cut back to `keep` of them,
    then the rest of the tokens: the full forward's logits."""
    from qmtp import decoding

    full = np.array(trunk_logits(model, TOKENS))
    state = decoding.empty_state(model, 32, head=False)
    _, _, _, state["layers"] = decoding.trunk_step(model, TOKENS[:, :6], state, record=False)
    state["offset"] = mx.array([6], mx.int32)
    _, _, _, recorded = decoding.trunk_step(model, TOKENS[:, 6:10], state, record=True)
    for keep in range(1, 5):
        kept = {"layers": decoding.keep_prefix(model, recorded, mx.array([keep])), "offset": mx.array([6 + keep])}
        _, post, _, _ = decoding.trunk_step(model, TOKENS[:, 6 + keep:], kept, record=False)
        assert relative_error(np.array(model.logits(post)), full[:, 6 + keep:]) < 1e-5


def test_fixes_are_recorded_and_raw_differs(checkpoint, model):
    assert model.fixes_applied == ("norm", "conv")
    with pytest.warns(UserWarning, match="'norm' fix"):
        raw_norm_only = qmtp.load(checkpoint, fixes=("conv",))
    assert raw_norm_only.fixes_applied == ("conv",)
    assert relative_error(trunk_logits(raw_norm_only, TOKENS), trunk_logits(model, TOKENS)) > 0.1


def test_calling_the_model_gives_the_decoding_paths_logits(model):
    """`model(tokens)` (teacher-forced, what the book compares with other engines' models) is the decoding step's
    trunk from an empty state, batch rows included."""
    tokens = mx.array(np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 9)), mx.int32)
    assert relative_error(np.array(model(tokens)), np.array(trunk_logits(model, tokens))) < 1e-5
