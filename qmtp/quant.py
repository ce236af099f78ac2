"""MLX's affine quantization, re-derived in numpy.

`mx.quantize(w, group_size, bits)` turns a float matrix into three arrays: packed integer codes, one scale
and one bias per group. This module computes the same three arrays with plain numpy, one step per line, so
a chapter can show *why* a 4-bit expert weight decodes to the value it does, and so a user on an unusual
backend (the ROCm fork whose 6-bit quantized matmul once returned uninitialised memory) can check the
installed MLX against arithmetic that does not depend on any kernel: see `check_backend`.

The reference is bit-exact: on mlx 0.32.4 (CPU) `quantize` gives the same uint32 words, scales and biases
as `mx.quantize`, and `dequantize` the same floats as `mx.dequantize`, for every width and group size
(tests/test_quant.py).

The algorithm, per group of `group_size` consecutive elements along the last axis, all in float32:

    n     = 2**bits - 1                         the largest code
    scale = max((max - min) / n, 1e-7)          the step; 1e-7 keeps constant groups finite
    edge  = min if |min| > |max| else max       the value of largest magnitude ...
    scale = +scale if |min| > |max| else -scale ... and the step signed so that code 0 decodes to it
    q0    = round(edge / scale)                 where zero falls, in steps from the edge (-q0 >= 0)
    if q0 != 0:  scale = edge / q0, bias = edge nudge the step so that code -q0 decodes to 0.0
    else:        bias = 0                        (scale stays as it was)
    code  = clip(round((w - bias) / scale), 0, n)
    w~    = scale * code + bias                  what dequantize returns

Code 0 decodes to the edge exactly (it is the bias). Code -q0 decodes to 0.0 in exact arithmetic; in
float32, edge/q0 is rounded, so it decodes to within an ulp or two of the edge's magnitude (2e-7 for an
edge of 2.8), not always to 0.0 itself. The anchoring has a price: re-choosing the step as edge/q0 can
shorten the grid, which then stops short of the group's other extreme. Values there are clipped to the
last code, with an error of up to one step instead of half a step (measured: 0.9999 step at 2 bits).

`round` is round-half-to-even everywhere (numpy's `np.rint`, C's `rint`). The codes are computed with the
float32 scale and bias *before* these are cast to the input's dtype, which matters for bf16 inputs: see
`quantize`.

Checked against MLX in tests/test_quant.py. Three cases the published description of mx.quantize leaves out
(bits=1, tiny constant groups, bfloat16 scales) are in chapter 4 and in `quantize`'s own comments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import UsageError

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
"""Widths mx.quantize accepts in affine mode. The published description stops at 2, but MLX accepts 1 too."""

SUPPORTED_GROUP_SIZES = (32, 64, 128)

EPS = np.float32(1e-7)
"""The smallest step: a constant group (max == min) gets scale 1e-7 instead of 0."""


def _check(bits: int, group_size: int | None = None, last_dim: int | None = None) -> None:
    if bits not in SUPPORTED_BITS:
        raise UsageError(f"bits={bits} is not supported; MLX affine quantization takes bits in {SUPPORTED_BITS}")
    if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
        raise UsageError(
            f"group_size={group_size} is not supported; MLX affine quantization takes {SUPPORTED_GROUP_SIZES}"
        )
    if last_dim is not None and group_size is not None and last_dim % group_size:
        raise UsageError(
            f"the last dimension ({last_dim}) is not divisible by group_size={group_size}; "
            f"every group must be whole"
        )


# ---- quantizing --------------------------------------------------------------------------------------------
def quantize_groups(w: np.ndarray, group_size: int = 64, bits: int = 4):
    """The unpacked result: (codes as uint32 [..., K], scales and biases in float32 [..., K/group_size]).

    Exposed separately from `quantize` so a chapter can print codes before they are packed; the scales and
    biases are the float32 values the codes were computed with (before any cast to the input's dtype).
    """
    w = np.asarray(w)
    if w.ndim < 1:
        raise UsageError("cannot quantize a scalar; give an array whose last axis holds the groups")
    _check(bits, group_size, w.shape[-1])
    K = w.shape[-1]
    # [..., K] -> [..., K/g, g]: one row per group. Every step below is float32, as in MLX.
    groups = w.astype(np.float32).reshape(*w.shape[:-1], K // group_size, group_size)
    n = np.float32(2**bits - 1)

    w_max = groups.max(axis=-1, keepdims=True)
    w_min = groups.min(axis=-1, keepdims=True)

    # The step that spreads [min, max] over n steps, floored at 1e-7 so a constant group divides safely.
    scale = np.maximum((w_max - w_min) / n, EPS)

    if bits == 1:
        # One bit is a special case in MLX (found by experiment; the published description stops at 2 bits): no edge
        # anchoring, just the plain min/max grid. Code 0 decodes to the minimum, code 1 to the maximum.
        bias = w_min
        codes = np.clip(np.rint((groups - bias) / scale), 0, n).astype(np.uint32)
        return codes.reshape(w.shape), scale[..., 0], bias[..., 0]

    # Anchor the group at its value of largest magnitude (the "edge"): code 0 decodes to the edge exactly.
    # If the minimum is larger in magnitude, codes count up from it (positive step); otherwise they count
    # down from the maximum (negative step). Ties (|min| == |max|, constant groups) take the maximum.
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.where(min_is_edge, scale, -scale)
    edge = np.where(min_is_edge, w_min, w_max)

    # How many steps from the edge to zero (q0 <= 0, as zero lies on the far side of the edge; only a
    # constant negative group, whose edge is its max, gets q0 > 0, harmlessly: all its codes are 0). If q0 is
    # not 0, re-choose the step as edge/q0: then code -q0 decodes to 0.0 (up to the rounding of edge/q0),
    # and the edge, being the bias, stays exact.
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale)
    bias = np.where(nonzero, edge, np.float32(0))

    # The codes, with the float32 scale and bias (not the ones rounded to the input's dtype).
    codes = np.clip(np.rint((groups - bias) / scale), 0, n).astype(np.uint32)
    return (
        codes.reshape(w.shape),
        scale[..., 0].astype(np.float32),
        bias[..., 0].astype(np.float32),
    )


def quantize(w: np.ndarray, group_size: int = 64, bits: int = 4):
    """Quantize along the last axis as `mx.quantize` does: returns (words uint32, scales, biases).

    `words` has shape [..., K*bits/32]; scales and biases [..., K/group_size]. The arithmetic is float32
    whatever the input dtype (see the module docstring). Scales and biases come back in float32 for a
    float32 input; for any other input they are float32 values that `mx.quantize` would round to the input
    dtype (bfloat16 or float16) when storing them. numpy has no bfloat16, so for a bf16 weight pass it as
    float32 (every bf16 is exactly a float32) and round the scales yourself, e.g. with `to_bfloat16`:
    the codes do not change.
    """
    codes, scales, biases = quantize_groups(w, group_size, bits)
    return pack(codes, bits), scales, biases


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (half to even), returned as float32.

    What `astype(bfloat16)` does in MLX: keep the top 16 bits of the float32, rounding on the bits dropped.
    """
    bits32 = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits32 >> 16) & 1
    rounded = ((bits32 + 0x7FFF + lsb) >> 16) << 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(nan, np.float32(np.nan), out)


