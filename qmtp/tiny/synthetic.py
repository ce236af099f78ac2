"""Random checkpoints in the released layouts, at any scale.

Tests, benchmarks and chapters need checkpoints that look exactly like the real ones (names, nesting,
fused or one-by-one experts, zero-centred norms, [C, 1, K] conv kernels) without 70 GB of downloads.
Every tensor is drawn from its own seed (derived from its name), so a tensor can be produced on its own
while a shard is streamed to disk, and the same call always writes the same bytes.

Layouts:
  "released"  Qwen3.6-35B-A3B as published: multimodal config with `text_config`, `model.language_model.*`,
              trunk experts fused (`gate_up_proj`, `down_proj`), head experts one by one
  "text"      a text-only export: flat `qwen3_5_moe_text` config, `model.*`, experts one by one
  "next"      Qwen3-Next: flat `qwen3_next` config, fused `in_proj_qkvz` / `in_proj_ba`, experts one by one
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

from .. import fixes as fixes_mod
from ..checkpoint import DTYPES, array_bytes, shard_groups, shard_name, write_index, write_safetensors
from ..config import QWEN36_35B_A3B, ModelConfig
from ..convert import side_stem
from ..conventions import is_conv_kernel, torch_conv_shape
from ..errors import UsageError
from ..layout import LAYOUTS, stored_entries
from ..loading import BUNDLED_MODEL


# ---- random tensors, in the checkpoint's own conventions -------------------------------------------------
def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def stored_value(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A random float32 tensor for internal `name`, as the checkpoint stores it.

    Zero-centred norms are stored as w ~ N(0, 0.1) (effective 1 + w); the conv kernel in PyTorch's
    [C, 1, K]; A_log as the log of decay rates in [1, 16].
    """
    if ".mlp.experts." in name:
        return np.stack([expert_value(name, e, shape[1:], seed) for e in range(shape[0])])
    rng = _rng(seed, name)
    if fixes_mod.is_zero_centred_norm(name):
        return rng.normal(0.0, 0.1, shape).astype(np.float32)
    if is_conv_kernel(name):
        return rng.normal(0.0, shape[1] ** -0.5, torch_conv_shape(shape)).astype(np.float32)
    if name.endswith(".A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith(".dt_bias"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("linear_attn.norm.weight"):
        return (1.0 + rng.normal(0.0, 0.1, shape)).astype(np.float32)
    if name == "embed_tokens.weight":
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    fan_in = shape[-1]
    return rng.normal(0.0, fan_in**-0.5, shape).astype(np.float32)


def expert_value(name: str, expert: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Expert `expert` of the stacked tensor `name`, drawn on its own so one-by-one layouts stream cheaply."""
    return _rng(seed, f"{name}#{expert}").normal(0.0, shape[-1] ** -0.5, shape).astype(np.float32)


def _config_json(config: ModelConfig, layout: str) -> dict:
    if layout == "released":
        return config.to_released_dict()
    text = config.to_text_dict()
    text["model_type"] = "qwen3_5_moe_text" if layout == "text" else "qwen3_next"
    text["architectures"] = ["Qwen3_5MoeForCausalLM" if layout == "text" else "Qwen3NextForCausalLM"]
    if layout == "next":
        text["decoder_sparse_step"] = 1
        text["mlp_only_layers"] = []
        text["intermediate_size"] = config.moe_intermediate_size * 4
        # Qwen3-Next configs predate rope_parameters: rope fields sit at the top level.
        text["rope_theta"] = config.rope_theta
        text["partial_rotary_factor"] = config.partial_rotary_factor
        del text["rope_parameters"]
    return text


# A few tensors of the release's vision tower, at their real shapes: loaders must skip them.
VISION_CONFIG = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                 "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2048}
VISION_TENSORS = {
    "model.visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
    "model.visual.patch_embed.proj.bias": (1152,),
    "model.visual.blocks.0.norm1.weight": (1152,),
    "model.visual.blocks.0.attn.qkv.weight": (3456, 1152),
    "model.visual.merger.linear_fc2.weight": (2048, 4608),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# With seeded holes: tensors above this size are holes, as is every routed expert, whatever its size.
HOLE_BYTES = 64 << 20
SEEDED_ROWS = 4096  # embedding rows with values: more than the bundled tokenizer's vocabulary


def is_hole(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    """Whether a seeded sparse checkpoint leaves `name` a hole: routed experts and anything over HOLE_BYTES
    except lm_head (its rows all score, so argmax stays among real tokens only if all are seeded)."""
    if name == "lm_head.weight":
        return False
    nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][2]
    return ".mlp.experts." in name or nbytes > HOLE_BYTES


def _seeded_or_hole(name, shape, produce, dtype, seed):
    if not is_hole(name, shape, dtype):
        return produce
    if name.endswith("embed_tokens.weight"):
        rows = (min(SEEDED_ROWS, shape[0]),) + tuple(shape[1:])
        return lambda: array_bytes(stored_value("embed_tokens.weight", rows, seed), dtype)
    return None


def write_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    layout: str = "released",
    seed: int = 0,
    dtype: str = "BF16",
    shards: int = 1,
    head: bool = True,
    head_experts: bool = True,
    head_experts_fused: bool = False,
    sparse: bool = False,
    seeded: bool = False,
    vision: bool = False,
    tokenizer: bool = False,
    progress: bool = False,
) -> Path:
    """Write config.json and safetensors (sharded with an index when `shards` > 1); returns the directory.

    `head_experts=False` writes a head without its routed experts, as crippled conversions ship it.
    `sparse=True` writes real headers over holes: a checkpoint of the real model's size in no disk space.
    With `seeded` as well, only the big tensors are holes (`is_hole`); routers, norms, attention, shared experts,
    lm_head and the embeddings' first rows get their seeded values, so tokens route differently and decoding runs.
    `vision` adds the release's `vision_config` and a few `model.visual.*` tensors (which loaders skip);
    `tokenizer` copies the bundled tiny model's tokenizer (its ids fall in the seeded embedding rows).
    """
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if dtype not in ("BF16", "F16", "F32"):
        raise UsageError(f"dtype {dtype!r}: use BF16, F16 or F32")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw_config = _config_json(config, layout)
    if vision:
        raw_config["vision_config"] = dict(VISION_CONFIG)
    (directory / "config.json").write_text(json.dumps(raw_config, indent=2))
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copyfile(BUNDLED_MODEL / name, directory / name)

    entries = [
        (name, dtype, shape, (lambda p=produce: array_bytes(p(), dtype)))
        for name, shape, produce in stored_entries(
            config, layout, lambda n, shape: stored_value(n, shape, seed), head and config.has_mtp, head_experts,
            head_experts_fused, expert_value=lambda n, e, shape: expert_value(n, e, shape, seed),
        )
    ]
    if vision:
        entries += [(name, dtype, shape, (lambda n=name, s=shape: array_bytes(_rng(seed, n).normal(0, 0.02, s), dtype)))
                    for name, shape in VISION_TENSORS.items()]
    if sparse and seeded:
        sparse = "partial"
        entries = [(name, d, shape, _seeded_or_hole(name, shape, produce, d, seed)) for name, d, shape, produce in entries]
    if shards <= 1:
        write_safetensors(directory / "model.safetensors", entries, {"format": "pt"}, sparse=sparse)
        return directory

    sizes = [int(np.prod(e[2], dtype=np.int64)) * DTYPES[dtype][2] for e in entries]
    groups = shard_groups(sizes, shards)
    weight_map = {}
    from tqdm import tqdm

    for i, group in enumerate(tqdm(groups, desc="writing shards", unit="shard", disable=not progress), 1):
        shard = shard_name(i, len(groups))
        write_safetensors(directory / shard, [entries[j] for j in group], {"format": "pt"}, sparse=sparse)
        weight_map.update({entries[j][0]: shard for j in group})
    write_index(directory, weight_map, sum(sizes))
    return directory


# What `python -m qmtp synthetic --preset` writes: the release as published (26 shards, vision tensors, a
# tokenizer), and the same layout at real widths with fewer layers and experts, for tests that must always run.
PRESETS = {
    "qwen3.6-35b-a3b": dict(config=QWEN36_35B_A3B, shards=26),
    "qwen3.6-35b-a3b-reduced": dict(config=QWEN36_35B_A3B.replace(num_hidden_layers=4, layer_types=[], num_experts=16), shards=3),
}


def stored_bytes(config: ModelConfig, sparse: bool, dtype: str = "BF16") -> int:
    """Disk blocks a preset takes: every tensor, or with `sparse` only the seeded ones (the holes take none)."""
    total = 0
    for name, shape, _ in stored_entries(config, "released", lambda n, s: None, config.has_mtp):
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][2]
        if sparse and is_hole(name, shape, dtype):
            nbytes = nbytes * min(SEEDED_ROWS, shape[0]) // shape[0] if name.endswith("embed_tokens.weight") else 0
        total += nbytes
    return total


def write_preset(directory: str | Path, preset: str, sparse: bool = False, seed: int = 0, progress: bool = True) -> Path:
    """Write preset `preset` into `directory`, which must not exist yet: a temporary sibling is renamed at the end,
    so an interrupted run leaves nothing half-written behind."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    directory = Path(directory)
    parent = directory.parent
    if parent.is_dir():
        _remove_stale_partials(directory)
    if directory.exists():
        raise UsageError(f"{directory}: already exists; give a new directory")
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such directory to write {directory.name} into")
    config, shards = PRESETS[preset]["config"], PRESETS[preset]["shards"]
    needed, free = stored_bytes(config, sparse), shutil.disk_usage(parent).free
    if needed > free:
        raise UsageError(f"{parent}: {preset} needs {needed / 1e9:.1f} GB on disk, {free / 1e9:.1f} GB are free"
                         + ("" if sparse else " (--sparse needs a few GB)"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{side_stem(directory.name)}.partial-", dir=parent))
    held = _hold(tmp)  # while this run lives, a later one leaves its partial folder alone
    try:
        write_checkpoint(tmp, config, layout="released", seed=seed, dtype="BF16", shards=shards, sparse=sparse,
                         seeded=sparse, vision=True, tokenizer=True, progress=progress)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; a model folder is readable by others
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(held)
    return directory


def _hold(folder: Path) -> int:
    """An exclusive lock on `folder` itself, held by this process until it closes the descriptor (or dies)."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _remove_stale_partials(directory: Path) -> None:
    """Remove the partial folders a killed run for `directory` left (a sparse full-size one is 71 GB apparent):
    those whose lock no living run holds; a run still writing keeps its own."""
    import fcntl
    import glob

    for stale in directory.parent.glob(f".{glob.escape(side_stem(directory.name))}.partial-*"):
        try:
            fd = os.open(stale, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(stale, ignore_errors=True)
        except BlockingIOError:
            pass  # another run is writing it right now
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
