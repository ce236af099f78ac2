"""Writing a Model back in the released Qwen3.6 layout (how the bundled tiny model is shipped).

The export undoes the two fixes, so that loading the file exercises exactly the code path of the real
checkpoint: zero-centred norms are stored as (effective - 1), conv kernels as PyTorch's [C, 1, K], weights
in bfloat16, keys under `model.language_model.` and `mtp.`, experts fused as `gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .. import fixes as fixes_mod
from ..checkpoint import array_bytes, write_safetensors
from ..conventions import conv_to_torch, is_conv_kernel
from ..convert import replace_directory
from ..layout import stored_entries
from ..model import Model
from ..chat import GENERATION_CONFIG, TEMPLATE_FILE
from ..tokenizer import CONFIG_FILE, TOKENIZER_FILE

# What a model folder needs beside its weights to be talked to; the last two only once it has a chat format
TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, GENERATION_CONFIG)


def stored_form(name: str, w: mx.array) -> np.ndarray:
    """Effective weight -> the checkpoint's convention (float32 numpy)."""
    w = w.astype(mx.float32)
    if fixes_mod.is_zero_centred_norm(name):
        w = w - 1.0
    elif is_conv_kernel(name):
        w = conv_to_torch(w)
    return np.array(w)


def export_released(model: Model, dest: str | Path, training_dir: str | Path | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer to `dest` (replaced atomically)."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params = dict(tree_flatten(model.parameters()))
    config = model.config
    (tmp / "config.json").write_text(json.dumps(config.to_released_dict(), indent=2) + "\n")
    entries = [
        (name, "BF16", shape, lambda p=produce: array_bytes(p(), "BF16"))
        for name, shape, produce in stored_entries(
            config, "released", lambda n, shape: stored_form(n, params[n]), head=model.mtp is not None,
            head_experts=model.mtp is not None and model.mtp.has_routed_experts, head_experts_fused=True,
        )
    ]
    write_safetensors(tmp / "model.safetensors", entries, {"format": "pt"})
    if training_dir is not None:
        data_dir = Path(training_dir) / "data"
        for name in TOKENIZER_FILES:
            if (data_dir / name).exists():
                shutil.copy2(data_dir / name, tmp / name)
        curve = Path(training_dir) / "loss_curve.json"
        if curve.exists():
            shutil.copy2(curve, tmp / "loss_curve.json")
    replace_directory(tmp, dest)
    return dest
