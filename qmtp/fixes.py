"""The two load-time fixes Qwen3-Next-family checkpoints need, as named, switchable transforms.

* ``"norm"``: zero-centred RMSNorm. The checkpoint stores w and the model applies (1 + w). qmtp's RMSNorm
  multiplies by its weight as stored in the module, so the fix adds 1 (in float32) to exactly the
  zero-centred norms. The gated norm inside linear attention (`linear_attn.norm`) is a plain weight and is
  never shifted.
* ``"conv"``: the depthwise conv1d kernel is stored in PyTorch's [C, 1, K]; MLX's conv1d wants
  [C_out, K, C_in / groups] = [C, K, 1].

A checkpoint qmtp wrote records the fixes it already carries (`qmtp.fixes` in the safetensors metadata),
so loading or converting it never applies one twice. A checkpoint from mlx-lm carries no record; mlx-lm
shifts the norms exactly when it moves the conv axis, so a conv kernel already in MLX layout means both
fixes are in the weights.
"""

from __future__ import annotations

import json

from .errors import UsageError

FIXES = ("norm", "conv")
DEFAULT_FIXES = FIXES
METADATA_KEY = "qmtp.fixes"

# Internal-name suffixes of the zero-centred norms (trunk layers, final norm, and the head's).
ZERO_CENTRED_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".self_attn.q_norm.weight",
    ".self_attn.k_norm.weight",
)
ZERO_CENTRED_NAMES = (
    "norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
)


# What the weights do without each fix, for the warning `qmtp.load` gives when one is left out.
WITHOUT = {
    "norm": 'norms used as stored (w, not 1 + w): output will be incoherent; apply the "norm" fix for the '
            "model as trained",
    "conv": 'conv kernels kept in PyTorch layout [C, 1, K], which MLX\'s conv1d will refuse: apply the "conv" '
            "fix to run the model",
}


def validate(fixes) -> tuple[str, ...]:
    """The requested fixes as a tuple of names; a single name (`"norm"`) means that one fix."""
    if isinstance(fixes, str):
        fixes = (fixes,)
    try:
        fixes = tuple(fixes)
    except TypeError:
        raise UsageError(f"fixes={fixes!r}: give a fix name or a sequence of them, from {FIXES}") from None
    for f in fixes:
        if not isinstance(f, str):
            raise UsageError(f"fixes={fixes!r}: {f!r} is not a fix name (a string); the fixes are {FIXES}")
        if f not in FIXES:
            raise UsageError(f"unknown fix {f!r}; the fixes are {FIXES}")
    return fixes


def is_zero_centred_norm(name: str) -> bool:
    """True for the norms stored as w and applied as 1 + w (internal names)."""
    return name in ZERO_CENTRED_NAMES or name.endswith(ZERO_CENTRED_SUFFIXES)


def is_conv_kernel(name: str) -> bool:
    return name.endswith(".linear_attn.conv1d.weight")


def stored_conv_shape(ckpt, plan) -> tuple[int, ...] | None:
    """The shape a checkpoint stores its first conv kernel in (None without linear-attention layers): its
    layout tells whether the fixes were applied already."""
    return next((ckpt.infos[r.sources[0]].shape for n, r in plan.recipes.items() if is_conv_kernel(n)), None)


def shift_norm(w):
    """Stored w -> effective 1 + w, computed in float32, returned in w's dtype."""
    import mlx.core as mx

    return (w.astype(mx.float32) + 1.0).astype(w.dtype)


def conv_to_mlx(w):
    """[C, 1, K] (PyTorch depthwise kernel) -> [C, K, 1] (MLX conv1d)."""
    return w.moveaxis(2, 1)


def apply(name: str, w, fixes: tuple[str, ...]):
    """Apply the requested fixes that concern tensor `name`."""
    if "norm" in fixes and is_zero_centred_norm(name):
        return shift_norm(w)
    if "conv" in fixes and is_conv_kernel(name):
        return conv_to_mlx(w)
    return w


def recorded(metadata: dict[str, str]) -> tuple[str, ...] | None:
    """Fixes recorded by a qmtp-written file, or None if the file carries no record."""
    if METADATA_KEY not in metadata:
        return None
    return validate(json.loads(metadata[METADATA_KEY]))


def already_applied(metadata: dict[str, str], conv_shape: tuple[int, ...] | None) -> tuple[str, ...]:
    """Which fixes the stored weights already carry.

    The record written by qmtp decides; without one, a conv kernel in MLX layout ([C, K, 1]) marks an
    mlx-lm conversion, which shifted the norms in the same pass.
    """
    record = recorded(metadata)
    if record is not None:
        return record
    if conv_shape is not None and len(conv_shape) == 3 and conv_shape[-1] == 1 and conv_shape[1] != 1:
        return FIXES
    return ()


def still_needed(carried: tuple[str, ...], has_conv: bool) -> tuple[str, ...]:
    """The fixes weights carrying `carried` still lack (the conv fix only where there are conv kernels)."""
    return tuple(f for f in FIXES if f not in carried and (f != "conv" or has_conv))


def to_apply(requested, metadata: dict[str, str], conv_shape) -> tuple[str, ...]:
    """The requested fixes minus those already in the weights: never a second +1."""
    done = already_applied(metadata, conv_shape)
    return tuple(f for f in validate(requested) if f not in done)
