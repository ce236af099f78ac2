"""RMS normalisation, plain and gated.

`RMSNorm` multiplies by its weight as it holds it. The zero-centred convention of the checkpoint (stored w,
applied 1 + w) is handled once, at load time, by `qmtp.fixes`; loading with `fixes=()` leaves w ~ 0 in place
and shows what forgetting the fix does. Both norms compute in float32, as the reference implementation does.
"""

import mlx.core as mx
import mlx.nn as nn


def rms_normalise(x: mx.array, eps: float) -> mx.array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """y = weight * x / rms(x)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = self.weight.astype(mx.float32) * rms_normalise(x, self.eps)
        return y.astype(x.dtype)


class GatedRMSNorm(RMSNorm):
    """y = weight * rmsnorm(x) * silu(z): the output norm of gated DeltaNet (plain weight, never shifted)."""

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        normed = super().__call__(x)
        return (normed.astype(mx.float32) * nn.silu(z.astype(mx.float32))).astype(x.dtype)
