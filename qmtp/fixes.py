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

from dataclasses import dataclass

from .conventions import conv_in_mlx_layout, conv_to_mlx, is_conv_kernel
from .errors import CheckpointError, UsageError

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


def stored_conv_shape(ckpt, plan) -> tuple[int, ...] | None:
    """The shape a checkpoint stores its first conv kernel in (None without linear-attention layers): its
    layout tells whether the fixes were applied already."""
    return next((ckpt.infos[r.sources[0]].shape for n, r in plan.recipes.items() if is_conv_kernel(n)), None)


def shift_norm(w):
    """Stored w -> effective 1 + w, computed in float32, returned in w's dtype."""
    import mlx.core as mx

    return (w.astype(mx.float32) + 1.0).astype(w.dtype)


def apply(name: str, w, fixes: tuple[str, ...]):
    """Apply the requested fixes that concern tensor `name`."""
    if "norm" in fixes and is_zero_centred_norm(name):
        return shift_norm(w)
    if "conv" in fixes and is_conv_kernel(name):
        return conv_to_mlx(w)
    return w


def recorded(metadata: dict[str, str], where="checkpoint") -> tuple[str, ...] | None:
    """Fixes recorded by a qmtp-written file, or None if the file carries no record; CheckpointError when the
    record is not a JSON list of fix names."""
    if METADATA_KEY not in metadata:
        return None
    from .checkpoint import parse_json

    record = parse_json(metadata[METADATA_KEY], f"{where}: metadata {METADATA_KEY}")
    if not isinstance(record, list) or not all(isinstance(f, str) and f in FIXES for f in record):
        raise CheckpointError(f"{where}: metadata {METADATA_KEY} is {metadata[METADATA_KEY][:80]!r}, not a list of "
                              f"fix names from {FIXES}: corrupt record")
    return tuple(record)


# The stored zero-centred norms: w near 0 before the fix, 1 + w near 1 after it. Their median mean lies on one
# side of this line or the other (the bundled model's are around -0.15 stored; synthetic ones 0).
SHIFTED_NORM_MEAN = 0.5


def norms_look_shifted(ckpt, plan) -> bool | None:
    """Whether the stored zero-centred norms already hold 1 + w (median of their means above 0.5); None when
    the checkpoint has none. Reads only the norms (a few kB). A norm holding NaN or Inf says nothing about the
    fixes and is left out (one would make the median NaN, and the record look contradicted): loading refuses
    it by name, and doctor names it."""
    import math

    import mlx.core as mx
    import numpy as np

    means = []
    for name, recipe in plan.recipes.items():
        if is_zero_centred_norm(name) and len(recipe.sources) == 1:
            w = ckpt.load(recipe.sources[0])
            if mx.issubdtype(w.dtype, mx.floating) and w.size:
                mean = float(mx.mean(w.astype(mx.float32)).item())
                if math.isfinite(mean):
                    means.append(mean)
    return None if not means else bool(np.median(means) > SHIFTED_NORM_MEAN)


def check_against_tensors(ckpt, plan, carried: tuple[str, ...], where) -> None:
    """Refuse a record (or an inference from the conv layout) that the tensors contradict: believing it would
    shift the norms twice, or not at all."""
    source = f"its metadata {METADATA_KEY} says {list(carried)}" if METADATA_KEY in ckpt.metadata else \
        f"its conv layout says the fixes {list(carried) or 'none'} are applied"
    mlx_conv = conv_in_mlx_layout(stored_conv_shape(ckpt, plan))
    if mlx_conv is not None and mlx_conv != ("conv" in carried):
        layout_text = "MLX layout [C, K, 1]" if mlx_conv else "PyTorch layout [C, 1, K]"
        raise CheckpointError(f"{where}: {source}, but its conv kernels are in {layout_text}; the record and the "
                              f"tensors disagree, so the file was edited or mislabelled: re-convert from the original")
    shifted = norms_look_shifted(ckpt, plan)
    if shifted is not None and shifted != ("norm" in carried):
        looks = "already shifted (1 + w, mean near 1)" if shifted else "not shifted (w, mean near 0)"
        raise CheckpointError(f"{where}: {source}, but its zero-centred norms look {looks}; the record and the "
                              f"tensors disagree, so loading would shift the norms wrongly: re-convert from the original")


def already_applied(metadata: dict[str, str], conv_shape: tuple[int, ...] | None, where="checkpoint") -> tuple[str, ...]:
    """Which fixes the stored weights already carry.

    The record written by qmtp decides; without one, a conv kernel in MLX layout ([C, K, 1]) marks an
    mlx-lm conversion, which shifted the norms in the same pass.
    """
    record = recorded(metadata, where)
    if record is not None:
        return record
    if conv_in_mlx_layout(conv_shape):
        return FIXES
    return ()


def still_needed(carried: tuple[str, ...], has_conv: bool) -> tuple[str, ...]:
    """The fixes weights carrying `carried` still lack (the conv fix only where there are conv kernels)."""
    return tuple(f for f in FIXES if f not in carried and (f != "conv" or has_conv))


@dataclass(frozen=True)
class FixPlan:
    """Which fixes the stored weights carry, which are applied while reading them, and what is left out."""

    carried: tuple[str, ...]
    applying: tuple[str, ...]  # requested and not carried: never a second +1
    has_conv: bool  # conv kernels stored (no linear-attention layers: none to fix)

    @property
    def result(self) -> tuple[str, ...]:
        """The fixes in the weights once read, in FIXES order."""
        return tuple(f for f in FIXES if f in self.carried or f in self.applying)

    def warnings(self, where) -> list[str]:
        """One message for each fix the weights are left without, saying what that does."""
        return [f"{where}: loaded without the {fix!r} fix: {WITHOUT[fix]}"
                for fix in still_needed(self.result, self.has_conv)]
