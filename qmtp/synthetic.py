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
import zlib
from pathlib import Path

import numpy as np

from . import fixes as fixes_mod
from .checkpoint import DTYPES, INDEX_NAME, write_safetensors
from .config import ModelConfig
from .errors import UsageError
from .layout import expected_shapes

LAYOUTS = ("released", "text", "next")


def small_config(**overrides) -> ModelConfig:
    """A config of the real architecture at toy widths: 4 layers (3 linear + 1 full), 8 experts top-2."""
    values = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
    )
    values.update(overrides)
    return ModelConfig(**values)


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
    if name.endswith("conv1d.weight"):
        C, K, _ = shape
        return rng.normal(0.0, K**-0.5, (C, 1, K)).astype(np.float32)
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


def random_weights(config: ModelConfig, seed: int = 0, head: bool = True) -> dict[str, np.ndarray]:
    """All internal tensors (as stored: zero-centred norms, [C, 1, K] conv) in float32."""
    return {n: stored_value(n, s, seed) for n, s in expected_shapes(config, head=head).items()}


# ---- internal names -> stored names of a layout --------------------------------------------------------------
def _stored_entries(config: ModelConfig, layout: str, seed: int, head: bool, head_experts: bool,
                    head_experts_fused: bool):
    """[(stored name, shape, produce float32 array)] in a deterministic order."""
    prefix = "model.language_model." if layout == "released" else "model."
    shapes = expected_shapes(config, head=head)
    if head and not head_experts:
        for n in [n for n in shapes if n.startswith("mtp.") and ".experts." in n]:
            del shapes[n]

    def value(name):
        return lambda: stored_value(name, shapes[name], seed)

    def stored_shape(name):
        s = shapes[name]
        return (s[0], 1, s[1]) if name.endswith("conv1d.weight") else s

    entries = []
    done = set()
    for name in shapes:
        if name in done:
            continue
        is_head = name.startswith("mtp.")
        out_name = name if is_head or name == "lm_head.weight" else prefix + name
        if ".mlp.experts." in name:
            mlp = name.split(".experts.")[0]
            gate, up, down = (f"{mlp}.experts.{p}_proj.weight" for p in ("gate", "up", "down"))
            done.update((gate, up, down))
            stem = mlp if is_head else prefix + mlp
            fused = head_experts_fused if is_head else layout == "released"
            if fused:
                entries.append((f"{stem}.experts.gate_up_proj", (shapes[gate][0], 2 * shapes[gate][1], shapes[gate][2]),
                                lambda g=gate, u=up: np.concatenate([value(g)(), value(u)()], axis=1)))
                entries.append((f"{stem}.experts.down_proj", shapes[down], value(down)))
            else:
                for e in range(config.num_experts):
                    for proj, full in (("gate", gate), ("up", up), ("down", down)):
                        entries.append((f"{stem}.experts.{e}.{proj}_proj.weight", shapes[full][1:],
                                        lambda f=full, e=e: expert_value(f, e, shapes[f][1:], seed)))
            continue
        if layout == "next" and name.endswith("linear_attn.in_proj_qkv.weight"):
            attn = name[: -len(".in_proj_qkv.weight")]
            z = f"{attn}.in_proj_z.weight"
            b, a = f"{attn}.in_proj_b.weight", f"{attn}.in_proj_a.weight"
            done.update((name, z, b, a))
            rows = shapes[name][0] + shapes[z][0]
            entries.append((prefix + f"{attn}.in_proj_qkvz.weight", (rows, config.hidden_size),
                            lambda n=name, z=z: fuse_qkvz(value(n)(), value(z)(), config)))
            entries.append((prefix + f"{attn}.in_proj_ba.weight", (2 * config.linear_num_value_heads, config.hidden_size),
                            lambda b=b, a=a: fuse_ba(value(b)(), value(a)(), config)))
            continue
        done.add(name)
        entries.append((out_name, stored_shape(name), value(name)))
    return entries


def fuse_qkvz(qkv: np.ndarray, z: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Split-layout q|k|v and z rows -> Qwen3-Next's rows grouped per key head [q_g, k_g, v_g, z_g]."""
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    r, dv = config.linear_num_value_heads // nk, config.linear_value_head_dim
    H = qkv.shape[1]
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    groups = [q.reshape(nk, dk, H), k.reshape(nk, dk, H), v.reshape(nk, r * dv, H), z.reshape(nk, r * dv, H)]
    return np.concatenate(groups, axis=1).reshape(-1, H)


def fuse_ba(b: np.ndarray, a: np.ndarray, config: ModelConfig) -> np.ndarray:
    nk = config.linear_num_key_heads
    r = config.linear_num_value_heads // nk
    H = b.shape[1]
    return np.concatenate([b.reshape(nk, r, H), a.reshape(nk, r, H)], axis=1).reshape(-1, H)


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


def _to_bytes(array: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        import mlx.core as mx

        return np.asarray(mx.array(array).astype(mx.bfloat16).view(mx.uint16)).tobytes()
    return np.ascontiguousarray(array, dtype=DTYPES[dtype][0]).tobytes()


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
) -> Path:
    """Write config.json and safetensors (sharded with an index when `shards` > 1); returns the directory.

    `head_experts=False` writes a head without its routed experts, as crippled conversions ship it.
    `sparse=True` writes real headers over holes: a checkpoint of the real model's size in no disk space.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if dtype not in ("BF16", "F16", "F32"):
        raise UsageError(f"dtype {dtype!r}: use BF16, F16 or F32")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_config_json(config, layout), indent=2))

    entries = [
        (name, dtype, shape, (lambda p=produce: _to_bytes(p(), dtype)))
        for name, shape, produce in _stored_entries(config, layout, seed, head and config.has_mtp, head_experts, head_experts_fused)
    ]
    if shards <= 1:
        write_safetensors(directory / "model.safetensors", entries, {"format": "pt"}, sparse=sparse)
        return directory

    sizes = [int(np.prod(e[2], dtype=np.int64)) * DTYPES[dtype][2] for e in entries]
    target = sum(sizes) / shards
    groups, current, filled = [], [], 0
    for entry, size in zip(entries, sizes):
        if current and filled + size > target * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(current)
            current = []
        current.append(entry)
        filled += size
    groups.append(current)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(directory / shard, group, {"format": "pt"}, sparse=sparse)
        weight_map.update({e[0]: shard for e in group})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return directory
