"""The widest matrix product of a decode step, spread over the CPU's cores.

MLX's CPU backend computes one operation on one core, and each stream has its own thread. A decode step is
a chain of operations that depend on each other, so most of it runs on one core whatever the machine has.
lm_head is the exception worth taking: it is the largest single weight a step reads (248,320 x 2,048 in
Qwen3.6-35B-A3B, about a sixth of the active weights), and its output rows are independent. Cut into
blocks of rows, one block per stream, it runs on that many cores at once, and concatenating the blocks
gives exactly the logits of the whole (each row is the same dot products, in the same order).

Only on the CPU (an accelerator runs one operation on all of its cores already) and only for weights
large enough that the gain exceeds the cost of a few more operations (`MIN_WEIGHTS`). A float weight is not
split when MLX multiplies with OpenBLAS (`qmtp.blas`): OpenBLAS picks its kernels by the shape of the
product, so a block's dot products are rounded differently from the whole's, and the logits would no
longer be exactly the same (MLX's own quantized kernels and the reference BLAS have no such dependence).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from . import blas

MIN_WEIGHTS = 1 << 24  # below this many weights (e.g. the tiny model's 1024 x 64) one core is quicker
MAX_STREAMS = 4


class RowSplitLinear:
    """Apply an `nn.Linear` or `nn.QuantizedLinear` (no bias) as row blocks on separate CPU streams."""

    def __init__(self, linear: nn.Module, parts: int):
        self.linear = linear
        # thread-local: MLX binds a stream to the thread that made it, and a model may decode on any thread
        self.streams = [mx.new_thread_local_stream(mx.cpu) for _ in range(parts)]
        rows = linear.weight.shape[0]
        bounds = [rows * i // parts for i in range(parts + 1)]
        self.blocks = [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def __call__(self, x: mx.array) -> mx.array:
        linear = self.linear
        outputs = []
        for block, stream in zip(self.blocks, self.streams):
            if isinstance(linear, nn.QuantizedLinear):
                outputs.append(mx.quantized_matmul(
                    x, linear.weight[block], linear.scales[block], linear.biases[block], transpose=True,
                    group_size=linear.group_size, bits=linear.bits, mode=linear.mode, stream=stream))
            else:
                outputs.append(mx.matmul(x, linear.weight[block].T, stream=stream))
        return mx.concatenate(outputs, axis=-1)


def split_lm_head(linear: nn.Module, parts: int | None = None) -> RowSplitLinear | None:
    """A RowSplitLinear for `linear` when splitting pays (CPU, several cores, a wide weight), else None.
    `QMTP_CORES=1` turns it off; `QMTP_CORES=N` sets the number of blocks."""
    if mx.default_device() != mx.cpu or "bias" in linear:
        return None
    if not isinstance(linear, nn.QuantizedLinear) and blas.loaded:
        return None
    if parts is None:
        parts = int(os.environ.get("QMTP_CORES", 0)) or min(MAX_STREAMS, os.cpu_count() or 1)
    rows = linear.weight.shape[0]
    cols = linear.weight.shape[1] * 32 // linear.bits if isinstance(linear, nn.QuantizedLinear) else linear.weight.shape[1]
    if parts < 2 or rows * cols < MIN_WEIGHTS or rows < parts:
        return None
    return RowSplitLinear(linear, parts)
