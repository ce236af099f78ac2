"""What quantization costs: held-out perplexity and MTP acceptance by trunk width and by head width.

Each variant is a real conversion (`qmtp.convert`) into a temporary folder, loaded back with `qmtp.load`, so
the numbers are those of the quantized kernels a user would run, not of a simulation.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from ..convert import convert
from ..loading import load
from .evaluate import acceptance, text_metrics


def measure_variant(src, texts: list[str], prompts: list[list[int]], max_tokens: int = 40, **convert_options) -> dict:
    """Convert `src` with `convert_options`, then measure the result; returns sizes and metrics."""
    with tempfile.TemporaryDirectory(prefix="qmtp-quality-") as tmp:
        dst = Path(tmp) / "converted"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            conversion = convert(src, dst, progress=False, **convert_options)
        model = load(dst)
        metrics = text_metrics(model, texts)
        accepted = acceptance(model, prompts, n_draft=2, max_tokens=max_tokens)
    return {
        "trunk_bytes": conversion.trunk_bytes,
        "head_bytes": conversion.head_bytes,
        "accuracy": metrics.accuracy,
        "perplexity": metrics.perplexity,
        "head_accuracy": metrics.head_accuracy,
        "acceptance_n_draft_2": accepted["rate"],
    }


def by_trunk_width(src, texts, prompts, widths=(8, 6, 5, 4, 3, 2), group_size: int = 64, **options) -> dict:
    """Trunk at each width, head kept bf16."""
    return {bits: measure_variant(src, texts, prompts, bits=bits, group_size=group_size, **options) for bits in widths}


def by_head_width(src, texts, prompts, widths=(None, 8, 6, 4, 3), trunk_bits: int = 8, group_size: int = 64,
                  **options) -> dict:
    """Head at each width (None: bf16), trunk at `trunk_bits`."""
    return {("bf16" if w is None else w): measure_variant(src, texts, prompts, bits=trunk_bits, mtp_bits=w,
                                                            group_size=group_size, **options) for w in widths}
