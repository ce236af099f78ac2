"""What a checkpoint holds, read from its headers alone (chapter 1)."""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint import Checkpoint
from ..config import ModelConfig
from ..layout import plan
from ..loading import BUNDLED_MODEL, resolve_path
from ..sizes import CATEGORIES, category


def model_path(path=None) -> Path:
    """The model the chapters use: `path`, else $QMTP_MODEL, else the bundled tiny model."""
    return resolve_path(path)


def describe(path) -> str:
    """Which model, then (on a second line, to fit a page) its shape, parameters and bytes on disk."""
    path = Path(path)
    config = ModelConfig.from_file(path)
    ckpt = Checkpoint(path)
    params = sum(i.numel for i in ckpt.infos.values())
    which = "the bundled tiny model" if path.resolve() == BUNDLED_MODEL.resolve() else f"the checkpoint in {path}"
    source = " ($QMTP_MODEL)" if os.environ.get("QMTP_MODEL") and which != "the bundled tiny model" else ""
    return (f"Using {which}{source}:\n  {config.num_hidden_layers} layers, hidden size {config.hidden_size}, "
            f"{config.num_experts} experts (top-{config.num_experts_per_tok}), vocabulary {config.vocab_size};\n"
            f"  {params / 1e6:,.1f} M parameters in {ckpt.nbytes / 1e6:,.1f} MB.")


def by_category(path) -> list[dict]:
    """Tensors, parameters and stored bytes per category, trunk and head apart (headers only)."""
    path = Path(path)
    config = ModelConfig.from_file(path)
    ckpt = Checkpoint(path)
    rows = {(part, c): {"part": part, "category": c, "tensors": 0, "parameters": 0, "bytes": 0}
            for part in ("trunk", "head") for c in CATEGORIES}
    counted: set[str] = set()
    for name, recipe in plan(ckpt, config).recipes.items():
        infos = [ckpt.infos[s] for s in recipe.sources]
        shape = infos[0].shape if recipe.op != "stack" else (len(infos),) + infos[0].shape
        row = rows[("head" if name.startswith("mtp.") else "trunk", category(name, shape))]
        new = [i for i in infos if i.name not in counted]  # a fused gate_up tensor feeds two recipes
        counted.update(i.name for i in new)
        row["tensors"] += len(new)
        row["parameters"] += sum(i.numel for i in new)
        row["bytes"] += sum(i.nbytes for i in new)
    return [r for r in rows.values() if r["parameters"]]


def markdown_table(rows: list[dict], columns: list[str], formats: dict | None = None) -> str:
    """Rows of dicts as a Markdown table (for IPython.display.Markdown in the chapters)."""
    formats = formats or {}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [formats.get(c, "{}").format(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"


def human_count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    if n >= 1e3:
        return f"{n / 1e3:.1f} K"
    return str(int(n))


def category_table(rows: list[dict]) -> str:
    """`by_category`'s rows as a Markdown table, parameters and bytes in readable units."""
    shown = [{**r, "params": human_count(r["parameters"]), "size": human_bytes(r["bytes"])} for r in rows]
    return markdown_table(shown, ["part", "category", "tensors", "params", "size"])


def count_table(counts: dict[str, int]) -> str:
    """`qmtp.sizes.parameter_counts` as a Markdown table, each count under its plain-words label."""
    from ..sizes import PARAMETER_COUNT_LABELS

    rows = [{"parameters of": PARAMETER_COUNT_LABELS[k], "count": human_count(v)} for k, v in counts.items()]
    return markdown_table(rows, ["parameters of", "count"])


def variant_rows(reports: dict, card_gb: dict) -> list[dict]:
    """One row per trunk width from `qmtp.sizes.sizes` reports ({bits: report}), beside the size a model card
    states for that width (`card_gb`, {bits: GB})."""
    return [{"trunk bits": bits, "trunk GB": r.trunk_bytes / 1e9, "head GB (bf16)": r.head_bytes / 1e9,
             "total GB": r.total_bytes / 1e9, "total GiB": r.total_bytes / 2**30,
             "lemon-mlx-engine's card (GB)": card_gb[bits]} for bits, r in reports.items()]


def variant_table(rows: list[dict]) -> str:
    """`variant_rows` as a Markdown table."""
    return markdown_table(rows, list(rows[0]), {"trunk GB": "{:.1f}", "head GB (bf16)": "{:.2f}",
                                                "total GB": "{:.1f}", "total GiB": "{:.1f}"})


def tensor_listing(ckpt, prefix: str) -> list[dict]:
    """Name, dtype and shape of every tensor of `ckpt` (a `qmtp.Checkpoint`) whose name starts with `prefix`."""
    return [{"tensor": n, "dtype": i.dtype, "shape": str(list(i.shape))}
            for n, i in sorted(ckpt.infos.items()) if n.startswith(prefix)]


def listing_table(listing: list[dict]) -> str:
    """`tensor_listing` as a Markdown table."""
    return markdown_table(listing, ["tensor", "dtype", "shape"])


def metadata_table(metadata: dict[str, str]) -> str:
    """A converted file's metadata as a Markdown table: the per-tensor widths (`qmtp.quantization`) counted rather
    than listed, the source digest shortened."""
    import json

    widths = json.loads(metadata["qmtp.quantization"])
    shown = {k: v for k, v in metadata.items() if k != "qmtp.quantization"}
    shown["qmtp.quantization"] = f"{len(widths)} entries, one per stored weight"
    if "qmtp.source_digest" in shown:
        shown["qmtp.source_digest"] = shown["qmtp.source_digest"][:16] + "…"
    return markdown_table([{"key": k, "value": f"`{v}`"} for k, v in shown.items()], ["key", "value"])
