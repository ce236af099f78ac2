"""What quantization costs: held-out perplexity and MTP acceptance by trunk width and by head width.

Each variant is a real conversion (`qmtp.convert`) into a temporary folder, loaded back with `qmtp.load`, so
the numbers are those of the quantized kernels a user would run, not of a simulation. At full size, where
converting the whole model once per width would take hours and hundreds of GB, `by_trunk_width_in_memory` rounds
the weights of a partial model (its first layers, `qmtp.load(path, layers=k)`) in memory instead: the values a
quantized kernel multiplies by, without writing a file (`qmtp.book.budget`).
"""

from __future__ import annotations

import gc
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..conventions import is_conv_kernel, is_head, is_router
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
        "drafts_n_draft_2": sum(accepted["drafted"]),  # what the rate is counted over (its sampling error)
    }


def by_trunk_width(src, texts, prompts, widths=(8, 6, 5, 4, 3, 2), group_size: int = 64, **options) -> dict:
    """Trunk at each width, head kept bf16."""
    return {bits: measure_variant(src, texts, prompts, bits=bits, group_size=group_size, **options) for bits in widths}


def by_head_width(src, texts, prompts, widths=(None, 8, 6, 4, 3), trunk_bits: int = 8, group_size: int = 64,
                  **options) -> dict:
    """Head at each width (None: bf16), trunk at `trunk_bits`."""
    return {("bf16" if w is None else w): measure_variant(src, texts, prompts, bits=trunk_bits, mtp_bits=w,
                                                            group_size=group_size, **options) for w in widths}


def round_trunk(model, bits: int, group_size: int = 64, router_bits: int = 8):
    """Round every trunk matrix of `model` in place to `bits` (router gates to `router_bits`), as MLX's affine
    quantization stores it: mx.quantize then mx.dequantize. Norms, conv kernels and the head are left alone.
    One tensor at a time, each replaced as soon as it is rounded, so the model is never held twice."""
    params = dict(tree_flatten(model.parameters()))
    for name in list(params):
        w = params.pop(name)
        if w.ndim < 2 or is_conv_kernel(name) or is_head(name) or w.shape[-1] % group_size:
            continue
        width = router_bits if is_router(name) else bits
        rounded = mx.dequantize(*mx.quantize(w, group_size=group_size, bits=width), group_size=group_size,
                                bits=width).astype(w.dtype)
        mx.eval(rounded)
        del w
        model.update(tree_unflatten([(name, rounded)]))
        mx.clear_cache()  # the replaced tensor and the quantizer's temporaries
    return model


def by_trunk_width_in_memory(make_model, texts, widths=(8, 6, 4, 3, 2), group_size: int = 64,
                             length: int = 128) -> dict:
    """Held-out accuracy and perplexity of the model `make_model()` returns, unrounded ("bf16") and with its trunk
    rounded to each width in memory (a fresh model per width, so one model is held at a time)."""
    out = {}
    for bits in ("bf16", *widths):
        model = make_model()
        if bits != "bf16":
            round_trunk(model, bits, group_size)
        metrics = text_metrics(model, texts, length=length)
        out[bits] = {"accuracy": metrics.accuracy, "perplexity": metrics.perplexity}
        del model
        gc.collect()
        mx.clear_cache()  # the next width's load checks the memory there is: freed buffers must be returned
    return out


def trunk_width_table(trunk: dict, source: dict) -> str:
    """`by_trunk_width`'s results ({bits: measures}) under a row for the unquantized `source` ({"trunk_bytes",
    "perplexity", "acceptance_n_draft_2"}), as a Markdown table."""
    from .inventory import markdown_table

    rows = [{"trunk bits": bits, "trunk MB": m["trunk_bytes"] / 1e6, "perplexity": m["perplexity"],
             "acceptance": m["acceptance_n_draft_2"]} for bits, m in {"bf16 (source)": source, **trunk}.items()]
    return markdown_table(rows, list(rows[0]), {"trunk MB": "{:.2f}", "perplexity": "{:.2f}", "acceptance": "{:.3f}"})


def head_width_table(head: dict) -> str:
    """`by_head_width`'s results ({width: measures}) as a Markdown table."""
    from .inventory import markdown_table

    rows = [{"head": w, "head MB": m["head_bytes"] / 1e6, "acceptance": m["acceptance_n_draft_2"]}
            for w, m in head.items()]
    return markdown_table(rows, ["head", "head MB", "acceptance"], {"head MB": "{:.2f}", "acceptance": "{:.3f}"})
