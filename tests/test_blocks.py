"""qmtp's MLX blocks (float32) against the independent float64 numpy reference in tests/reference.py.

Random checkpoints from qmtp.tiny.synthetic at toy widths, in three shapes:
  * "small": small_config() (GQA 4 query / 2 KV heads, 2 key / 4 value DeltaNet heads, top-2 of 8 experts);
  * "mqa":   one KV head for all query heads, as many DeltaNet value heads as key heads (no repetition), top-1;
  * "wide":  no GQA (4 / 4), 1 key head shared by 4 value heads, Dk != Dv, conv kernel 3, half the head
             rotated, every expert selected (top-8 of 8), a full-attention layer first, tied embeddings.
Each mixer runs as a function of its state (`step`), the trunk by the decoding path (`qmtp.decoding.trunk_step`,
through conftest's `run_trunk`). Tolerance: max |qmtp - reference| / max |reference| < 1e-4.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_unflatten

import qmtp
from conftest import mtp_logits, random_weights, run_trunk, small_config, trunk_logits, trunk_state
from qmtp.config import FULL, LINEAR
from qmtp.fixes import is_conv_kernel, is_zero_centred_norm
from qmtp.norms import GatedRMSNorm, RMSNorm
from qmtp.tiny.synthetic import write_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import reference as ref  # noqa: E402

TOL = 1e-4
SEED = 0
B, T = 2, 7

CONFIGS = {
    "small": dict(),
    "mqa": dict(num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=2, num_experts_per_tok=1),
    "wide": dict(
        num_key_value_heads=4,
        linear_num_key_heads=1,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=3,
        partial_rotary_factor=0.5,
        num_experts_per_tok=8,
        layer_types=[FULL, LINEAR, LINEAR, FULL],
        tie_word_embeddings=True,
    ),
}

# Largest relative error seen per block (printed at the end of the module; run with -s to see it).
ERRORS: dict[str, float] = {}


def rel_err(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def check(block: str, actual, expected, tol: float = TOL) -> float:
    if isinstance(actual, mx.array):
        actual = np.array(actual.astype(mx.float32))
    err = rel_err(actual, expected)
    ERRORS[block] = max(ERRORS.get(block, 0.0), err)
    assert err < tol, f"{block}: relative max error {err:.3g} >= {tol:g}"
    return err


def effective_weights(cfg, seed: int = SEED, shift_norms: bool = True) -> dict[str, np.ndarray]:
    """random_weights (as stored) -> the reference's float64 effective weights.

    Zero-centred norms are stored w and applied 1 + w; the conv kernel is stored [C, 1, K] and used as [C, K].
    With shift_norms=False the norms stay as stored (what a model loaded without the "norm" fix computes).
    """
    out = {}
    for name, w in random_weights(cfg, seed).items():
        w = w.astype(np.float64)
        if shift_norms and is_zero_centred_norm(name):
            w = 1.0 + w
        if is_conv_kernel(name):
            assert w.shape == (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim), w.shape
            w = w[:, 0, :]
        out[name] = w
    return out


class Case:
    def __init__(self, name, cfg, path, model, w):
        self.name, self.cfg, self.path, self.model, self.w = name, cfg, path, model, w
        rng = np.random.default_rng(1234)
        self.x = rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
        self.tokens = rng.integers(0, cfg.vocab_size, size=(B, T))

    def layers_of(self, kind):
        return [i for i, k in enumerate(self.cfg.layer_types) if k == kind]


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg = small_config(**CONFIGS[request.param])
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), cfg, dtype="F32", seed=SEED)
    model = qmtp.load(path)
    assert model.fixes_applied == ("norm", "conv")
    return Case(request.param, cfg, path, model, effective_weights(cfg))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if ERRORS:
        print("\nmax relative error per block (qmtp float32 vs reference float64):")
        for block, err in sorted(ERRORS.items()):
            print(f"  {block:28s} {err:.3e}")


# ---- norms --------------------------------------------------------------------------------------------------
def test_rmsnorm_and_gated_rmsnorm():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 24)).astype(np.float32) * 3.0
    z = rng.normal(size=(3, 5, 24)).astype(np.float32)
    w = (1.0 + 0.1 * rng.normal(size=24)).astype(np.float32)

    norm = RMSNorm(24, 1e-6)
    norm.update(tree_unflatten([("weight", mx.array(w))]))
    check("rmsnorm", norm(mx.array(x)), ref.rmsnorm(x, w, 1e-6))

    gated = GatedRMSNorm(24, 1e-6)
    gated.update(tree_unflatten([("weight", mx.array(w))]))
    check("gated_rmsnorm", gated(mx.array(x), mx.array(z)), ref.gated_rmsnorm(x, z, w, 1e-6))


# ---- the reference's own invariants (it must be right independently of qmtp) ----------------------------------
def test_reference_rope_is_relative():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, 16)), rng.normal(size=(1, 16))
    dots = [
        float(ref.rope(q, np.array([m + 3]), 8, 10_000.0)[0] @ ref.rope(k, np.array([m]), 8, 10_000.0)[0])
        for m in (0, 5, 40)
    ]
    assert np.allclose(dots, dots[0], rtol=1e-12)
    assert np.allclose(ref.rope(q, np.array([0]), 8, 10_000.0), q)  # position 0: identity
    assert np.allclose(ref.rope(q, np.array([9]), 8, 10_000.0)[:, 8:], q[:, 8:])  # unrotated tail untouched


def test_reference_chunked_equals_full(case):
    """Carrying the reference's state across chunks (3, 1, 3) reproduces the one-shot pass exactly."""
    cfg, w, x = case.cfg, case.w, case.x.astype(np.float64)
    i = case.layers_of(LINEAR)[0]
    full, conv_full, s_full = ref.gated_deltanet(w, f"layers.{i}.linear_attn.", x, cfg)
    outs, conv, s = [], None, None
    for a, b in ((0, 3), (3, 4), (4, 7)):
        o, conv, s = ref.gated_deltanet(w, f"layers.{i}.linear_attn.", x[:, a:b], cfg, conv, s)
        outs.append(o)
    assert rel_err(np.concatenate(outs, axis=1), full) < 1e-12
    assert rel_err(s, s_full) < 1e-12 and rel_err(conv, conv_full) < 1e-12

    j = case.layers_of(FULL)[0]
    full, _ = ref.gated_attention(w, f"layers.{j}.self_attn.", x, cfg)
    outs, past = [], None
    for a, b in ((0, 3), (3, 4), (4, 7)):
        o, past = ref.gated_attention(w, f"layers.{j}.self_attn.", x[:, a:b], cfg, offset=a, past=past)
        outs.append(o)
    assert rel_err(np.concatenate(outs, axis=1), full) < 1e-12


