"""Every released naming, mapped to one internal naming.

Checkpoints of this family come in several layouts:

* prefixes: `model.language_model.*` (Qwen3.5/3.6 release), `model.*` (text-only exports, Qwen3-Next),
  `language_model.model.*` (mlx-lm conversions); the head always under `mtp.*`; vision under `model.visual.*`;
* routed experts: fused `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I] (release trunk),
  one by one `experts.{e}.{gate,up,down}_proj.weight` (Qwen3-Next, the release's head), or already stacked
  `switch_mlp.{gate,up,down}_proj.weight` (mlx-lm);
* linear-attention projections: split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) or fused per
  key head (`in_proj_qkvz`, `in_proj_ba`, Qwen3-Next);
* quantized weights (mlx-lm and qmtp conversions): `X.weight` holds uint32 codes with `X.scales` and
  `X.biases` beside it. Each of the three is mapped like the weight itself (`X.scales` of a stacked expert
  projection becomes `...experts.gate_proj.scales`); `quantization()` reads the width of each from its shapes.

`plan()` reads only names and shapes and returns, for each internal tensor, a `Recipe` saying which stored
tensors make it and how. Two stored tensors that would make one internal tensor (one weight under two prefixes,
expert 7 spelled `7` and `007`, fused `experts.gate_up_proj` beside per-expert tensors) are refused, naming both:
which one is meant cannot be known. Layer and expert indices are ASCII digits (a regex's digit class and `int()`
also read other scripts' digits). Tensors of layers the config does not declare (a trunk layer at or past
`num_hidden_layers`, a head layer at or past `mtp_num_hidden_layers`) are listed in `Plan.beyond`, for the caller
to refuse; experts past `num_experts` are refused here.

`Reader.materialise()` executes one recipe, so a loader or converter holds at most
one tensor group (a layer's stacked experts) in memory. The internal names are the attribute paths of
`qmtp.model.Model`: trunk tensors without prefix (`layers.3.self_attn.q_proj.weight`), head tensors under
`mtp.`, experts stacked as `mlp.experts.{gate,up,down}_proj.weight`. `mlx_name()` goes the other way, to
the names mlx-lm (and `qmtp.convert`) write.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
from dataclasses import dataclass, field

from .checkpoint import FLOAT_DTYPES, Checkpoint
from .config import FULL, LINEAR, ModelConfig
from .conventions import is_conv_kernel, torch_conv_shape
from .errors import CheckpointError, IncompleteHeadError, TensorShapeError, UsageError
from .quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

# The stored layouts qmtp writes (synthetic checkpoints, the bundled model):
#   "released"  Qwen3.6 as published: `model.language_model.*`, trunk experts fused, multimodal config
#   "text"      a text-only export: `model.*`, experts one by one, flat config
#   "next"      Qwen3-Next: `model.*`, fused in_proj_qkvz / in_proj_ba, experts one by one
LAYOUTS = ("released", "text", "next")

SKIPPED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
TRUNK_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# The two tensors that sit beside the uint32 codes (stored as `.weight`) of a quantized weight.
QUANTIZED_PARTS = (".scales", ".biases")
# Safetensors metadata key of the per-tensor quantization record qmtp writes (JSON: stored name of each
# weight -> {"bits": b or null, "group_size": g or null, "dtype": ...}).
QUANTIZATION_KEY = "qmtp.quantization"


@dataclass(frozen=True)
class Recipe:
    """How one internal tensor is made from stored ones."""

    op: str  # "copy" | "slice" | "stack" | "unfuse"
    sources: tuple[str, ...]
    # op arguments: for "slice", (axis, start, stop); for "unfuse", the part name ("q", "k", "v", "z", "b", "a")
    args: tuple = ()

    def __repr__(self) -> str:
        src = self.sources[0] if len(self.sources) == 1 else f"{self.sources[0]} .. ({len(self.sources)} tensors)"
        return f"{self.op}({src}{', ' + str(self.args) if self.args else ''})"


@dataclass
class Plan:
    """The result of mapping a checkpoint: recipes per internal name, and what did not map."""

    recipes: dict[str, Recipe]
    skipped: list[str] = field(default_factory=list)  # vision tensors, deliberately ignored
    unknown: list[str] = field(default_factory=list)  # names no rule recognised
    head_present: bool = False
    head_has_routed_experts: bool = False
    # stored tensors of layers the config does not declare: trunk layers at or past num_hidden_layers, head
    # layers at or past mtp_num_hidden_layers (every mtp.* tensor when the config declares no head)
    beyond: list[str] = field(default_factory=list)
    stored_layers: int = 0  # trunk layers stored: the highest layer index + 1 (0 without any)

    def beyond_trunk(self) -> list[str]:
        return [n for n in self.beyond if not n.startswith("mtp.")]

    def beyond_head(self) -> list[str]:
        return [n for n in self.beyond if n.startswith("mtp.")]


def internal_name(stored: str) -> str | None:
    """Strip a stored name's prefix; None for tensors qmtp ignores (vision)."""
    if stored.startswith(SKIPPED_PREFIXES):
        return None
    if stored.startswith("mtp."):
        return stored
    if stored.startswith(("lm_head.", "language_model.lm_head.")):
        return stored[stored.index("lm_head."):]  # .weight, or .scales / .biases when quantized
    for prefix in TRUNK_PREFIXES:
        if stored.startswith(prefix):
            return stored[len(prefix):]
    return stored


