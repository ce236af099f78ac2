"""Loading a checkpoint into a `Model`: where the path comes from, what fits in memory, and the fixes applied on the way."""

from __future__ import annotations

import numbers
import os
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import cores
from . import fixes as fixes_mod
from . import layout
from . import memory
from . import parallel
from .conventions import is_small_critical, keeps_float32
from .errors import CheckpointError, UsageError, user_path
from .model import Model, release_at_thread_exit
from .source import HEAD_FULL, HEAD_SHARED_ONLY, Source

BUNDLED_MODEL = Path(__file__).parent / "assets" / "tiny"


def default_dtype():
    """float32 on the CPU (its gather_mm computes only float32), bfloat16 on an accelerator."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def resolve_path(path) -> Path:
    """An explicit path, else $QMTP_MODEL, else the bundled tiny model."""
    if path is None:
        path = os.environ.get("QMTP_MODEL") or BUNDLED_MODEL
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"path={path!r}: give a model directory as a str or pathlib.Path, not {type(path).__name__}")
    path = user_path(path, "model directory")
    if not path.exists():
        raise CheckpointError(f"{path}: no such model directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is not a directory; give the model directory (config.json and safetensors)")
    return path


def load(path=None, fixes=fixes_mod.DEFAULT_FIXES, dtype=None, head: bool = True, tokenizer: bool = True,
         layers: int | None = None, group=None) -> Model:
    """Load a checkpoint directory (any released layout, or a converted one) into a `Model`.

    `layers`: None (the default) loads every trunk layer config.json declares, and refuses a checkpoint that
    holds more (trunk layers past num_hidden_layers, head layers past mtp_num_hidden_layers): a config that
    describes fewer layers than the weights would otherwise run a shorter model without a word. An int k loads
    only the first k trunk layers, on purpose: the config's layer pattern cut to k (`model.config` then says k
    layers), with the embeddings, the final norm, lm_head and the MTP head as stored. The model is a different,
    much worse one (its text is not the full model's), but a chapter that has to stay within a memory budget can
    still run every piece on the real weights: `qmtp.load(path, layers=4)` reads 4 of the 40 trunk layers of
    Qwen3.6-35B-A3B (the embeddings, lm_head and the head's layer whole: 9.7 GiB in bfloat16, twice that in
    the CPU's default float32, so pass `dtype=mlx.core.bfloat16` on a small machine). Layers past k are neither
    read nor needed (a checkpoint of only the first k loads). A UsageError when k < 1 or k is more than the
    layers config.json declares or the checkpoint stores.

    `fixes` lists the load-time fixes to apply: ("norm", "conv") by default, () for the raw checkpoint as
    stored, or one name ("norm"). Fixes a qmtp-written checkpoint records as already applied are never applied
    again. Weights left without a fix load with a UserWarning saying what that does (no conv fix: the first
    forward through a DeltaNet layer fails with MLX's conv1d error, kept so a chapter can show it).
    Quantized weights (a `qmtp.convert` output, or an mlx-lm conversion) load into quantized layers
    (`nn.QuantizedLinear`, `nn.QuantizedEmbedding`, `QuantizedStackedLinear`) at the width each one is stored
    with; their scales and biases take `dtype` like every other weight.
    With no path: $QMTP_MODEL if set, else the bundled tiny model.
    A thread that loads frees its MLX streams as it ends, as one that generates does.

    `group`: an MLX distributed group (`mx.distributed.init()` in a program started by `mlx.launch`) to spread
    the routed experts over (`qmtp.parallel`): rank r of N reads and holds only experts r*E/N .. (r+1)*E/N - 1
    of every MoE layer, everything else whole; `generate` on the result returns, on every rank, the tokens of
    one process. Every rank must call `load` with the same arguments on the same checkpoint: a
    `parallel.DistributedError` on every rank when they did not, or when the E experts do not split evenly.
    Before the first token every rank proves it holds the same model: the ranks compare config.json, the
    tokenizer files, chat template, generation config and the safetensors headers by name, and each hashes the
    bytes of every tensor it loads (XXH3, as it reads them), checked against the digests a qmtp conversion
    recorded (`qmtp.digests`); a checkpoint without them is checked against rank 0, which then also reads the
    other ranks' experts (the whole checkpoint once). The error names the file, or the tensor, expert and rank.
    A group of one rank (or None) loads the whole model.
    """
    release_at_thread_exit()
    path = resolve_path(path)
    requested, layers = _check_arguments(fixes, dtype, head, tokenizer, layers, group)
    requested_dtype, dtype = dtype, dtype or default_dtype()
    source = Source.open(path, layers=layers)
    config = source.config
    shard = None
    if group is not None and group.size() > 1:
        # First, before any check that could fail on one rank only: every rank learns whether all opened the same
        # checkpoint files with the same settings, and all raise together when not (a rank that raised alone would
        # leave the others waiting in the model's first collective).
        parallel.same_files(group, source, (str(requested_dtype), layers, head, tuple(requested), group.size()))
        shard = parallel.ExpertShard.of(group, config.num_experts)
    model, fix_plan = _model_for(source, head, requested, shard)
    # Before any weight is read: past the memory there is, a load ends in the OOM killer or a segfault.
    dtype = _dtype_that_fits(model, dtype, chosen=requested_dtype is None, path=path)
    # Stored in bfloat16 only for lack of memory, the weights are still computed in float32: the norms (a
    # few KB) stay float32, which makes every activation float32 from the first norm on. On the CPU a
    # quantized matmul with bfloat16 scales runs as fast as with float32 ones when its input is float32,
    # and several times slower when it is bfloat16.
    compute_float32 = requested_dtype is None and dtype == mx.bfloat16 and default_dtype() == mx.float32
    names = set(_flat_names(model))
    wanted = [name for name in source.plan.recipes if name in names]  # head tensors only when the head is loaded
    holdings = parallel.Holdings(source, shard, wanted) if shard is not None else None
    try:
        weights = _read_weights(source, wanted, fix_plan, dtype, compute_float32, shard, holdings)
    finally:
        if holdings is not None:
            holdings.close()
    if len(wanted) != len(names):
        absent = sorted(names - set(wanted))
        raise CheckpointError(f"{path}: no tensor for {absent[0]} ({len(absent)} missing)")
    # update(), not load_weights(): with fixes=() the raw conv kernel keeps its stored [C, 1, K] shape, so
    # the chapter on the fixes can show what MLX does with it.
    model.update(tree_unflatten(weights))
    model.eval()
    model.fixes_applied = fix_plan.result
    for message in fix_plan.warnings(path):
        warnings.warn(message, stacklevel=2)
    if not config.tie_word_embeddings:  # after quantize_layers: lm_head is its final module now
        model._lm_head_split = cores.split_lm_head(model.lm_head)
    model.path = path
    model.shard = shard
    mx.clear_cache()  # the casts' freed buffers would otherwise stay in MLX's cache, counted in the RSS
    if tokenizer and ((path / "tokenizer.json").exists() or (path / "tokenizer.json").is_symlink()):
        from .tokenizer import Tokenizer

        model.tokenizer = Tokenizer.from_dir(path)
        model.tokenizer.check_fits(config.vocab_size, path)
    # Every tensor came from the files whose headers were read; if the folder was replaced meanwhile (a
    # `convert --force` into it), config.json or the tokenizer may be the other conversion's: refuse the mix.
    source.check_unchanged()
    source.ckpt.close()
    return model


def _check_arguments(fixes, dtype, head, tokenizer, layers, group) -> tuple[tuple[str, ...], int | None]:
    """`load`'s arguments checked before anything is read: (the fixes asked for, layers as an int or None)."""
    requested = fixes_mod.validate(fixes)
    if dtype is not None and not isinstance(dtype, mx.Dtype):
        raise UsageError(f"dtype={dtype!r}: give an MLX dtype such as mlx.core.float16 (not a string)")
    if dtype is not None and not mx.issubdtype(dtype, mx.floating):
        raise UsageError(f"dtype={dtype}: weights are computed in a floating-point dtype (float32, float16, bfloat16)")
    for flag, value in (("head", head), ("tokenizer", tokenizer)):
        if not isinstance(value, bool):
            raise UsageError(f"{flag}={value!r} must be True or False")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, numbers.Integral):
            raise UsageError(f"layers={layers!r}: give a number of trunk layers (an int), or None for all of them")
        layers = int(layers)
        if layers < 1:
            raise UsageError(f"layers={layers}: give at least 1 trunk layer, or None for all of them")
    if group is not None:
        parallel.world(group)  # a group, or a DistributedError before anything is read
    return requested, layers


def _model_for(source: Source, head: bool, requested, shard) -> tuple[Model, fixes_mod.FixPlan]:
    """The checks of what the checkpoint holds (the order decides which error comes first), then the model of
    placeholders it loads into (this rank's experts only, quantized layers at their widths) and the fixes."""
    path, config = source.path, source.config
    source.require_declared()  # before the shapes: a short config is the cause, not what follows from it
    widths = source.widths
    source.require_trunk()
    status = source.head_status() if head else None  # head=False: the head is neither loaded nor checked
    if status == HEAD_SHARED_ONLY:
        warnings.warn(
            f"{path}: the MTP head has NO routed experts (mtp.layers.0.mlp.experts.* absent): it will draft "
            f"with its shared expert only, as crippled conversions ship it. Acceptance will be far below "
            f"that of the complete head.",
            stacklevel=3,
        )
    fix_plan = source.fix_plan(requested)  # a record the tensors contradict is not believed
    if config.tie_word_embeddings and any(layout.internal_name(n) == "lm_head.weight" for n in source.ckpt.names()):
        warnings.warn(f"{path}: config.json says tie_word_embeddings: true, but the checkpoint stores its own "
                      f"lm_head; following the config, lm_head is not used and embed_tokens scores the tokens",
                      stacklevel=3)
    model = Model(config, head=status in (HEAD_FULL, HEAD_SHARED_ONLY), head_routed_experts=status == HEAD_FULL)
    if shard is not None:  # before the quantized twins are made: they take the held stacks' shapes
        parallel.hold_experts(model, shard)
    quantize_layers(model, widths)
    return model, fix_plan


def _read_weights(source: Source, wanted: list[str], fix_plan, dtype, compute_float32: bool, shard,
                  holdings) -> list[tuple[str, mx.array]]:
    """The weights `wanted` (internal names, in the plan's order), fixed and cast, as (name, array) pairs.

    A NaN or Inf in a small tensor where one value changes every token is refused by name. On a rank of a group,
    every tensor's bytes as stored are hashed as they are read (`holdings`), and the ranks agree that they hold
    the same model before that refusal, which then comes from every rank alike."""
    reader = layout.Reader(source.ckpt, source.config)
    weights, checked, flags = [], [], []
    for name in wanted:
        recipe = source.plan.recipes[name]
        # a rank reads only its block of each routed expert stack (its rows of the first axis)
        rows = shard.rows if shard is not None and parallel.is_routed_expert(name) else None
        raw = reader.materialise(recipe, rows)
        if holdings is not None:
            mx.eval(raw)
            holdings.add(name, raw, rows)
            if rows is not None and holdings.reads_every_expert:
                holdings.add_others(reader, name, recipe)
        w = fixes_mod.apply(name, raw, fix_plan.applying)
        del raw
        finite = None
        if mx.issubdtype(w.dtype, mx.floating):  # quantized codes stay uint32
            kept = keeps_float32(name) or (compute_float32 and name.endswith("norm.weight"))
            w = w.astype(mx.float32 if kept else dtype)
            if is_small_critical(name):  # one NaN here changes every token: refuse it by name
                finite = mx.isfinite(w).all()
                checked.append(recipe.sources[0])
                flags.append(finite)
        mx.eval(w) if finite is None else mx.eval(w, finite)
        weights.append((name, w))
    if holdings is not None:
        holdings.agree(shard.group)
    # Read back together: one host read for all the flags (a few hundred at full size)
    bad = next((stored for stored, ok in zip(checked, mx.stack(flags).tolist() if flags else []) if not ok), None)
    if bad is not None:
        raise source.nonfinite_error(bad)
    return weights


def _dtype_that_fits(model: Model, dtype, chosen: bool, path: Path):
    """`dtype` if the weights fit in it; else, when qmtp chose float32 (the CPU default) and the user did not,
    bfloat16 with a warning (a quantized full-size model fits a 24 GB machine only so); else a one-line refusal."""
    try:
        memory.check_fits(loaded_bytes(model, dtype), f"{path}: loading the model in {dtype}")
        return dtype
    except memory.NotEnoughMemoryError:
        if not chosen or dtype == mx.bfloat16:
            raise
    memory.check_fits(loaded_bytes(model, mx.bfloat16), f"{path}: loading the model (even in bfloat16)")
    name = str(dtype).replace("mlx.core.", "")
    warnings.warn(f"{path}: the model does not fit in memory in {name}; loading it in bfloat16 (computing in "
                  f"{name})", stacklevel=3)
    return mx.bfloat16


def loaded_bytes(model: Model, dtype) -> int:
    """The bytes `model`'s weights take once loaded: quantized codes as stored, float weights in `dtype` (float32
    for those `conventions.keeps_float32` names). Read from the placeholders' shapes, which are never evaluated."""
    total = 0
    for name, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            total += p.size * (4 if keeps_float32(name) else dtype.size)
        else:
            total += p.nbytes
    return total


def quantize_layers(model: Model, widths: dict[str, tuple[int, int]]) -> None:
    """Swap each layer whose weight is stored quantized for its quantized twin, at that weight's width.

    `widths` maps internal weight names to (bits, group_size) (`layout.quantization`). The new layers hold
    placeholders until the checkpoint's codes, scales and biases are loaded into them.
    """
    if not widths:
        return

    def predicate(path: str, module: nn.Module):
        width = widths.get(f"{path}.weight")
        return width is not None and {"group_size": width[1], "bits": width[0], "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def _flat_names(module: nn.Module) -> list[str]:
    return [name for name, _ in tree_flatten(module.parameters())]