def test_reference_delta_rule_writes_value():
    """With no decay and beta = 1, after writing (k, v) the memory returns v for key k: S^T k = v."""
    rng = np.random.default_rng(0)
    S = rng.normal(size=(1, 1, 4, 3))
    k = ref.l2norm(rng.normal(size=(1, 1, 4)), 0.0)
    v = rng.normal(size=(1, 1, 3))
    delta = v - np.einsum("bhkv,bhk->bhv", S, k)
    S = S + np.einsum("bhk,bhv->bhkv", k, delta)
    assert np.allclose(np.einsum("bhkv,bhk->bhv", S, k), v, atol=1e-12)


# ---- blocks one by one ----------------------------------------------------------------------------------------
def attention_from_no_past(attn, x: mx.array) -> mx.array:
    return attn.step(x, attn.empty_state(x.shape[0], x.shape[1], x.dtype), mx.array(0, mx.int32))[0]


def deltanet_from_no_past(la, x: mx.array) -> mx.array:
    return la.step(x, la.empty_state(x.shape[0], x.dtype))[0]


def test_gated_attention(case):
    for i in case.layers_of(FULL):
        got = attention_from_no_past(case.model.layers[i].self_attn, mx.array(case.x))
        want, _ = ref.gated_attention(case.w, f"layers.{i}.self_attn.", case.x, case.cfg)
        check("attention", got, want)


