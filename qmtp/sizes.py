"""How large a converted checkpoint is, computed from the config alone.

Every number here is arithmetic over `qmtp.layout.expected_shapes(config, head=True)`, the same tensor list
the loader checks a checkpoint against, so a chapter can state the size of the real Qwen3.6-35B-A3B at any
width without 70 GB of weights, and a test can check the arithmetic against `mx.quantize` on a small config.

The conversion convention is mlx-lm's (`mlx_lm.convert` with the Qwen3.5/3.6 quantization predicate):

* A weight is quantized when it is the weight of a linear or embedding layer (2-D or more: linear
  projections, stacked experts [E, out, in], `embed_tokens`, `lm_head`, `mtp.fc`) and its last dimension is
  divisible by the group size. Quantized along the last axis with `mx.quantize`, it is stored as
  numel * bits / 8 bytes of uint32 codes plus one scale and one bias per group of `group_size` elements,
  each in the checkpoint dtype (`dtype_bytes`): numel/group_size * 2 * dtype_bytes bytes.
* The router `mlp.gate` and the `mlp.shared_expert_gate` are quantized at `router_bits` (8) with group size
  `router_group_size` (64): mlx-lm fixes both numbers for these tensors whatever the rest of the model uses.
* `embed_tokens` and `lm_head` are quantized like every other weight (mlx-lm quantizes nn.Embedding too),
  at `bits` unless `embed_bits` / `lm_head_bits` say otherwise.
* Everything else stays in the checkpoint dtype (dtype_bytes per element): 1-D tensors (norms, `dt_bias`),
  the depthwise conv1d kernels (MLX has no quantized conv), and weights whose last dimension is not a
  multiple of the group size. `A_log` is always float32 (4 bytes): mlx-lm's cast predicate exempts it from
  the bf16 cast, and qmtp's model keeps it float32 too.
* The MTP head (`mtp.*`) follows the same rules at `mtp_bits` (its router gates at `router_bits`);
  `mtp_bits=None` keeps the whole head, router gates included, in the checkpoint dtype. The head has no
  embedding or lm_head of its own (it shares the trunk's).

Any width argument may be `UNQUANTIZED` (16) to keep those tensors in the checkpoint dtype (None for
`mtp_bits`; for `embed_bits` and `lm_head_bits` None means "as `bits`").
Sizes are tensor data only: safetensors headers and config files are not counted (under a megabyte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import ModelConfig
from .conventions import UNQUANTIZED_BITS, is_conv_kernel, is_head, is_router, keeps_float32, width_text
from .errors import UsageError
from .layout import expected_shapes
from .quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

UNQUANTIZED = UNQUANTIZED_BITS
"""The width argument meaning: not quantized, stored in the checkpoint dtype (held as None inside)."""

CATEGORIES = (
    "routed experts",
    "shared experts",
    "attention",
    "linear attention",
    "router and shared-expert gates",
    "embeddings",
    "lm_head",
    "mtp fc",
    "norms and small vectors",
)


def category(name: str, shape: tuple[int, ...]) -> str:
    """The breakdown row an internal tensor name belongs to."""
    if len(shape) < 2:
        return "norms and small vectors"  # every norm, A_log, dt_bias
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_expert." in name:
        return "shared experts"
    if is_router(name):
        return "router and shared-expert gates"
    if ".self_attn." in name:
        return "attention"
    if ".linear_attn." in name:
        return "linear attention"  # projections and the conv1d kernel
    if name == "embed_tokens.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "lm_head"
    if name == "mtp.fc.weight":
        return "mtp fc"
    raise ValueError(f"no size category for tensor {name!r}")  # a new tensor in layout.py: add a rule here


@dataclass(frozen=True)
class TensorSize:
    """One tensor as stored: its width (None: unquantized) and its bytes (codes + scales + biases)."""

    name: str
    shape: tuple[int, ...]
    category: str
    bits: int | None
    group_size: int | None
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_head(self) -> bool:
        return is_head(self.name)


def quantized_bytes(shape: tuple[int, ...], bits: int, group_size: int, dtype_bytes: int) -> int:
    """Bytes of `mx.quantize(w, group_size, bits)`: uint32 codes, then one scale and one bias per group."""
    numel = math.prod(shape)
    codes = numel * bits // 8  # exact: the last dim is a multiple of group_size >= 32, so numel*bits % 32 == 0
    groups = numel // group_size
    return codes + 2 * groups * dtype_bytes


@dataclass
class SizeReport:
    """Bytes of a converted checkpoint, trunk and head separately, with a per-category breakdown."""

    trunk_bytes: int
    head_bytes: int
    total_bytes: int
    trunk: dict[str, int]  # category -> bytes (every category present, 0 where none)
    head: dict[str, int]
    tensors: list[TensorSize] = field(repr=False)
    settings: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tensors: list[TensorSize], settings: dict) -> "SizeReport":
        """Sum `tensors` by part (trunk or head) and category."""
        trunk = {c: 0 for c in CATEGORIES}
        head = {c: 0 for c in CATEGORIES}
        for t in tensors:
            (head if t.is_head else trunk)[t.category] += t.nbytes
        trunk_bytes, head_bytes = sum(trunk.values()), sum(head.values())
        return cls(trunk_bytes, head_bytes, trunk_bytes + head_bytes, trunk, head, tensors, settings)

    def table(self) -> list[tuple[str, int, int, int]]:
        """Rows (category, trunk bytes, head bytes, total bytes) for the categories present, then "total"."""
        rows = [(c, self.trunk[c], self.head[c], self.trunk[c] + self.head[c])
                for c in CATEGORIES if self.trunk[c] or self.head[c]]
        rows.append(("total", self.trunk_bytes, self.head_bytes, self.total_bytes))
        return rows

    def format(self, unit: float = 1e9, unit_name: str = "GB") -> str:
        """The table as text, in `unit` (decimal gigabytes by default; 2**30 for GiB)."""
        s = self.settings
        lines = [f"trunk {width_text(s.get('bits'))}, group {s.get('group_size')}, router "
                 f"{width_text(s.get('router_bits'))}, head {width_text(s.get('mtp_bits'))} ({unit_name})",
                 f"{'category':<32}{'trunk':>10}{'head':>10}{'total':>10}"]
        for name, t, h, a in self.table():
            lines.append(f"{name:<32}{t / unit:>10.3f}{h / unit:>10.3f}{a / unit:>10.3f}")
        return "\n".join(lines)


def _width(value: int, what: str) -> int | None:
    """A width argument: bits MLX quantizes to, or UNQUANTIZED, which becomes None."""
    if value == UNQUANTIZED:
        return None
    if value not in SUPPORTED_BITS:
        raise UsageError(f"{what}={value} is not a width MLX quantizes to ({SUPPORTED_BITS}) nor {UNQUANTIZED} "
                         f"(unquantized)")
    return value


def sizes(config: ModelConfig, bits: int = 4, group_size: int = 64, mtp_bits: int | None = None,
          router_bits: int = 8, lm_head_bits: int | None = None, embed_bits: int | None = None,
          dtype_bytes: int = 2, router_group_size: int = 64) -> SizeReport:
    """Bytes of the trunk and the MTP head after conversion at these widths (see the module docstring).

    `bits` applies to every trunk weight except the router gates (`router_bits`), `embed_tokens`
    (`embed_bits`, default `bits`) and `lm_head` (`lm_head_bits`, default `bits`). The head uses `mtp_bits`
    for its weights and `router_bits` for its router gates; with `mtp_bits=None` nothing in it is quantized.
    `dtype_bytes` is the checkpoint dtype of everything not quantized and of scales and biases (2 for
    bf16/f16, 4 for f32). `router_group_size` is mlx-lm's fixed 64 for the router gates.
    """
    bits = _width(bits, "bits")
    head_bits = None if mtp_bits is None else _width(mtp_bits, "mtp_bits")
    router_bits = _width(router_bits, "router_bits")
    embed_width = bits if embed_bits is None else _width(embed_bits, "embed_bits")
    lm_head_width = bits if lm_head_bits is None else _width(lm_head_bits, "lm_head_bits")
    for gs, what in ((group_size, "group_size"), (router_group_size, "router_group_size")):
        if gs not in SUPPORTED_GROUP_SIZES:
            raise UsageError(
                f"{what}={gs} is not supported; MLX quantizes with groups of {SUPPORTED_GROUP_SIZES}"
            )
    if dtype_bytes not in (2, 4):
        raise UsageError(f"dtype_bytes={dtype_bytes}: the checkpoint dtype is bf16/f16 (2) or f32 (4)")

    tensors = []
    for name, shape in expected_shapes(config, head=True).items():
        head = is_head(name)
        if head and head_bits is None:
            width, gs = None, group_size  # an unquantized head keeps its router gates unquantized too
        elif is_router(name):
            width, gs = router_bits, router_group_size
        elif name == "embed_tokens.weight":
            width, gs = embed_width, group_size
        elif name == "lm_head.weight":
            width, gs = lm_head_width, group_size
        else:
            width, gs = (head_bits if head else bits), group_size
        quantizable = len(shape) >= 2 and not is_conv_kernel(name) and shape[-1] % gs == 0
        if width is not None and quantizable:
            nbytes = quantized_bytes(shape, width, gs, dtype_bytes)
            tensors.append(TensorSize(name, shape, category(name, shape), width, gs, nbytes))
        else:
            element = 4 if keeps_float32(name) else dtype_bytes
            tensors.append(TensorSize(name, shape, category(name, shape), None, None, math.prod(shape) * element))

    settings = dict(bits=bits, group_size=group_size, mtp_bits=head_bits, router_bits=router_bits,
                    router_group_size=router_group_size, embed_bits=embed_width, lm_head_bits=lm_head_width,
                    dtype_bytes=dtype_bytes)
    return SizeReport.of(tensors, settings)


# What each key of `parameter_counts` counts, in words a table can show.
PARAMETER_COUNT_LABELS = {
    "trunk": "trunk (embeddings and lm_head included)",
    "head": "MTP head (its own tensors)",
    "routed_experts": "the trunk's routed experts, all of them",
    "active": "used per token by the trunk",
    "head_active": "used per draft by the head",
    "total": "whole checkpoint",
}


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameter counts of trunk and head, and how many parameters one token uses.

    Keys::

      "trunk"          every trunk tensor, embed_tokens and lm_head included
      "head"           every `mtp.*` tensor (the head shares embed_tokens and lm_head, counted in "trunk")
      "total"          trunk + head
      "routed_experts" the trunk's routed-expert weights (all E experts of every layer)
      "active"         trunk parameters one token's forward pass multiplies with: in every layer the
                       attention or linear-attention weights, the router, the shared expert and its gate, the
                       top-k of the E routed experts (k/E of the routed weights), norms and small vectors;
                       plus one row of embed_tokens (a lookup reads H numbers) and all of lm_head (every
                       logit is computed). With tied embeddings the one matrix counts fully, as lm_head.
      "head_active"    the same for one draft step of the head, its own tensors only (the shared
                       embedding row and lm_head are in "active" already)
    """
    shapes = expected_shapes(config, head=True)
    k, E, H = config.num_experts_per_tok, config.num_experts, config.hidden_size
    counts = dict(trunk=0, head=0, routed_experts=0, active=0, head_active=0)
    for name, shape in shapes.items():
        n = math.prod(shape)
        head = is_head(name)
        counts["head" if head else "trunk"] += n
        if ".mlp.experts." in name:
            used = n // E * k
            if not head:
                counts["routed_experts"] += n
        elif name == "embed_tokens.weight" and not config.tie_word_embeddings:
            used = H
        else:
            used = n
        counts["head_active" if head else "active"] += used
    counts["total"] = counts["trunk"] + counts["head"]
    return counts


# ---- expert parallelism (qmtp.parallel): what each of N ranks holds -------------------------------------------
def per_rank_bytes(report: SizeReport, ranks: int) -> int:
    """Bytes one of `ranks` expert-parallel ranks holds: its 1/N of every routed-expert stack (trunk and head),
    and everything else whole (embeddings, attention, DeltaNet, routers, shared experts, norms, lm_head)."""
    if ranks < 1:
        raise UsageError(f"ranks={ranks}: give at least 1")
    routed = report.trunk["routed experts"] + report.head["routed experts"]
    return report.total_bytes - routed + routed // ranks
