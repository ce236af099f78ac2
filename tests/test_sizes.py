"""qmtp.sizes: the arithmetic on the real config, and exact agreement with mx.quantize on small configs."""

import math

import mlx.core as mx
import pytest

from qmtp.config import QWEN36_35B_A3B
from qmtp.errors import UsageError
from qmtp.layout import expected_shapes
from qmtp.sizes import CATEGORIES, UNQUANTIZED, parameter_counts, quantized_bytes, sizes
from conftest import small_config

REAL = QWEN36_35B_A3B


def numel(config, pick) -> int:
    return sum(math.prod(s) for n, s in expected_shapes(config, head=True).items() if pick(n))


def a_log_numel(config) -> int:
    return numel(config, lambda n: n.endswith(".A_log"))


# ---- the arithmetic on the real config ------------------------------------------------------------------------
def test_unquantized_total_is_two_bytes_per_parameter():
    r = sizes(REAL, bits=UNQUANTIZED, router_bits=UNQUANTIZED)
    params = parameter_counts(REAL)
    # bf16 everywhere except A_log, which stays float32 (2 extra bytes each).
    assert r.total_bytes == 2 * params["total"] + 2 * a_log_numel(REAL)
    assert r.head_bytes == 2 * params["head"]  # the head is a full-attention layer: no A_log
    assert r.trunk_bytes == 2 * params["trunk"] + 2 * a_log_numel(REAL)


def test_four_bit_routed_experts():
    n = numel(REAL, lambda name: ".mlp.experts." in name and not name.startswith("mtp."))
    assert n == 40 * 3 * 256 * 512 * 2048
    r = sizes(REAL, bits=4, group_size=64)
    assert r.trunk["routed experts"] == n * 4 // 8 + n // 64 * 2 * 2
    r = sizes(REAL, bits=6, group_size=128)
    assert r.trunk["routed experts"] == n * 6 // 8 + n // 128 * 2 * 2


def test_router_at_router_bits_and_embeddings_overrides():
    r = sizes(REAL, bits=4)
    router = numel(REAL, lambda n: n.endswith((".mlp.gate.weight", "shared_expert_gate.weight")) and "mtp" not in n)
    assert r.trunk["router and shared-expert gates"] == router + router // 64 * 4
    V, H = REAL.vocab_size, REAL.hidden_size
    assert r.trunk["embeddings"] == r.trunk["lm_head"] == quantized_bytes((V, H), 4, 64, 2)
    r8 = sizes(REAL, bits=4, lm_head_bits=8, embed_bits=UNQUANTIZED)
    assert r8.trunk["lm_head"] == V * H + V * H // 64 * 4
    assert r8.trunk["embeddings"] == 2 * V * H
    changed = {c for c in CATEGORIES if r8.trunk[c] != r.trunk[c]}
    assert changed == {"lm_head", "embeddings"}


def test_norms_and_small_vectors_unquantized():
    r = sizes(REAL, bits=4)
    small = numel(REAL, lambda n: len(expected_shapes(REAL)[n]) == 1 and not n.startswith("mtp."))
    assert r.trunk["norms and small vectors"] == 2 * small + 2 * a_log_numel(REAL)
    conv = [t for t in r.tensors if t.name.endswith("conv1d.weight")]
    assert len(conv) == 30 and all(t.bits is None and t.nbytes == 2 * t.numel for t in conv)


def test_monotonic_in_bits_and_head_independent_of_trunk():
    trunks = [sizes(REAL, bits=b).trunk_bytes for b in (2, 3, 4, 5, 6, 8)]
    assert trunks == sorted(trunks) and len(set(trunks)) == 6
    heads = {sizes(REAL, bits=b, mtp_bits=m).head_bytes for b in (2, 4, 8) for m in (8,)}
    assert len(heads) == 1
    head_bf16 = sizes(REAL, bits=4).head_bytes
    assert head_bf16 == sizes(REAL, bits=8).head_bytes == 2 * parameter_counts(REAL)["head"]
    head_sizes = [sizes(REAL, mtp_bits=m).head_bytes for m in (2, 3, 4, 5, 6, 8)]
    assert head_sizes == sorted(head_sizes) and head_sizes[-1] < head_bf16
    # the trunk does not depend on the head's width
    assert len({sizes(REAL, bits=4, mtp_bits=m).trunk_bytes for m in (None, 4, 8)}) == 1


def test_real_config_numbers():
    """The figures the book quotes, as arithmetic (decimal GB). lemon-mlx-engine's table says about 20 / 28 / 36 GB at
    4 / 6 / 8 bits and a head of about 0.5 GB: the trunk agrees; 0.5 GB is the head at 4 bits, not bf16."""
    p = parameter_counts(REAL)
    assert p["trunk"] == 34_660_610_688 and p["head"] == 844_640_768 and p["total"] == 35_505_251_456
    assert p["active"] == 2_946_431_616
    assert round(sizes(REAL, bits=4).trunk_bytes / 1e9, 1) == 19.5
    assert round(sizes(REAL, bits=6).trunk_bytes / 1e9, 1) == 28.2
    assert round(sizes(REAL, bits=8).trunk_bytes / 1e9, 1) == 36.8
    assert round(sizes(REAL).head_bytes / 1e9, 2) == 1.69
    assert round(sizes(REAL, mtp_bits=8).head_bytes / 1e9, 2) == 0.90
    assert round(sizes(REAL, mtp_bits=4).head_bytes / 1e9, 2) == 0.48