def test_gated_attention_with_kv_cache(case):
    """Chunks of 3, 1 and 3 tokens stepped over KV buffers (longer than they need) equal the one-shot reference,
    keys included."""
    i = case.layers_of(FULL)[0]
    attn, prefix = case.model.layers[i].self_attn, f"layers.{i}.self_attn."
    buffers = attn.empty_state(B, T + 5, mx.float32)
    full, (keys, values) = ref.gated_attention(case.w, prefix, case.x, case.cfg)
    past = None
    for a, b in ((0, 3), (3, 4), (4, 7)):
        got, buffers = attn.step(mx.array(case.x[:, a:b]), buffers, mx.array(a, mx.int32))
        want, past = ref.gated_attention(case.w, prefix, case.x[:, a:b], case.cfg, offset=a, past=past)
        check("attention (KV cache)", got, want)
        check("attention (KV cache)", got, full[:, a:b])
    check("attention cached keys", buffers[0][:, :, :T], keys)
    check("attention cached keys", buffers[1][:, :, :T], values)


def test_gated_deltanet(case):
    for i in case.layers_of(LINEAR):
        got = deltanet_from_no_past(case.model.layers[i].linear_attn, mx.array(case.x))
        want, _, _ = ref.gated_deltanet(case.w, f"layers.{i}.linear_attn.", case.x, case.cfg)
        check("deltanet", got, want)


@pytest.mark.parametrize("chunks", [(3, 1, 3), (1, 1, 5)])
def test_gated_deltanet_decode(case, chunks):
    """Chunked decoding, each chunk stepped from the state the last left: outputs, recurrent state and conv state
    match the reference."""
    i = case.layers_of(LINEAR)[0]
    la, prefix = case.model.layers[i].linear_attn, f"layers.{i}.linear_attn."
    full, _, _ = ref.gated_deltanet(case.w, prefix, case.x, case.cfg)
    ours, conv, state, start = la.empty_state(B, mx.float32), None, None, 0
    for n in chunks:
        x = case.x[:, start:start + n]
        got, ours = la.step(mx.array(x), ours)
        want, conv, state = ref.gated_deltanet(case.w, prefix, x, case.cfg, conv, state)
        check("deltanet (decode)", got, want)
        check("deltanet (decode)", got, full[:, start:start + n])
        start += n
        check("deltanet state", ours[1], state)
        check("deltanet conv state", ours[0], conv)
    c = case.cfg
    assert ours[1].shape == (B, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)


def test_gated_deltanet_rewind(case):
    """Speculative rollback: verify 4 tokens recording the state after each, keep 2, continue: equals the reference."""
    i = case.layers_of(LINEAR)[0]
    la, prefix = case.model.layers[i].linear_attn, f"layers.{i}.linear_attn."
    full, _, _ = ref.gated_deltanet(case.w, prefix, case.x, case.cfg)
    x = mx.array(case.x)
    _, state = la.step(x[:, :2], la.empty_state(B, x.dtype))
    _, recorded = la.step(x[:, 2:6], state, record=True)  # 4 positions verified
    assert recorded[0].shape[0] == recorded[1].shape[0] == 4
    conv, recurrent = (s[1] for s in recorded)  # keep positions 2 and 3
    _, want_conv, want_state = ref.gated_deltanet(case.w, prefix, case.x[:, :4], case.cfg)
    check("deltanet state (rewind)", recurrent, want_state)
    check("deltanet conv state", conv, want_conv)
    got, _ = la.step(x[:, 4:7], (conv, recurrent))
    check("deltanet (decode)", got, full[:, 4:7])


