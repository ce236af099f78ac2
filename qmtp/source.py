"""One way to open a checkpoint directory: config, tensors, layout plan, widths, head status, carried fixes.

`loading.load`, `convert` and `python -m qmtp doctor` all open checkpoints through `Source.open`, so they agree
on what a checkpoint holds. Past the config and the tensor listing, each part is worked out when first asked
for: every caller keeps the order of its own checks, and so which error it reports first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from . import fixes as fixes_mod
from . import layout
from .checkpoint import Checkpoint, _identity_at, read_json
from .config import ModelConfig
from .errors import CheckpointError, UsageError

# What `Source.head_status` finds.
HEAD_NOT_DECLARED = "not declared"  # config.json declares no MTP head
HEAD_MISSING = "missing"  # declared, but no mtp.* tensor is stored
HEAD_FULL = "full"
HEAD_SHARED_ONLY = "shared expert only"  # no routed experts, as crippled conversions ship the head


@dataclass
class Source:
    path: Path
    config: ModelConfig  # what is loaded: the declared config, or its first `layers` trunk layers
    ckpt: Checkpoint
    declared: ModelConfig | None = None  # config.json as declared (None: the same as `config`)
    layers: int | None = None  # None: every declared trunk layer; k: only the first k

    @classmethod
    def open(cls, path, layers: int | None = None) -> Source:
        """Read config.json and list the tensors (headers only). `path` is an existing directory.

        `layers=k` (a checked int) keeps only the first k trunk layers: the config's layer pattern cut to k.
        UsageError when config.json declares fewer than k.
        """
        path = Path(path)
        config_seen = _identity_at(path / "config.json")  # before reading it: a later change is then seen
        declared = ModelConfig.from_file(path)  # ConfigError when config.json is missing or unusable
        config = declared
        if layers is not None:
            if layers > declared.num_hidden_layers:
                raise UsageError(f"layers={layers}: {path / 'config.json'} declares {declared.num_hidden_layers} trunk "
                                 f"layers; give 1 to {declared.num_hidden_layers}, or None for all of them")
            config = declared.replace(num_hidden_layers=layers, layer_types=list(declared.layer_types[:layers]))
        source = cls(path, config, Checkpoint(path), declared, layers)  # CheckpointError when there are no weights
        source.ckpt.seen.setdefault(path / "config.json", config_seen)
        return source

    def check_unchanged(self) -> None:
        """CheckpointError when config.json, the index or a shard is no longer the file read (another conversion
        into the folder, say): what was read may mix the two. Called when a load or a conversion has read it all."""
        self.ckpt.check_unchanged()

    @cached_property
    def raw_config(self) -> dict:
        """config.json as stored (a converter copies it; the quantization block marks a conversion)."""
        return read_json(self.path / "config.json")

    @cached_property
    def full_plan(self) -> layout.Plan:
        """The plan of every layer config.json declares (duplicates refused, undeclared layers listed)."""
        return layout.plan(self.ckpt, self.declared or self.config)

    @cached_property
    def plan(self) -> layout.Plan:
        """What is read: `full_plan`, or with `layers=k` its first k trunk layers (embeddings, final norm,
        lm_head and the head as well)."""
        if self.layers is None:
            return self.full_plan
        return layout.first_layers(self.full_plan, self.layers)

    def undeclared(self) -> str | None:
        """Why the checkpoint holds more than config.json declares (None when it does not): trunk layers past
        num_hidden_layers, head layers past mtp_num_hidden_layers. Loading it would silently drop them."""
        p, declared = self.full_plan, self.declared or self.config
        if trunk := p.beyond_trunk():
            return (f"{self.path}: the checkpoint holds {p.stored_layers} trunk layers (e.g. tensor {trunk[0]!r}) "
                    f"but config.json declares num_hidden_layers={declared.num_hidden_layers}: the config describes "
                    f"fewer layers than the weights; correct config.json (or, to run a part of the model on "
                    f"purpose, qmtp.load(path, layers=k))")
        if head := p.beyond_head():
            n = declared.mtp_num_hidden_layers
            return (f"{self.path}: the checkpoint holds MTP head tensor {head[0]!r} ({len(head)} such tensors), "
                    f"but config.json declares " + (f"a head of {n} layer (mtp_num_hidden_layers={n})" if n else
                                                   "no MTP head (mtp_num_hidden_layers=0)")
                    + ": the config describes fewer layers than the weights; correct config.json")
        return None

    def require_declared(self) -> None:
        """Refuse a checkpoint holding layers config.json does not declare (even with `layers=k`: such a
        config cannot be trusted for the layers kept either)."""
        reason = self.undeclared()
        if reason:
            raise CheckpointError(reason)

    @cached_property
    def widths(self) -> dict[str, tuple[int, int]]:
        """Internal weight name -> (bits, group_size) of each quantized weight; every stored shape checked."""
        widths = layout.quantization(self.ckpt, self.plan, self.config)
        layout.check_shapes(self.ckpt, self.plan, self.config, widths)
        return widths

    def missing_trunk(self) -> list[str]:
        return layout.missing_trunk(self.plan, self.config)

    def require_trunk(self) -> None:
        """Refuse a checkpoint whose trunk lacks a tensor: nothing can run without it. With `layers=k`, a
        UsageError when fewer than k trunk layers are stored."""
        missing = self.missing_trunk()
        stored = self.full_plan.stored_layers
        if missing and self.layers is not None and 0 < stored < self.layers:
            raise UsageError(f"layers={self.layers}: {self.path} stores {stored} trunk layers; give 1 to {stored}")
        if missing:
            raise CheckpointError(
                f"{self.path}: trunk tensor {missing[0]} is missing ({len(missing)} missing in all); "
                f"the checkpoint is incomplete or of another layout"
            )

    def head_status(self) -> str:
        """HEAD_NOT_DECLARED, HEAD_MISSING, HEAD_FULL or HEAD_SHARED_ONLY; IncompleteHeadError for a stored head
        that lacks some of its tensors (a head without any routed experts is HEAD_SHARED_ONLY, not an error)."""
        if not self.config.has_mtp:
            return HEAD_NOT_DECLARED
        if not self.plan.head_present:
            return HEAD_MISSING
        layout.check_head(self.plan, self.config, self.path)
        return HEAD_FULL if self.plan.head_has_routed_experts else HEAD_SHARED_ONLY

    # ---- the fixes ----------------------------------------------------------------------------------------------
    @cached_property
    def conv_shape(self) -> tuple[int, ...] | None:
        return fixes_mod.stored_conv_shape(self.ckpt, self.plan)

    @property
    def has_conv(self) -> bool:
        return self.conv_shape is not None

    @cached_property
    def recorded(self) -> tuple[str, ...] | None:
        """The fixes a qmtp-written file records as applied; None without a record."""
        return fixes_mod.recorded(self.ckpt.metadata, self.path)

    @cached_property
    def carried(self) -> tuple[str, ...]:
        """The fixes already in the weights (the record, else what the conv layout says)."""
        return fixes_mod.already_applied(self.ckpt.metadata, self.conv_shape, self.path)

    def check_carried(self) -> None:
        """CheckpointError when the tensors contradict `carried`: believing it would shift the norms wrongly."""
        fixes_mod.check_against_tensors(self.ckpt, self.plan, self.carried, self.path)

    def fix_plan(self, requested) -> fixes_mod.FixPlan:
        """The fixes to apply when reading, for these requested ones: never one the weights already carry."""
        requested = fixes_mod.validate(requested)
        self.check_carried()
        return fixes_mod.FixPlan(self.carried, tuple(f for f in requested if f not in self.carried), self.has_conv)
