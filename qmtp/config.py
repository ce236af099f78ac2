"""The model's shape, read from a Hugging Face config.json.

Qwen3.6-35B-A3B ships a multimodal config: every text field sits under `text_config`. Text-only exports
(`qwen3_5_moe_text`) and the older Qwen3-Next (`qwen3_next`) are flat. `ModelConfig.from_dict` accepts
all three and reduces them to one dataclass; `QWEN36_35B_A3B` holds the real model's numbers so a
chapter can reason about it without 70 GB of weights.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import read_json
from .errors import ConfigError

# model_type -> how the linear-attention projections are stored.
#   "split": in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5 / 3.6)
#   "fused": in_proj_qkvz / in_proj_ba grouped per key head (Qwen3-Next)
SUPPORTED_MODEL_TYPES = {
    "qwen3_5_moe": "split",
    "qwen3_5_moe_text": "split",
    "qwen3_next": "fused",
}

LINEAR = "linear_attention"
FULL = "full_attention"

# Fields without which no model can be built; everything else has the released default.
REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
)

# Upper bounds: far above any released model, low enough that nothing is built a billion times over
# (a layer list, an expert stack) and that every size fits MLX's int32 dimensions.
MAX_INT = 2**31 - 1
MAX_VALUES = {
    "num_hidden_layers": 1024,
    "num_experts": 65_536,
    "num_experts_per_tok": 65_536,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "linear_num_key_heads": 4096,
    "linear_num_value_heads": 4096,
    "linear_conv_kernel_dim": 64,
    "vocab_size": 2**24,
    "hidden_size": 2**18,
    "head_dim": 2**14,
    "linear_key_head_dim": 2**14,
    "linear_value_head_dim": 2**14,
    "max_position_embeddings": 2**30,
    "rms_norm_eps": 0.01,  # real ones are 1e-6 to 1e-5; 0.01 already flattens the norms
    "rope_theta": 1e12,
    "partial_rotary_factor": 1.0,
}

# Integer fields that may be 0 (every other integer field counts something that must exist).
MAY_BE_ZERO = ("mtp_num_hidden_layers",)

MAX_CONFIG_BYTES = 4 * 1024 * 1024  # real ones are a few kB

SUPPORTED_TEXT = (
    "qmtp reads Qwen3.5/3.6 MoE (qwen3_5_moe, qwen3_5_moe_text) and Qwen3-Next (qwen3_next) checkpoints"
)


@dataclass
class ModelConfig:
    """Every number the trunk and the MTP head are built from.

    Field names follow Hugging Face's `Qwen3_5MoeTextConfig`, so a reader can match them with config.json.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    shared_expert_intermediate_size: int = 512
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    layer_types: list[str] = field(default_factory=list)
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1
    max_position_embeddings: int = 262_144
    model_type: str = "qwen3_5_moe_text"

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def projection_layout(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv, q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    def validate(self) -> None:
        """Raise one ConfigError listing every problem.

        Each field's own type and range come first: the checks between fields do arithmetic on them.
        """
        problems = self._value_problems() or self._relation_problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def _value_problems(self) -> list[str]:
        problems = []
        for name, kind in typing.get_type_hints(type(self)).items():
            problem = _value_problem(name, getattr(self, name), kind)
            if problem:
                problems.append(problem)
        if isinstance(self.model_type, str) and self.model_type not in SUPPORTED_MODEL_TYPES:
            problems.append(f"model_type {self.model_type!r} is not supported; {SUPPORTED_TEXT}")
        return problems

    def _relation_problems(self) -> list[str]:
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            problems.append(f"unknown layer_types {unknown}")
        if self.num_experts_per_tok > self.num_experts:
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.rotary_dims % 2 or not 0 < self.rotary_dims <= self.head_dim:
            problems.append(
                f"partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dims} rotary "
                f"dims of head_dim={self.head_dim}; it must be even and positive"
            )
        if self.mtp_num_hidden_layers not in (0, 1):
            problems.append(
                f"mtp_num_hidden_layers={self.mtp_num_hidden_layers}: qmtp supports a head of one layer"
            )
        return problems

    # ---- reading and writing ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        """Build from a config.json dict, flat or nested under `text_config`."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        outer_type = raw.get("model_type")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config is not an object")
        model_type = text.get("model_type", outer_type)
        if outer_type == "qwen3_5_moe" and model_type in (None, "qwen3_5_moe"):
            model_type = "qwen3_5_moe_text"
        if model_type is None:
            raise ConfigError(f"{source}: config.json has no model_type; {SUPPORTED_TEXT}")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported; {SUPPORTED_TEXT}")
        missing = [k for k in REQUIRED_FIELDS if k not in text]
        if missing:
            raise ConfigError(f"{source}: missing required fields {missing}")

        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in text.items() if k in names}
        values["model_type"] = model_type
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: rope_parameters (or rope_scaling) is not an object")
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" in rope:
            values["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if not values.get("layer_types"):
            interval = text.get("full_attention_interval", 4)
            if not _is_count(interval):
                raise ConfigError(f"{source}: full_attention_interval={interval!r} must be a positive integer")
            values["layer_types"] = default_layer_types(text["num_hidden_layers"], interval)
        if "mtp_num_hidden_layers" not in text and model_type == "qwen3_next":
            values["mtp_num_hidden_layers"] = text.get("num_nextn_predict_layers", 1)
        try:
            return cls(**values)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (or the file given)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists() and not path.is_symlink():
            raise ConfigError(f"{path}: file not found (every checkpoint directory needs a config.json)")
        return cls.from_dict(read_json(path, ConfigError, "config.json", limit=MAX_CONFIG_BYTES), source=str(path))

    def to_text_dict(self) -> dict:
        """The text fields as Hugging Face names them (what sits under `text_config`)."""
        d = dataclasses.asdict(self)
        d.pop("rope_theta")
        d.pop("partial_rotary_factor")
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        }
        d["full_attention_interval"] = _interval_of(self.layer_types)
        d["attn_output_gate"] = True
        d["mtp_use_dedicated_embeddings"] = False
        d["hidden_act"] = "silu"
        return d

    def to_released_dict(self) -> dict:
        """config.json as Qwen3.6-35B-A3B ships it: multimodal wrapper, text under `text_config`."""
        text = self.to_text_dict()
        text["model_type"] = "qwen3_5_moe_text"
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def default_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Three linear-attention layers, then one full-attention layer, repeated.

    Empty when num_layers is not a positive integer: validation then reports num_hidden_layers.
    """
    if not _is_count(num_layers) or num_layers > MAX_VALUES["num_hidden_layers"]:
        return []
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


def _is_count(value) -> bool:
    """A positive integer (a JSON true is not one)."""
    return _is_int(value) and value > 0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _value_problem(name: str, value, kind) -> str | None:
    """What is wrong with one field's value on its own (its type and range), or None."""
    top = MAX_VALUES.get(name, MAX_INT)
    if kind is int:
        if name in MAY_BE_ZERO:
            ok = _is_int(value) and value >= 0
            return None if ok and value <= top else f"{name}={value!r} must be a non-negative integer up to {top}"
        if not _is_count(value):
            return f"{name}={value!r} must be a positive integer"
        return None if value <= top else f"{name}={value} is larger than {top}, more than any model has: corrupt config"
    if kind is float:
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            return f"{name}={value!r} must be a positive number (and finite)"
        return None if value <= top else f"{name}={value} is larger than {top}, more than any model uses: corrupt config"
    if kind is bool:
        return None if isinstance(value, bool) else f"{name}={value!r} must be true or false"
    if kind is str:
        return None if isinstance(value, str) else f"{name}={value!r} must be a string"
    if kind == list[str]:
        ok = isinstance(value, list) and all(isinstance(item, str) for item in value)
        return None if ok else f"{name} must be a list of strings, got {type(value).__name__}"
    raise TypeError(f"ModelConfig.{name}: no validation rule for type {kind}")


def _interval_of(layer_types: list[str]) -> int:
    full = [i for i, t in enumerate(layer_types) if t == FULL]
    return full[0] + 1 if full else len(layer_types) + 1


# The released Qwen3.6-35B-A3B text config (the defaults of transformers' configuration_qwen3_5_moe.py):
# the numbers chapters use to reason about the real model without its weights.
QWEN36_35B_A3B = ModelConfig(
    vocab_size=248_320,
    hidden_size=2048,
    num_hidden_layers=40,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    mtp_num_hidden_layers=1,
)