def test_sparse_moe(case):
    for i in range(case.cfg.num_hidden_layers):
        mlp, prefix = case.model.layers[i].mlp, f"layers.{i}.mlp."
        chosen, margin = ref.moe_routing(case.w, prefix, case.x, case.cfg)
        assert margin.min() > 1e-5, "near-tie in routing: pick another seed"
        mlp.routing_log = []
        try:
            got = mlp(mx.array(case.x))
            indices = np.array(mlp.routing_log[0])
        finally:
            mlp.routing_log = None
        assert [sorted(r) for r in indices.tolist()] == [sorted(r) for r in chosen.tolist()]
        check("moe", got, ref.sparse_moe(case.w, prefix, case.x, case.cfg))


@pytest.mark.parametrize("tokens,sort", [(1, False), (3, True), (40, False)])
def test_bfloat16_experts_cast_only_what_they_use(tokens, sort):
    """On the CPU bf16 experts compute in float32: taking the chosen ones first gives the whole stack's result."""
    from qmtp.moe import StackedLinear

    layer = StackedLinear(16, 32, 24)
    layer.weight = mx.random.normal((16, 24, 32)).astype(mx.bfloat16)
    indices = mx.random.randint(0, 16, (tokens, 2)).astype(mx.uint32)
    if sort:
        indices = mx.sort(indices.reshape(-1)).reshape(tokens, 2)
    x = mx.random.normal((tokens, 1, 1, 32))
    whole = mx.gather_mm(x, layer.weight.astype(mx.float32).swapaxes(-1, -2), rhs_indices=indices)
    assert np.array_equal(np.array(layer(x, indices, sorted_indices=sort)), np.array(whole))


def test_decoder_layers(case):
    for i, kind in enumerate(case.cfg.layer_types):
        got = case.model.layers[i](mx.array(case.x))
        want, _ = ref.decoder_layer(case.w, f"layers.{i}.", case.x, case.cfg, kind)
        check(f"decoder layer ({kind.split('_')[0]})", got, want)


# ---- trunk and head -------------------------------------------------------------------------------------------
def test_trunk(case):
    """The decoding path's trunk from no past, and `Model.trunk` (training's), against the reference."""
    tokens = mx.array(case.tokens)
    pre, post, logits = ref.trunk(case.w, case.tokens, case.cfg)
    got_pre, got_post, _ = run_trunk(case.model, tokens)
    check("trunk logits", case.model.logits(got_post), logits)
    check("trunk hidden (post-norm)", got_post, post)
    check("trunk hidden (pre-norm)", got_pre, pre)
    whole_pre, whole_post = case.model.trunk(tokens)
    check("trunk hidden (post-norm)", whole_post, post)
    check("trunk hidden (pre-norm)", whole_pre, pre)


def test_trunk_decode_with_cache(case):
    """Prefill 4 tokens, then 1, then 2, by the decoding path over one state: the one-shot reference's logits."""
    _, _, logits = ref.trunk(case.w, case.tokens, case.cfg)
    state = trunk_state(case.model, B, T + 5)
    for a, b in ((0, 4), (4, 5), (5, 7)):
        _, post, state = run_trunk(case.model, mx.array(case.tokens[:, a:b]), state)
        check("trunk logits (decode)", case.model.logits(post), logits[:, a:b])
    assert state["offset"].item() == T


def test_mtp_head(case):
    check("mtp logits", mtp_logits(case.model, mx.array(case.tokens)), ref.mtp_logits(case.w, case.tokens, case.cfg))


def test_mtp_head_with_cache(case):
    """The head's layer stepped in chunks over its own KV buffers equals the teacher-forced reference state."""
    _, h, _ = ref.trunk(case.w, case.tokens, case.cfg)
    emb = case.w["embed_tokens.weight"][case.tokens[:, 1:]]
    want, _ = ref.mtp_state(case.w, h[:, :-1], emb, case.cfg)
    head = case.model.mtp
    h_mx = run_trunk(case.model, mx.array(case.tokens))[1][:, :-1]
    e_mx = case.model.embed_tokens(mx.array(case.tokens[:, 1:]))
    buffers = head.layers[0].empty_state(B, T, mx.float32)
    for a, b in ((0, 3), (3, 4), (4, 6)):
        z, buffers, _, _ = head.layers[0].step(head.combine(h_mx[:, a:b], e_mx[:, a:b]), buffers, mx.array(a, mx.int32))
        check("mtp state (KV cache)", head.norm(z), want[:, a:b])