# An index is whatever sits between the dots; `_index` accepts only ASCII digits (\d and int() would also take
# other scripts' digits, so `experts.٧` would silently be expert 7).
_EXPERT_ONE = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.(?P<e>[^.]+)\.(?P<proj>gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^(?P<head>mtp\.)?layers\.(?P<i>[^.]+)\.")
_ASCII_INDEX = re.compile(r"[0-9]+")
_EXPERT_FUSED = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.(?P<proj>gate_up|down)_proj$")
_EXPERT_STACKED = re.compile(r"^(?P<mlp>.*\.mlp)\.switch_mlp\.(?P<proj>gate|up|down)_proj\.weight$")
_FUSED_LINEAR = re.compile(r"^(?P<attn>.*\.linear_attn)\.in_proj_(?P<which>qkvz|ba)\.weight$")


def plan(ckpt: Checkpoint, config: ModelConfig) -> Plan:
    """Map every stored tensor to internal names without reading any tensor data."""
    recipes: dict[str, Recipe] = {}
    skipped, beyond = [], []
    stored_layers = 0
    per_expert: dict[tuple[str, str], dict[int, str]] = {}
    inter = config.moe_intermediate_size

    def put(internal: str, recipe: Recipe) -> None:
        if internal in recipes:
            _refuse_twice(ckpt, recipes[internal].sources[0], recipe.sources[0], internal)
        recipes[internal] = recipe

    for stored in ckpt.names():
        name = internal_name(stored)
        if name is None:
            skipped.append(stored)
            continue
        if m := _LAYER.match(name):  # one spelling per layer: `layers.007.` is layer 7
            index = _index(ckpt, stored, m["i"], "layer")
            name = f"{m['head'] or ''}layers.{index}.{name[m.end():]}"
            if not m["head"]:
                stored_layers = max(stored_layers, index + 1)
            if index >= (config.mtp_num_hidden_layers if m["head"] else config.num_hidden_layers):
                beyond.append(stored)
                continue
        elif name.startswith("mtp.") and not config.has_mtp:
            beyond.append(stored)
            continue
        # A quantized weight's scales and biases follow the weight's own rule: map `X.weight`, then put
        # the part back on whatever internal name that gives.
        part = ".weight"
        if name.endswith(QUANTIZED_PARTS):
            stem, _, suffix = name.rpartition(".")
            name, part = f"{stem}.weight", f".{suffix}"

        def key(n: str) -> str:
            return n if part == ".weight" else n[: -len(".weight")] + part

        if m := _EXPERT_ONE.match(name):
            e = _index(ckpt, stored, m["e"], "expert")
            if e >= config.num_experts:
                raise CheckpointError(
                    f"{ckpt.path}: tensor {stored!r} is expert {e}, but config.json declares num_experts="
                    f"{config.num_experts} (experts 0 to {config.num_experts - 1}): the config describes fewer "
                    f"experts than the checkpoint holds"
                )
            group = per_expert.setdefault((m["mlp"], m["proj"], part), {})
            if e in group:
                _refuse_twice(ckpt, group[e], stored, f"expert {e} of {m['mlp']}.experts.{m['proj']}_proj")
            group[e] = stored
        elif m := _EXPERT_FUSED.match(name):
            base = f"{m['mlp']}.experts"
            if m["proj"] == "down":
                put(f"{base}.down_proj.weight", Recipe("copy", (stored,)))
            else:
                put(f"{base}.gate_proj.weight", Recipe("slice", (stored,), (1, 0, inter)))
                put(f"{base}.up_proj.weight", Recipe("slice", (stored,), (1, inter, 2 * inter)))
        elif m := _EXPERT_STACKED.match(name):
            put(key(f"{m['mlp']}.experts.{m['proj']}_proj.weight"), Recipe("copy", (stored,)))
        elif m := _FUSED_LINEAR.match(name):
            # adjacent recipes of one source: the Reader keeps it read for the next one
            parts = ("qkv", "z") if m["which"] == "qkvz" else ("b", "a")
            for p in parts:
                put(key(f"{m['attn']}.{_UNFUSED_NAME[p]}"), Recipe("unfuse", (stored,), (p,)))
        else:
            put(key(name), Recipe("copy", (stored,)))

    _stack_experts(ckpt, config, per_expert, recipes)
    known = expected_shapes(config, head=True)
    unknown = [recipes.pop(name).sources[0] for name in list(recipes) if weight_name(name) not in known]
    head_present = any(n.startswith("mtp.") for n in recipes)
    head_experts = all(n in recipes for n in head_routed_expert_names())
    return Plan(recipes, skipped, unknown, head_present, head_present and head_experts, beyond, stored_layers)


def _stack_experts(ckpt: Checkpoint, config: ModelConfig, per_expert: dict, recipes: dict[str, Recipe]) -> None:
    """Experts stored one tensor each become one stacked recipe per projection: all of them, or an error naming
    which are missing (IncompleteHeadError for the head's)."""
    for (mlp, proj, part), by_index in per_expert.items():
        internal = f"{mlp}.experts.{proj}_proj{part}"
        if internal in recipes:  # fused (or stacked) experts beside one-by-one ones: refused before counting them
            _refuse_twice(ckpt, recipes[internal].sources[0], by_index[min(by_index)], internal)
        expected = set(range(config.num_experts))
        if set(by_index) != expected:
            missing = sorted(expected - set(by_index))[:5]
            error = IncompleteHeadError if mlp.startswith("mtp.") else CheckpointError
            raise error(
                f"{ckpt.path}: {mlp}.experts has {len(by_index)} of {config.num_experts} {proj}_proj tensors "
                f"(missing e.g. experts {missing})"
            )
        recipes[internal] = Recipe("stack", tuple(by_index[e] for e in range(config.num_experts)))


def _index(ckpt: Checkpoint, stored: str, text: str, what: str) -> int:
    """A layer or expert index of a stored name: ASCII digits only (int() also reads other scripts' digits)."""
    if not _ASCII_INDEX.fullmatch(text):
        raise CheckpointError(f"{ckpt.path}: tensor {stored!r} has {what} index {text!r}; an index is written in "
                              f"ASCII digits 0-9")
    return int(text)


def _refuse_twice(ckpt: Checkpoint, first: str, second: str, what: str) -> None:
    """Two stored tensors make one weight: which one is meant cannot be known, so neither is taken."""
    a, b = ckpt.infos[first].file.name, ckpt.infos[second].file.name
    where = f"both in {a}" if a == b else f"in {a} and {b}"
    raise CheckpointError(f"{ckpt.path}: tensors {first!r} and {second!r} ({where}) are both {what}: one weight "
                          f"stored twice, and which one is meant cannot be known; remove one of them")


_INTERNAL_LAYER = re.compile(r"^layers\.([0-9]+)\.")


def first_layers(p: Plan, layers: int) -> Plan:
    """`p` without the recipes of trunk layers `layers` and past (what `qmtp.load(path, layers=k)` reads)."""
    recipes = {n: r for n, r in p.recipes.items()
               if not ((m := _INTERNAL_LAYER.match(n)) and int(m[1]) >= layers)}
    return dataclasses.replace(p, recipes=recipes)


def weight_name(name: str) -> str:
    """The weight a tensor belongs to: `X.scales` and `X.biases` -> `X.weight`; any other name unchanged."""
    if name.endswith(QUANTIZED_PARTS):
        return name.rpartition(".")[0] + ".weight"
    return name


_UNFUSED_NAME = {  # Qwen3-Next's fused parts, as the split layout names them
    "qkv": "in_proj_qkv.weight",
    "z": "in_proj_z.weight",
    "b": "in_proj_b.weight",
    "a": "in_proj_a.weight",
}


# ---- expected shapes ------------------------------------------------------------------------------------
def layer_shapes(config: ModelConfig, prefix: str, kind: str) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's tensors (internal names under `prefix`), conv in MLX layout."""
    H, E, I = config.hidden_size, config.num_experts, config.moe_intermediate_size
    S = config.shared_expert_intermediate_size
    shapes = {
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
        f"{prefix}mlp.gate.weight": (E, H),
        f"{prefix}mlp.experts.gate_proj.weight": (E, I, H),
        f"{prefix}mlp.experts.up_proj.weight": (E, I, H),
        f"{prefix}mlp.experts.down_proj.weight": (E, H, I),
        f"{prefix}mlp.shared_expert.gate_proj.weight": (S, H),
        f"{prefix}mlp.shared_expert.up_proj.weight": (S, H),
        f"{prefix}mlp.shared_expert.down_proj.weight": (H, S),
        f"{prefix}mlp.shared_expert_gate.weight": (1, H),
    }
    if kind == LINEAR:
        a = f"{prefix}linear_attn."
        Hv = config.linear_num_value_heads
        shapes.update({
            f"{a}in_proj_qkv.weight": (config.linear_conv_dim, H),
            f"{a}in_proj_z.weight": (config.linear_value_dim, H),
            f"{a}in_proj_b.weight": (Hv, H),
            f"{a}in_proj_a.weight": (Hv, H),
            f"{a}conv1d.weight": (config.linear_conv_dim, config.linear_conv_kernel_dim, 1),
            f"{a}A_log": (Hv,),
            f"{a}dt_bias": (Hv,),
            f"{a}norm.weight": (config.linear_value_head_dim,),
            f"{a}out_proj.weight": (H, config.linear_value_dim),
        })
    else:
        a = f"{prefix}self_attn."
        D, Hq, Hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        shapes.update({
            f"{a}q_proj.weight": (Hq * D * 2, H),
            f"{a}k_proj.weight": (Hkv * D, H),
            f"{a}v_proj.weight": (Hkv * D, H),
            f"{a}o_proj.weight": (H, Hq * D),
            f"{a}q_norm.weight": (D,),
            f"{a}k_norm.weight": (D,),
        })
    return shapes


def expected_shapes(config: ModelConfig, head: bool = True) -> dict[str, tuple[int, ...]]:
    """Every internal tensor of trunk (and head) with its shape after the fixes."""
    H, V = config.hidden_size, config.vocab_size
    shapes = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(config.layer_types):
        shapes.update(layer_shapes(config, f"layers.{i}.", kind))
    if head and config.has_mtp:
        shapes.update({
            "mtp.fc.weight": (H, 2 * H),
            "mtp.pre_fc_norm_embedding.weight": (H,),
            "mtp.pre_fc_norm_hidden.weight": (H,),
            "mtp.norm.weight": (H,),
        })
        shapes.update(layer_shapes(config, "mtp.layers.0.", FULL))
    return shapes


def missing_trunk(p: Plan, config: ModelConfig) -> list[str]:
    """Internal names of the trunk tensors the checkpoint lacks (empty for a complete trunk)."""
    return [n for n in expected_shapes(config, head=False) if n not in p.recipes]


def head_routed_expert_names() -> tuple[str, ...]:
    return tuple(f"mtp.layers.0.mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down"))