def test_table_rows_add_up():
    r = sizes(REAL, bits=4, mtp_bits=8)
    rows = r.table()
    assert rows[-1] == ("total", r.trunk_bytes, r.head_bytes, r.total_bytes)
    assert sum(row[1] for row in rows[:-1]) == r.trunk_bytes
    assert sum(row[2] for row in rows[:-1]) == r.head_bytes
    assert all(row[3] == row[1] + row[2] for row in rows)
    assert {row[0] for row in rows[:-1]} <= set(CATEGORIES)
    assert "routed experts" in r.format()


# ---- parameter counts ---------------------------------------------------------------------------------------
def test_parameter_counts_by_hand():
    p = parameter_counts(REAL)
    shapes = expected_shapes(REAL, head=True)
    assert p["total"] == sum(math.prod(s) for s in shapes.values())
    H, V, E, k, I = 2048, 248_320, 256, 8, 512
    routed = 40 * 3 * E * I * H
    assert p["routed_experts"] == routed
    embed = V * H
    # active = trunk minus the unchosen experts, minus all but one row of the embedding
    assert p["active"] == p["trunk"] - routed * (E - k) // E - (embed - H)
    head_routed = 3 * E * I * H
    assert p["head_active"] == p["head"] - head_routed * (E - k) // E
    assert 34e9 < p["total"] < 36e9 and 2.5e9 < p["active"] < 3.5e9


def test_parameter_counts_tied_embeddings():
    c = small_config(tie_word_embeddings=True)
    p = parameter_counts(c)
    assert "lm_head.weight" not in expected_shapes(c)
    untied = parameter_counts(small_config())
    assert untied["trunk"] - p["trunk"] == c.vocab_size * c.hidden_size
    # tied: the one matrix is read whole for the logits
    assert untied["active"] - p["active"] == c.hidden_size


# ---- exact agreement with mx.quantize ---------------------------------------------------------------------------
def mlx_bytes(config, bits, group_size, mtp_bits, router_bits=8, dtype=mx.bfloat16):
    """Convert every tensor as mlx-lm would, with real arrays, and sum their nbytes (trunk, head)."""
    totals = {"trunk": 0, "head": 0}
    for name, shape in expected_shapes(config, head=True).items():
        head = name.startswith("mtp.")
        w = mx.ones(shape, dtype=mx.float32 if name.endswith(".A_log") else dtype)
        if head and mtp_bits is None:
            width, gs = None, group_size
        elif name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight")):
            width, gs = router_bits, 64
        else:
            width, gs = (mtp_bits if head else bits), group_size
        if width is not None and len(shape) >= 2 and "conv1d" not in name and shape[-1] % gs == 0:
            arrays = mx.quantize(w, group_size=gs, bits=width)
        else:
            arrays = (w,)
        totals["head" if head else "trunk"] += sum(a.nbytes for a in arrays)
    return totals


DIVISIBLE = dict(hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64, head_dim=16,
                 linear_value_head_dim=16, linear_key_head_dim=16)


@pytest.mark.parametrize("bits,group_size,mtp_bits", [(4, 64, None), (3, 32, 8), (6, 64, 6), (8, 32, 2),
                                                      (2, 64, 5), (5, 32, None)])
def test_matches_mx_quantize_all_divisible(bits, group_size, mtp_bits):
    config = small_config(**DIVISIBLE)
    r = sizes(config, bits=bits, group_size=group_size, mtp_bits=mtp_bits)
    got = mlx_bytes(config, bits, group_size, mtp_bits)
    assert (r.trunk_bytes, r.head_bytes) == (got["trunk"], got["head"])
    assert all(t.bits is not None for t in r.tensors
               if len(t.shape) >= 2 and "conv1d" not in t.name and (mtp_bits or not t.is_head))


@pytest.mark.parametrize("bits,group_size,mtp_bits", [(4, 64, None), (3, 32, 4), (8, 128, 8)])
def test_matches_mx_quantize_mixed_dims(bits, group_size, mtp_bits):
    """Default small widths: some last dims (shared expert 24, linear value dim 32) are not divisible by the
    group size and stay bf16; the rest is quantized."""
    config = small_config(hidden_size=64 if group_size <= 64 else 128)
    r = sizes(config, bits=bits, group_size=group_size, mtp_bits=mtp_bits)
    got = mlx_bytes(config, bits, group_size, mtp_bits)
    assert (r.trunk_bytes, r.head_bytes) == (got["trunk"], got["head"])
    assert any(t.bits is None and len(t.shape) >= 2 and "conv1d" not in t.name for t in r.tensors)


def test_matches_mx_quantize_float32_checkpoint():
    config = small_config(**DIVISIBLE)
    r = sizes(config, bits=4, mtp_bits=8, dtype_bytes=4)
    got = mlx_bytes(config, 4, 64, 8, dtype=mx.float32)
    assert (r.trunk_bytes, r.head_bytes) == (got["trunk"], got["head"])


def test_bad_arguments():
    for kwargs in (dict(bits=7), dict(mtp_bits=9), dict(group_size=48), dict(router_bits=0), dict(dtype_bytes=3),
                   dict(embed_bits=12)):
        with pytest.raises(UsageError):
            sizes(REAL, **kwargs)