# ---- the load-time fixes ----------------------------------------------------------------------------------------
def _conv_error(cfg) -> str:
    C, K = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
    return re.escape(f"weights of shape ({C},1,{K})")


def test_raw_model_differs_from_fixed(case):
    """fixes=(): loads, keeps w ~ 0 norms and the [C, 1, K] kernel; full-attention layers run and differ,
    anything through a DeltaNet layer raises MLX's conv1d shape error."""
    with pytest.warns(UserWarning, match="without the"):  # the loader warns about every fix left out
        raw = qmtp.load(case.path, fixes=())
    assert raw.fixes_applied == ()
    C, K = case.cfg.linear_conv_dim, case.cfg.linear_conv_kernel_dim
    i_lin, i_full = case.layers_of(LINEAR)[0], case.layers_of(FULL)[0]
    assert raw.layers[i_lin].linear_attn.conv1d["weight"].shape == (C, 1, K)

    x = mx.array(case.x)
    fixed_out = np.array(case.model.layers[i_full](x))
    raw_out = np.array(raw.layers[i_full](x))
    assert rel_err(raw_out, fixed_out) > 0.05
    # and the raw full-attention layer is exactly the reference with unshifted norms
    want, _ = ref.decoder_layer(effective_weights(case.cfg, shift_norms=False), f"layers.{i_full}.", case.x,
                                case.cfg, FULL)
    check("raw full-attn layer", raw_out, want)
    with pytest.raises(ValueError, match=_conv_error(case.cfg)):
        mx.eval(trunk_logits(raw, mx.array(case.tokens)))


def test_conv_fix_only_is_the_unshifted_model(case):
    """fixes=("conv",) runs end to end; its logits differ from the fixed model's and equal the reference
    computed with the stored (unshifted) norms: the norm fix is exactly the +1."""
    with pytest.warns(UserWarning, match="'norm' fix"):
        m = qmtp.load(case.path, fixes=("conv",))
    assert m.fixes_applied == ("conv",)
    tokens = mx.array(case.tokens)
    got = np.array(trunk_logits(m, tokens))
    assert rel_err(got, np.array(trunk_logits(case.model, tokens))) > 0.05
    _, _, want = ref.trunk(effective_weights(case.cfg, shift_norms=False), case.tokens, case.cfg)
    check("trunk logits (no norm fix)", got, want)


def test_norm_fix_only_fails_loudly_at_forward(case):
    """fixes=("norm",): qmtp.load does NOT raise; the kernel keeps its stored [C, 1, K] shape and the first
    forward through a DeltaNet layer raises ValueError from mx.conv1d. Full-attention layers are correct."""
    with pytest.warns(UserWarning, match="'conv' fix"):
        m = qmtp.load(case.path, fixes=("norm",))
    assert m.fixes_applied == ("norm",)
    C, K = case.cfg.linear_conv_dim, case.cfg.linear_conv_kernel_dim
    for i in case.layers_of(LINEAR):
        assert m.layers[i].linear_attn.conv1d["weight"].shape == (C, 1, K)
    tokens = mx.array(case.tokens)
    with pytest.raises(ValueError, match=_conv_error(case.cfg)):
        mx.eval(trunk_logits(m, tokens))
    with pytest.raises(ValueError, match=_conv_error(case.cfg)):
        mx.eval(mtp_logits(m, tokens))
    with pytest.raises(ValueError, match=_conv_error(case.cfg)):
        mx.eval(deltanet_from_no_past(m.layers[case.layers_of(LINEAR)[0]].linear_attn, mx.array(case.x[:, :1])))
    i_full = case.layers_of(FULL)[0]
    x = mx.array(case.x)
    assert rel_err(np.array(m.layers[i_full](x)), np.array(case.model.layers[i_full](x))) == 0.0
