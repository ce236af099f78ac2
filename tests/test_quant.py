"""qmtp.quant against mx.quantize / mx.dequantize / mx.quantized_matmul: bit for bit where MLX is exact."""

import mlx.core as mx
import numpy as np
import pytest

from qmtp import quant
from qmtp.errors import UsageError

BITS = quant.SUPPORTED_BITS  # 1, 2, 3, 4, 5, 6, 8
GROUPS = quant.SUPPORTED_GROUP_SIZES  # 32, 64, 128


def u32(a) -> np.ndarray:
    """float32 bits as integers: equality of these is bit-exactness (and treats -0.0 != 0.0)."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def hard_matrix(group_size: int, seed: int) -> np.ndarray:
    """Random float32 rows at several magnitudes, plus rows of every edge case, each group filled whole."""
    rng = np.random.default_rng(seed)
    K = 4 * group_size
    rows = [rng.standard_normal(K) * s for s in (1e-3, 0.02, 1.0, 300.0)]
    g = rng.standard_normal((4, group_size))
    rows += [
        np.repeat([1.5, -0.75, 0.0, 3e-8], group_size),        # constant groups (max == min), incl. tiny
        np.concatenate([-np.abs(g[0]) - 1, -np.abs(g[1]), g[2] + 5, np.abs(g[3])]),  # all-negative, all-positive
        np.concatenate([g[0] - 2, g[1] + 2, g[2], -g[2]]),      # |min| > |max|, |max| > |min|, then mirrored
        np.zeros(K),                                             # zeros
        np.tile(np.r_[[-1.0, 1.0], np.zeros(group_size - 2)], 4),  # |min| == |max|: the tie
        np.round(rng.standard_normal(K) * 8) / 4,                # many exact ties in the code rounding
        rng.uniform(0, 1, K),                                    # min near 0, max the edge
        -rng.uniform(0, 1, K) ** 3,                              # skewed, all negative
    ]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_bit_exact_with_mx_quantize(bits, group_size):
    w = hard_matrix(group_size, seed=bits * 1000 + group_size)
    q, s, b = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    words, scales, biases = quant.quantize(w, group_size, bits)
    assert words.dtype == np.uint32 and words.shape == tuple(q.shape) == (w.shape[0], w.shape[1] * bits // 32)
    np.testing.assert_array_equal(words, np.array(q))  # codes packed into identical words
    np.testing.assert_array_equal(u32(scales), u32(np.array(s)))
    np.testing.assert_array_equal(u32(biases), u32(np.array(b)))
    # unpacking MLX's words gives our codes
    codes, _, _ = quant.quantize_groups(w, group_size, bits)
    np.testing.assert_array_equal(quant.unpack(np.array(q), bits, w.shape[1]), codes)
    # dequantize: identical floats to mx.dequantize
    ours = quant.dequantize(words, scales, biases, group_size, bits)
    theirs = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits))
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(u32(ours), u32(theirs))


@pytest.mark.parametrize("bits", [2, 3, 6])
def test_leading_axes(bits):
    """Groups run along the last axis only; any leading axes (stacked experts) are rows."""
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((3, 5, 128)).astype(np.float32)
    q, s, b = mx.quantize(mx.array(w), group_size=64, bits=bits)
    words, scales, biases = quant.quantize(w, 64, bits)
    assert words.shape == (3, 5, 128 * bits // 32) and scales.shape == (3, 5, 2)
    np.testing.assert_array_equal(words, np.array(q))
    np.testing.assert_array_equal(u32(scales), u32(np.array(s)))
    np.testing.assert_array_equal(u32(biases), u32(np.array(b)))


# ---- the arithmetic, step by step, on hand-made groups (each also checked against MLX) --------------------------
def one_group(values, bits, group_size=32):
    w = np.zeros((1, group_size), np.float32)
    w[0, : len(values)] = values
    q, s, b = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    codes, scale, bias = quant.quantize_groups(w, group_size, bits)
    np.testing.assert_array_equal(quant.pack(codes, bits), np.array(q))
    np.testing.assert_array_equal(u32(scale), u32(np.array(s)))
    np.testing.assert_array_equal(u32(bias), u32(np.array(b)))
    return codes[0], float(scale[0, 0]), float(bias[0, 0])


def test_q0_rounds_half_to_even():
    # 2 bits, max 2.5, min 0: scale = -(2.5/3)... take min -0.5 so (max-min)/3 = 1 exactly:
    # edge/scale = 2.5/-1 = -2.5 -> q0 = -2 (half to even; half away from zero would give -3), scale = 2.5/-2.
    codes, scale, bias = one_group([2.5, -0.5], bits=2)
    assert (scale, bias) == (-1.25, 2.5)
    assert codes[0] == 0 and codes[2] == 2  # the edge is code 0; 0.0 is code -q0 = 2 (here exactly: 2.5 - 2*1.25)


def test_codes_round_half_to_even():
    # 2 bits, max 3, min 0: scale -1, bias 3 (q0 = -3). (1.5 - 3)/-1 = 1.5 -> 2; (0.5 - 3)/-1 = 2.5 -> 2.
    codes, scale, bias = one_group([3.0, 0.0, 1.5, 0.5, 2.5], bits=2)
    assert (scale, bias) == (-1.0, 3.0)
    assert list(codes[:5]) == [0, 3, 2, 2, 0]


def test_sign_rule_and_ties():
    # |min| > |max|: the minimum is the edge, the step positive, code 0 decodes to the minimum.
    codes, scale, bias = one_group([-4.0, 1.0], bits=4)
    assert bias == -4.0 and scale > 0 and codes[0] == 0
    # |max| > |min|: the maximum is the edge, the step negative.
    codes, scale, bias = one_group([4.0, -1.0], bits=4)
    assert bias == 4.0 and scale < 0 and codes[0] == 0
    # A tie (|min| == |max|) takes the maximum, as does a constant group.
    _, scale, bias = one_group([-1.0, 1.0], bits=4)
    assert bias == 1.0 and scale < 0


def test_constant_groups():
    w = np.repeat(np.array([[2.0, -3.0, 0.0, 1e-8]], np.float32), 32, axis=1)
    words, scales, biases = quant.quantize(w, 32, 4)
    # max == min: the step is the 1e-7 floor (negated, the max being the edge), rescaled to edge/q0 ...
    assert np.all(scales < 0) and np.all(np.abs(scales) <= 1e-7)
    out = quant.dequantize(words, scales, biases, 32, 4)
    np.testing.assert_array_equal(out[0, :96], w[0, :96])  # ... so 2.0, -3.0 and 0.0 come back exactly
    # ... but a constant group smaller than half the floor has q0 == 0: bias 0, and it decodes to 0.
    assert biases[0, 3] == 0 and np.all(out[0, 96:] == 0)
    q, s, b = mx.quantize(mx.array(w), group_size=32, bits=4)
    np.testing.assert_array_equal(u32(out), u32(np.array(mx.dequantize(q, s, b, group_size=32, bits=4))))


def test_one_bit_is_plain_min_max():
    # MLX quantizes 1-bit groups without the edge anchoring: scale = max - min, bias = min.
    codes, scale, bias = one_group([-1.0, 0.0, 0.5, 2.0], bits=1)
    assert (scale, bias) == (3.0, -1.0)
    assert list(codes[:4]) == [0, 0, 0, 1] and np.all(codes[4:] == 0)  # 0.0 -> 1/3 -> 0


def test_zero_is_nearly_exact_and_error_within_one_step():
    """0.0 decodes to within float32 rounding of scale*q0 (an ulp or two of the edge), not always to 0.0
    itself. The error is half a step inside the grid, but the grid is anchored at the edge
    and its step re-chosen (edge/q0), so it may stop short of the far end: values there are clipped, with
    an error up to one step (measured: up to 0.9999 step at 2 bits on random data)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    w[:, ::5] = 0.0
    for bits in (2, 3, 4, 5, 6, 8):
        words, scales, biases = quant.quantize(w, 64, bits)
        out = quant.dequantize(words, scales, biases, 64, bits)
        edge = np.repeat(np.abs(biases), 64, axis=1)[:, ::5]
        assert np.all(np.abs(out[:, ::5]) <= 2 * np.spacing(edge))
        step = np.repeat(np.abs(scales), 64, axis=1)
        error = np.abs(out - w)
        assert np.all(error <= step * (1 + 1e-5))
        codes = quant.unpack(words, bits, 256)
        inside = (codes > 0) & (codes < 2**bits - 1)  # not at either end of the grid: never clipped
        assert np.all(error[inside] <= 0.5 * step[inside] * (1 + 1e-5) + 1e-7)
        assert np.any(error > 0.5 * step * (1 + 1e-5))  # clipping does happen