# ---- packing -------------------------------------------------------------------------------------------------
def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes [..., K] into little-endian uint32 words [..., K*bits/32].

    Each row is one stream of bits: code j occupies bits [j*bits, (j+1)*bits) counted from the least
    significant bit of word 0. With bits in {3, 5, 6} the 32 bits of a word do not hold a whole number of
    codes, so a code may start in one word and end in the next; K*bits must be a multiple of 32.
    """
    _check(bits)
    codes = np.asarray(codes)
    K = codes.shape[-1]
    if (K * bits) % 32:
        raise UsageError(f"{K} codes of {bits} bits are {K * bits} bits, not a whole number of 32-bit words")
    if codes.size and (int(codes.max()) >= 2**bits or int(codes.min()) < 0):
        bad = int(codes.max()) if int(codes.max()) >= 2**bits else int(codes.min())
        raise UsageError(f"a code is {bad}, which does not fit in {bits} unsigned bits")
    rows = codes.reshape(-1, K).astype(np.uint8)
    # Expand each code into its bits, least significant first: [rows, K, bits] -> one stream [rows, K*bits].
    stream = ((rows[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows.shape[0], K * bits)
    # Cut the stream into bytes (bit 0 of the stream is bit 0 of byte 0), then read the bytes as
    # little-endian uint32: stream bit i ends up as bit (i % 32) of word (i // 32).
    packed = np.packbits(stream, axis=-1, bitorder="little")
    words = packed.view("<u4").astype(np.uint32)
    return words.reshape(*codes.shape[:-1], K * bits // 32)


def unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The inverse of `pack`: uint32 words [..., W] -> the first `n` codes of each row, as uint32 [..., n]."""
    _check(bits)
    words = np.asarray(words, dtype=np.uint32)
    W = words.shape[-1]
    if n * bits > W * 32:
        raise UsageError(f"{W} words hold {W * 32 // bits} codes of {bits} bits, not {n}")
    rows = words.reshape(-1, W).astype("<u4")
    stream = np.unpackbits(rows.view(np.uint8), axis=-1, bitorder="little")[:, : n * bits]
    # Reassemble each code from its `bits` consecutive stream bits, least significant first.
    weights = (1 << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    codes = (stream.reshape(rows.shape[0], n, bits).astype(np.uint32) * weights).sum(axis=-1, dtype=np.uint32)
    return codes.reshape(*words.shape[:-1], n)


# ---- dequantizing --------------------------------------------------------------------------------------------
def dequantize(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int = 64,
               bits: int = 4, bfloat16: bool = False) -> np.ndarray:
    """scale * code + bias per element, in float32: bit-identical to `mx.dequantize` for float32 scales.

    With bf16 scales and biases (numpy has no bfloat16: pass float32 arrays holding bf16 values, e.g.
    `np.array(s.astype(mx.float32))`) mx.dequantize returns bfloat16 and computes in bfloat16: the product
    scale * code is rounded to bf16, then the sum with the bias is rounded again. `bfloat16=True` does the
    same (it is not the float32 result rounded once, which differs in the last bit now and then) and returns
    the bf16 values as float32.
    """
    _check(bits, group_size)
    words = np.asarray(words, dtype=np.uint32)
    scales = np.asarray(scales, dtype=np.float32)
    biases = np.asarray(biases, dtype=np.float32)
    K = words.shape[-1] * 32 // bits
    if scales.shape != biases.shape or scales.shape[-1] * group_size != K:
        raise UsageError(
            f"{words.shape[-1]} words of {bits}-bit codes hold {K} values per row, but scales {scales.shape} "
            f"and biases {biases.shape} imply {scales.shape[-1] * group_size} at group_size={group_size}"
        )
    codes = unpack(words, bits, K).astype(np.float32)
    groups = codes.reshape(*codes.shape[:-1], K // group_size, group_size)
    if bfloat16:
        out = to_bfloat16(to_bfloat16(groups * scales[..., None]) + biases[..., None])
        return out.reshape(codes.shape)
    # Two float32 roundings (a product, then a sum), not a fused multiply-add: that is what MLX's CPU does.
    out = groups * scales[..., None] + biases[..., None]
    return out.reshape(codes.shape).astype(np.float32)


# ---- checking the installed backend ---------------------------------------------------------------------------
@dataclass
class BackendCheck:
    """One width of `check_backend`: how far mx.quantized_matmul is from the reference, and whether that is ok."""

    bits: int
    max_abs_error: float
    tolerance: float
    ok: bool
    group_size: int = 64
    error: str = ""  # the exception text, if the kernel raised instead of returning


def check_backend(bits=(2, 3, 4, 5, 6, 8), group_size: int = 64, seed: int = 0, rows: int = 128,
                  cols: int = 512, tokens=(1, 64)) -> list[BackendCheck]:
    """Run the installed MLX's quantized matmul at each width against float64 arithmetic; report the widths.

    For each width: a random float32 weight W [rows, cols] is quantized with `mx.quantize` (on the default
    device), `mx.quantized_matmul(x, Wq, scales, biases, transpose=True)` is evaluated, and the result is
    compared with x @ dequantize(Wq, scales, biases).T computed in float64 by this module's `dequantize`
    (which reads MLX's own codes, so a kernel that reads the code layout differently shows up too).

    x is tried with each row count in `tokens`: kernels pick different code paths for one token (decoding:
    a matrix-vector kernel) and for many (prefill, verification: a tiled matrix-matrix kernel; the ROCm
    fork's 6-bit fault was in the tiled path), so both are exercised. The worst error over them is reported.

    A correct float32 kernel differs from the float64 result by accumulated rounding only, at most about
    ``cols * 2**-24`` relative to ``max |x| @ |W~|.T`` (3e-5 for cols=512; typically 1e-7). The tolerance is 1e-4 of
    that magnitude: above any correct summation order, far below what a wrong kernel (uninitialised memory,
    misread 6-bit words) produces. NaN or inf in the output always fails.
    """
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    checks = []
    for b in bits:
        _check(b, group_size, cols)
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        wq, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=b)
        w_ref = dequantize(np.array(wq), np.array(scales), np.array(biases), group_size, b).astype(np.float64)
        worst, tolerance, problem = 0.0, 0.0, ""
        for m in tokens:
            x = rng.standard_normal((m, cols)).astype(np.float32)
            reference = x.astype(np.float64) @ w_ref.T
            tol = float(1e-4 * (np.abs(x.astype(np.float64)) @ np.abs(w_ref).T).max())
            try:
                got = mx.quantized_matmul(mx.array(x), wq, scales, biases, transpose=True,
                                          group_size=group_size, bits=b)
                got = np.array(got.astype(mx.float32)).astype(np.float64)
            except Exception as err:  # a backend that refuses a width fails that width; the check goes on
                worst, tolerance, problem = float("inf"), tol, f"{m} tokens: {type(err).__name__}: {err}"
                break
            if got.shape != reference.shape:
                worst, tolerance = float("inf"), tol
                problem = f"{m} tokens: shape {got.shape}, expected {reference.shape}"
                break
            diff = np.abs(got - reference)
            error = float(diff.max()) if np.all(np.isfinite(diff)) else float("inf")
            if error / tol >= (worst / tolerance if tolerance else 0.0):
                worst, tolerance = error, tol
                problem = "" if error <= tol else f"worst at {m} tokens"
        checks.append(BackendCheck(b, worst, tolerance, worst <= tolerance, group_size, problem))
    return checks


def report(checks: list[BackendCheck]) -> str:
    """A plain-text table of `check_backend`'s result, with a last line naming the widths that failed."""
    import mlx.core as mx

    lines = [
        f"mlx {mx.__version__} on {mx.default_device()}: quantized_matmul vs float64 reference",
        f"{'bits':>4}  {'group':>5}  {'max |error|':>12}  {'tolerance':>10}  result",
    ]
    for c in checks:
        result = "ok" if c.ok else "WRONG" + (f" ({c.error})" if c.error else "")
        lines.append(f"{c.bits:>4}  {c.group_size:>5}  {c.max_abs_error:>12.3e}  {c.tolerance:>10.3e}  {result}")
    bad = [c.bits for c in checks if not c.ok]
    lines.append("all widths ok" if not bad else
                 f"WRONG at bits {', '.join(map(str, bad))}: do not use these widths with this MLX build")
    return "\n".join(lines)


class simulated_fault:
    """A stand-in for a broken backend, for demonstration only: inside `with simulated_fault(6):`,
    `mx.quantized_matmul` at that width returns garbage of the right shape, as the ROCm fork's tiled 6-bit
    path did (it handled only 4 and 8 bits and returned uninitialised memory for 6). Nothing else changes."""

    def __init__(self, bits: int = 6, seed: int = 0):
        self.bits, self.seed = bits, seed

    def __enter__(self):
        import mlx.core as mx

        self._original = mx.quantized_matmul
        original, bits, rng = self._original, self.bits, np.random.default_rng(self.seed)

        def faulty(x, w, scales, biases=None, transpose=True, group_size=64, bits_=None, **kw):
            width = kw.pop("bits", bits_)
            out = original(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=width, **kw)
            if width == bits:
                return mx.array(rng.standard_normal(out.shape).astype(np.float32) * 1e3).astype(out.dtype)
            return out

        mx.quantized_matmul = faulty
        return self

    def __exit__(self, *exc):
        import mlx.core as mx

        mx.quantized_matmul = self._original
        return False


if __name__ == "__main__":  # python -m qmtp.quant
    print(report(check_backend()))