def stored_shapes(name: str, recipe: Recipe, want: tuple[int, ...],
                  config: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The shapes each stored source of `recipe` may have, for it to make `name` of shape `want`."""
    if recipe.op == "copy":
        if is_conv_kernel(name):
            # [C, 1, K] (PyTorch, as released) or [C, K, 1] (already in MLX layout): both are legitimate.
            return torch_conv_shape(want), want
        return (want,)
    if recipe.op == "stack":  # one expert per source
        return (want[1:],)
    if recipe.op == "slice":  # a half of a fused experts.gate_up_proj [E, 2I, H]
        axis = recipe.args[0]
        return (want[:axis] + (2 * config.moe_intermediate_size,) + want[axis + 1:],)
    if recipe.op == "unfuse":  # Qwen3-Next's in_proj_qkvz or in_proj_ba
        return ((_fused_rows(config, recipe.args[0]), want[1]),)
    raise ValueError(recipe.op)


def _fused_rows(config: ModelConfig, part: str) -> int:
    """Rows of the fused tensor that holds `part`: in_proj_qkvz for q, k, v and z; in_proj_ba for b and a."""
    qkvz = 2 * config.linear_key_dim + 2 * config.linear_value_dim
    ba = 2 * config.linear_num_value_heads
    return {"qkv": qkvz, "z": qkvz, "b": ba, "a": ba}[part]


def quantized_shapes(shape: tuple[int, ...], bits: int, group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of `mx.quantize(w, group_size, bits)` for w of `shape`: (uint32 codes, scales and biases)."""
    *rows, k = shape
    return (*rows, k * bits // 32), (*rows, k // group_size)


def check_shapes(ckpt: Checkpoint, p: Plan, config: ModelConfig,
                 widths: dict[str, tuple[int, int]] | None = None) -> None:
    """Raise TensorShapeError naming the first stored tensor whose dtype or shape disagrees with the config.

    Every source of every recipe is checked (each expert of a one-by-one group too), from the headers alone.
    `widths` (from `quantization`) gives the (bits, group_size) of the quantized weights: their codes must be
    uint32 of the packed shape, their scales and biases floating-point with one value per group.
    """
    widths = widths or {}
    expected = expected_shapes(config, head=True)
    for name, recipe in p.recipes.items():
        base = weight_name(name)
        want, dtypes = expected[base], FLOAT_DTYPES
        if base in widths:
            codes, groups = quantized_shapes(want, *widths[base])
            if name == base:
                want, dtypes = codes, ("U32",)
            else:
                want = groups
        accepted = stored_shapes(base, recipe, want, config)
        for source in recipe.sources:
            info = ckpt.infos[source]
            if info.dtype not in dtypes:
                raise TensorShapeError(
                    f"{info.file}: tensor {info.name!r} is stored as {info.dtype}; qmtp expects "
                    + ("uint32 codes (U32) of a quantized weight" if dtypes == ("U32",) else
                       f"a floating-point dtype ({'/'.join(FLOAT_DTYPES)})")
                )
            if info.shape not in accepted:
                raise TensorShapeError(
                    f"{info.file}: tensor {info.name!r} has shape {list(info.shape)}, but the config "
                    f"({config.model_type}, hidden_size={config.hidden_size}) implies "
                    f"{' or '.join(str(list(s)) for s in accepted)}"
                    + (f" ({widths[base][0]}-bit, group size {widths[base][1]})" if base in widths else "")
                )


def quantization(ckpt: Checkpoint, p: Plan, config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Internal weight name -> (bits, group_size) for every quantized weight of the checkpoint.

    Read from the shapes, as mlx-lm does: a weight of last dimension K stored as uint32 codes of last dimension
    W with scales of last dimension G is W*32/K bits with groups of K/G. A file qmtp wrote also records the
    width of every tensor (`qmtp.quantization` in its metadata): the shapes must agree with that record.
    Raises TensorShapeError for scales without biases or codes, and for shapes no width explains.
    """
    expected = expected_shapes(config, head=True)
    widths = {}
    for name, recipe in p.recipes.items():
        if not name.endswith(".scales"):
            continue
        scales = ckpt.infos[recipe.sources[0]]
        base = weight_name(name)
        for needed in (base, base[: -len(".weight")] + ".biases"):
            if needed not in p.recipes:
                raise TensorShapeError(
                    f"{scales.file}: tensor {scales.name!r} marks {base[: -len('.weight')]} as quantized, but "
                    f"its {needed.rsplit('.', 1)[1]} tensor is missing"
                )
        codes = ckpt.infos[p.recipes[base].sources[0]]
        if codes.dtype != "U32":
            raise TensorShapeError(
                f"{codes.file}: tensor {codes.name!r} has scales beside it, so it should hold quantized uint32 "
                f"codes, but it is stored as {codes.dtype}"
            )
        k = expected[base][-1]  # values per row
        packed = codes.shape[-1] if codes.shape else 0  # uint32 words per row
        groups = scales.shape[-1] if scales.shape else 0  # groups per row
        bits = packed * 32 // k
        group_size = k // groups if groups else 0
        if (packed * 32 != bits * k or bits not in SUPPORTED_BITS or group_size * groups != k
                or group_size not in SUPPORTED_GROUP_SIZES):
            raise TensorShapeError(
                f"{codes.file}: quantized tensor {codes.name!r} has {packed} words and {groups} groups per row; "
                f"no MLX width fits a row of {k} values (bits {SUPPORTED_BITS}, group sizes {SUPPORTED_GROUP_SIZES})"
            )
        widths[base] = (bits, group_size)

    record = ckpt.metadata.get(QUANTIZATION_KEY)
    if record is not None:
        try:
            record = json.loads(record)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{ckpt.path}: metadata {QUANTIZATION_KEY} is not valid JSON ({err})") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{ckpt.path}: metadata {QUANTIZATION_KEY} is not a JSON object")
        for name, recipe in p.recipes.items():
            entry = record.get(recipe.sources[0]) if name == weight_name(name) else None
            if not isinstance(entry, dict):
                continue
            recorded = (entry.get("bits"), entry.get("group_size")) if entry.get("bits") else None
            if recorded != widths.get(name):
                stored = widths.get(name)
                raise TensorShapeError(
                    f"{ckpt.infos[recipe.sources[0]].file}: tensor {recipe.sources[0]!r} is recorded as "
                    f"{_width_text(recorded)} but stored as {_width_text(stored)}"
                )
    return widths


def _width_text(width) -> str:
    return "unquantized" if width is None else f"{width[0]}-bit with group size {width[1]}"


def check_head(p: Plan, config: ModelConfig, where) -> None:
    """Raise IncompleteHeadError if the stored head lacks tensors.

    A head with no routed experts at all passes: that is how crippled conversions ship it, and the caller
    warns. Some routed experts without the others (7 of 8 up_proj are caught by `plan`) is an error.
    """
    experts = head_routed_expert_names()
    head_names = [n for n in expected_shapes(config, head=True) if n.startswith("mtp.")]
    absent = [n for n in head_names if n not in p.recipes and n not in experts]
    if absent:
        raise IncompleteHeadError(f"{where}: MTP head tensor {absent[0]} is missing ({len(absent)} in all)")
    stored = [n for n in experts if n in p.recipes]
    if stored and len(stored) < len(experts):
        lacking = [n for n in experts if n not in p.recipes]
        raise IncompleteHeadError(
            f"{where}: MTP head routed experts are incomplete: {lacking[0]} is missing while {stored[0]} is stored"
        )


# ---- executing recipes -----------------------------------------------------------------------------------
class Reader:
    """Executes recipes against a checkpoint, keeping the last stored tensor read (gate_up is sliced twice)."""

    def __init__(self, ckpt: Checkpoint, config: ModelConfig):
        self.ckpt, self.config = ckpt, config
        self._last: tuple[str, object] | None = None

    def forget(self) -> None:
        """Drop the stored tensor kept for the next slice (a converter calls this to keep memory down)."""
        self._last = None

    def _read(self, stored: str):
        if self._last is not None and self._last[0] == stored:
            return self._last[1]
        array = self.ckpt.load(stored)
        self._last = (stored, array)
        return array

    def materialise(self, recipe: Recipe, rows: tuple[int, int] | None = None):
        """The tensor `recipe` makes, or with `rows` = (start, stop) only those rows of its first axis, reading
        only their bytes (a converter streams a large tensor so, a few experts or embedding rows at a time)."""
        import mlx.core as mx

        part = slice(None) if rows is None else slice(*rows)
        if recipe.op == "copy":
            return self.ckpt.load(recipe.sources[0], None if rows is None else (part,))
        if recipe.op == "slice":  # read only the slice, not the fused tensor around it
            axis, start, stop = recipe.args
            index = [slice(None)] * len(self.ckpt.infos[recipe.sources[0]].shape)
            index[axis] = slice(start, stop)
            if rows is not None:
                index[0] = slice(start + rows[0], start + rows[1]) if axis == 0 else part
            return self.ckpt.load(recipe.sources[0], tuple(index))
        if recipe.op == "stack":
            return mx.stack([self.ckpt.load(s) for s in recipe.sources[part]])
        if recipe.op == "unfuse":
            w = unfuse_linear_projection(self._read(recipe.sources[0]), recipe.args[0], self.config)
            return w if rows is None else w[part]
        raise ValueError(f"unknown recipe op {recipe.op!r}")


def unfuse_linear_projection(w, part: str, config: ModelConfig):
    """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` rows, grouped per key head, to the split layout.

    Per key head g the fused rows are [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)] with r value heads per key
    head; `in_proj_ba` is [b_g (r), a_g (r)]. The split layout wants all q rows, then all k, then all v.
    """
    import mlx.core as mx

    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    r, dv = config.linear_num_value_heads // nk, config.linear_value_head_dim
    H = w.shape[-1]
    if part in ("b", "a"):
        grouped = w.reshape(nk, 2 * r, H)
        start = 0 if part == "b" else r
        return grouped[:, start:start + r].reshape(nk * r, H)
    grouped = w.reshape(nk, 2 * dk + 2 * r * dv, H)
    bounds = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, 2 * dk + 2 * r * dv)}

    def rows(p):
        s, e = bounds[p]
        return grouped[:, s:e].reshape(-1, H)

    if part == "qkv":
        return mx.concatenate([rows("q"), rows("k"), rows("v")], axis=0)
    return rows(part)


# ---- writing: internal names -> a stored layout ------------------------------------------------------------
MLX_TRUNK_PREFIX = "language_model.model."


def mlx_name(internal: str) -> str:
    """Internal name -> the name mlx-lm gives the tensor in its Qwen3.5/3.6 model (what `qmtp.convert` writes).

    Trunk under `language_model.model.`, lm_head as `language_model.lm_head`, the head under `mtp.`, stacked
    experts as `mlp.switch_mlp.{gate,up,down}_proj` (trunk and head alike). `.scales` / `.biases` follow their
    weight. `plan` maps every one of these names back.
    """
    name = internal.replace(".mlp.experts.", ".mlp.switch_mlp.")
    if name.startswith("mtp."):
        return name
    if name.startswith("lm_head."):
        return "language_model." + name
    return MLX_TRUNK_PREFIX + name


def stored_entries(config: ModelConfig, layout: str, value_of, head: bool = True, head_experts: bool = True,
                   head_experts_fused: bool = False, expert_value=None):
    """The inverse of `plan`: [(stored name, stored shape, produce)] for writing a checkpoint in `layout`.

    `value_of(internal_name, shape)` returns a numpy array in the checkpoint's own conventions (zero-centred
    norms, [C, 1, K] conv); `expert_value(internal_name, e, shape)`, if given, returns one expert's slice so
    one-by-one layouts need not build the stacked tensor once per expert. Tensors are produced only when
    called, so a writer streams them.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    prefix = "model.language_model." if layout == "released" else "model."
    shapes = expected_shapes(config, head=head)
    if head and not head_experts:
        for n in [n for n in shapes if n.startswith("mtp.") and ".experts." in n]:
            del shapes[n]

    def value(name):
        return lambda: value_of(name, shapes[name])

    if expert_value is None:
        def expert_value(name, e, shape):
            return value_of(name, shapes[name])[e]

    def stored_shape(name):
        s = shapes[name]
        return torch_conv_shape(s) if is_conv_kernel(name) else s

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
                                        lambda f=full, e=e: expert_value(f, e, shapes[f][1:])))
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


def fuse_qkvz(qkv, z, config: ModelConfig):
    """Split-layout q|k|v and z rows -> Qwen3-Next's rows grouped per key head [q_g, k_g, v_g, z_g]."""
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    r, dv = config.linear_num_value_heads // nk, config.linear_value_head_dim
    H = qkv.shape[1]
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    groups = [q.reshape(nk, dk, H), k.reshape(nk, dk, H), v.reshape(nk, r * dv, H), z.reshape(nk, r * dv, H)]
    return np.concatenate(groups, axis=1).reshape(-1, H)


def fuse_ba(b, a, config: ModelConfig):
    nk = config.linear_num_key_heads
    r = config.linear_num_value_heads // nk
    H = b.shape[1]
    return np.concatenate([b.reshape(nk, r, H), a.reshape(nk, r, H)], axis=1).reshape(-1, H)