# ---- bfloat16 inputs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_bfloat16_input(bits):
    """mx.quantize of a bf16 array: codes from the float32 scale/bias, which are then stored as bf16."""
    rng = np.random.default_rng(bits)
    w_bf16 = mx.array(rng.standard_normal((16, 256)).astype(np.float32)).astype(mx.bfloat16)
    w = np.array(w_bf16.astype(mx.float32))  # bf16 -> float32 is exact
    q, s, b = mx.quantize(w_bf16, group_size=64, bits=bits)
    assert s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
    words, scales, biases = quant.quantize(w, 64, bits)
    np.testing.assert_array_equal(words, np.array(q))
    np.testing.assert_array_equal(u32(quant.to_bfloat16(scales)), u32(np.array(s.astype(mx.float32))))
    np.testing.assert_array_equal(u32(quant.to_bfloat16(biases)), u32(np.array(b.astype(mx.float32))))
    # mx.dequantize returns bf16, computed in bf16: product rounded, then sum rounded.
    d = mx.dequantize(q, s, b, group_size=64, bits=bits)
    assert d.dtype == mx.bfloat16
    ours = quant.dequantize(words, quant.to_bfloat16(scales), quant.to_bfloat16(biases), 64, bits, bfloat16=True)
    np.testing.assert_array_equal(u32(ours), u32(np.array(d.astype(mx.float32))))


