"""Conventions of the checkpoints qmtp reads and writes: tensor name rules, the conv kernel's storage layout,
the widths tensors are stored at, and how "unquantized" is spelled.

Names here are internal names (`qmtp.layout`): `layers.3.mlp.gate.weight`, `mtp.layers.0...`.
Inside qmtp an unquantized width is `None`; `parse_width` turns every spelling a user may give into it.
"""

from __future__ import annotations

from .errors import UsageError

# ---- tensor names ---------------------------------------------------------------------------------------------
HEAD_PREFIX = "mtp."

# The router gate and the shared expert's gate: mlx-lm quantizes both at a fixed width and group size, so
# every tool that sizes, writes or rounds weights must pick out the same two.
ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")

# Tensors stored and loaded in float32 whatever the checkpoint dtype (convert writes them so, load keeps them
# so): the decay rates exp(A_log) are sensitive to rounding.
FLOAT32_SUFFIXES = (".A_log",)

CONV_KERNEL_SUFFIX = ".linear_attn.conv1d.weight"

# The small tensors in which one bad value changes every token: every norm, the decay parameters, the conv
# kernels and the routers (a few MB at full size). `qmtp.load` checks that they are finite; a NaN in a large
# weight shows instead in the logits, which decoding checks at every step.
SMALL_CRITICAL_SUFFIXES = (".A_log", ".dt_bias", CONV_KERNEL_SUFFIX) + ROUTER_SUFFIXES


def is_head(name: str) -> bool:
    return name.startswith(HEAD_PREFIX)


def is_router(name: str) -> bool:
    return name.endswith(ROUTER_SUFFIXES)


def keeps_float32(name: str) -> bool:
    return name.endswith(FLOAT32_SUFFIXES)


def is_conv_kernel(name: str) -> bool:
    return name.endswith(CONV_KERNEL_SUFFIX)


def is_small_critical(name: str) -> bool:
    """Norms, `A_log`, `dt_bias`, conv kernels and routers, and a quantized router's scales and biases (whose
    codes are integers: the scales and biases are what can hold a NaN)."""
    for part in (".scales", ".biases"):  # layout.QUANTIZED_PARTS
        if name.endswith(part):
            name = name[: -len(part)] + ".weight"
    module, _, leaf = name.rpartition(".")
    is_norm = leaf == "weight" and "norm" in module.rpartition(".")[2]  # q_norm, input_layernorm, pre_fc_norm_hidden
    return is_norm or name.endswith(SMALL_CRITICAL_SUFFIXES)


# ---- the conv kernel's layout -----------------------------------------------------------------------------------
# The release stores the depthwise kernel as PyTorch does, [C, 1, K]; MLX's conv1d wants
# [C_out, K, C_in / groups] = [C, K, 1]. The model (and `layout.expected_shapes`) use MLX's.
def torch_conv_shape(mlx_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[C, K, 1] -> [C, 1, K]: the shape the release stores a kernel of MLX shape `mlx_shape` in."""
    return (mlx_shape[0], 1, mlx_shape[1])


def conv_to_mlx(w):
    """[C, 1, K] (PyTorch depthwise kernel) -> [C, K, 1] (MLX conv1d)."""
    return w.moveaxis(2, 1)


def conv_to_torch(w):
    """[C, K, 1] (MLX conv1d) -> [C, 1, K] (as the release stores it)."""
    return w.moveaxis(1, 2)


def conv_in_mlx_layout(conv_shape) -> bool | None:
    """True for [C, K, 1], False for [C, 1, K], None when there is no kernel or its shape says neither."""
    if conv_shape is None or len(conv_shape) != 3:
        return None
    if conv_shape[-1] == 1 and conv_shape[1] != 1:
        return True
    if conv_shape[1] == 1 and conv_shape[-1] != 1:
        return False
    return None


# ---- widths -------------------------------------------------------------------------------------------------------
BITS = (2, 3, 4, 5, 6, 8)
"""Widths `convert` writes (mx.quantize also takes 1 bit; no loader expects it in a model)."""
GROUP_SIZES = (32, 64, 128)
ROUTER_BITS = 8
ROUTER_GROUP_SIZE = 64  # mlx-lm's fixed group size for the router gates

UNQUANTIZED_BITS = 16
"""The number a width argument may give for "not quantized" (the 16 bits of bf16); qmtp turns it into None."""
UNQUANTIZED_WORDS = ("bf16", "none")
"""The words a width argument may give for "not quantized" (any case)."""


def is_unquantized(value) -> bool:
    """Whether a width argument says "not quantized": None, 16, "bf16" or "none"."""
    if isinstance(value, str):
        return value.lower() in UNQUANTIZED_WORDS
    return value is None or value == UNQUANTIZED_BITS


def parse_width(value, what: str, allow_unquantized: bool = True) -> int | None:
    """A width argument: an int in BITS, or None for any spelling of unquantized (where allowed)."""
    if is_unquantized(value):
        if allow_unquantized:
            return None
        raise UsageError(f"{what}={value!r}: give a width in {BITS}")
    try:
        width = int(value)
    except (TypeError, ValueError):
        width = None
    if width not in BITS or isinstance(value, bool) or (isinstance(value, float) and value != width):
        extra = " or bf16 (unquantized)" if allow_unquantized else ""
        raise UsageError(f"{what}={value!r} is not supported; MLX quantizes to {BITS} bits{extra}")
    return width


def width_text(bits: int | None) -> str:
    """How tables and messages name a width: "bf16" for unquantized, else "N-bit"."""
    return "bf16" if bits is None else f"{bits}-bit"