def test_bfloat16_codes_use_unrounded_scales():
    """Recomputing codes from the stored (bf16) scale and bias does not always give MLX's codes."""
    rng = np.random.default_rng(0)
    w = np.array(mx.array(rng.standard_normal((64, 512)).astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    q, s, b = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=64, bits=4)
    s16 = np.repeat(np.array(s.astype(mx.float32)), 64, axis=1)
    b16 = np.repeat(np.array(b.astype(mx.float32)), 64, axis=1)
    from_stored = np.clip(np.rint((w - b16) / s16), 0, 15)
    mlx_codes = quant.unpack(np.array(q), 4, 512)
    assert np.any(from_stored != mlx_codes)
    np.testing.assert_array_equal(mlx_codes, quant.quantize_groups(w, 64, 4)[0])


def test_to_bfloat16_matches_mlx():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000),
                        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, np.inf, -np.inf]]).astype(np.float32)
    theirs = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(u32(quant.to_bfloat16(x)), u32(theirs))


# ---- packing ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(2, 3, 128)).astype(np.uint32)
    words = quant.pack(codes, bits)
    assert words.shape == (2, 3, 128 * bits // 32) and words.dtype == np.uint32
    np.testing.assert_array_equal(quant.unpack(words, bits, 128), codes)


@pytest.mark.parametrize("bits", BITS)
def test_pack_layout_lsb_first_across_words(bits):
    """Code j occupies stream bits [j*bits, (j+1)*bits), stream bit i = bit i%32 of word i//32."""
    n = 32
    for j in range(n):
        codes = np.zeros((1, n), np.uint32)
        codes[0, j] = 2**bits - 1
        words = quant.pack(codes, bits)
        set_bits = [i for i in range(32 * words.shape[1]) if (int(words[0, i // 32]) >> (i % 32)) & 1]
        assert set_bits == list(range(j * bits, (j + 1) * bits))
    # a 6-bit code crossing a word boundary: code 5 holds stream bits 30..35
    if bits == 6:
        codes = np.zeros((1, n), np.uint32)
        codes[0, 5] = 0b101101
        words = quant.pack(codes, 6)
        assert words[0, 0] == 0b01 << 30 and words[0, 1] == 0b1011


def test_pack_rejects_bad_codes():
    with pytest.raises(UsageError):
        quant.pack(np.full((1, 32), 16, np.uint32), 4)  # 16 does not fit in 4 bits
    with pytest.raises(UsageError):
        quant.pack(np.full((1, 32), -1, np.int32), 4)
    with pytest.raises(UsageError):
        quant.pack(np.zeros((1, 10), np.uint32), 3)  # 30 bits is not whole words


# ---- unsupported arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [0, 7, 9, 16])
def test_unsupported_bits(bits):
    with pytest.raises(UsageError, match="bits"):
        quant.quantize(np.zeros((2, 64), np.float32), 64, bits)
    with pytest.raises(ValueError):  # MLX refuses these widths too
        mx.eval(mx.quantize(mx.zeros((2, 64)), group_size=64, bits=bits))


@pytest.mark.parametrize("group_size", [8, 16, 48, 256])
def test_unsupported_group_size(group_size):
    with pytest.raises(UsageError, match="group_size"):
        quant.quantize(np.zeros((2, 768), np.float32), group_size, 4)
    with pytest.raises(UsageError, match="group_size"):
        quant.dequantize(np.zeros((2, 96), np.uint32), np.zeros((2, 1)), np.zeros((2, 1)), group_size, 4)


def test_last_dim_not_divisible():
    with pytest.raises(UsageError, match="not divisible by group_size=64"):
        quant.quantize(np.zeros((2, 96), np.float32), 64, 4)
    with pytest.raises(ValueError):
        mx.quantize(mx.zeros((2, 96)), group_size=64, bits=4)


def test_dequantize_rejects_mismatched_scales():
    words, scales, biases = quant.quantize(np.ones((2, 128), np.float32), 64, 4)
    with pytest.raises(UsageError):
        quant.dequantize(words, scales[:, :1], biases[:, :1], 64, 4)


# ---- the backend check -----------------------------------------------------------------------------------------
def test_check_backend_all_ok_here():
    checks = quant.check_backend()
    assert [c.bits for c in checks] == [2, 3, 4, 5, 6, 8]
    assert all(c.ok for c in checks), quant.report(checks)
    assert all(0 <= c.max_abs_error < c.tolerance for c in checks)
    text = quant.report(checks)
    assert "all widths ok" in text and len(text.splitlines()) == 2 + 6 + 1


def test_check_backend_flags_a_broken_width(monkeypatch):
    """A kernel that returns garbage at 6 bits (as the ROCm fork's tiled path did) is caught, and only it."""
    real = mx.quantized_matmul

    def broken(x, w, scales, biases, transpose=True, group_size=64, bits=4, **kwargs):
        out = real(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, **kwargs)
        if bits == 6:  # "uninitialised memory": noise of the output's own magnitude
            return mx.random.normal(out.shape, key=mx.random.key(0)) * 10
        return out

    monkeypatch.setattr(mx, "quantized_matmul", broken)
    checks = quant.check_backend()
    assert [c.bits for c in checks if not c.ok] == [6]
    assert "WRONG at bits 6" in quant.report(checks)


@pytest.mark.parametrize("failure", ["nan", "raise", "prefill only"])
def test_check_backend_other_failures(monkeypatch, failure):
    real = mx.quantized_matmul

    def broken(x, w, scales, biases, transpose=True, group_size=64, bits=4, **kwargs):
        out = real(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, **kwargs)
        if bits != 3:
            return out
        if failure == "nan":
            return mx.where(mx.arange(out.shape[-1]) == 7, mx.array(float("nan")), out)
        if failure == "raise":
            raise ValueError("3-bit quantized matmul not implemented")
        return out * 0 if x.shape[0] > 1 else out  # only the tiled (many-token) path is wrong

    monkeypatch.setattr(mx, "quantized_matmul", broken)
    checks = quant.check_backend(bits=(3, 4))
    assert [c.ok for c in checks] == [False, True]
    if failure == "raise":
        assert "not implemented" in checks[0].error
