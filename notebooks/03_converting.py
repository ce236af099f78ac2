# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 3. Converting to one file
#
# `qmtp.convert` (or `python -m qmtp convert SRC DST`) turns a released checkpoint into one
# `model.safetensors` that holds {term}`trunk` and MTP {term}`head`, with the fixes applied once and recorded, the trunk
# quantized and the head kept in bf16. It streams: one tensor group at a time is read, fixed,
# quantized and written, into a temporary folder that is renamed into place only when it is complete.
#
# The head stays in bf16 unless `mtp_bits` asks otherwise, for two reasons. It is a small share of the file
# ({doc}`01_anatomy` sizes it at each width), so rounding it saves little. And a drafter is worth only as much
# as it agrees with the trunk, and rounding its weights changes its drafts, not the trunk's choices, so it can
# lower that agreement; lemon-mlx-engine's model card recommends a bf16 head. What each head width costs in
# acceptance is measured in {doc}`04_quantizing`, on the bundled model only: whether the real head keeps its
# acceptance at fewer bits needs its weights.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - how `qmtp.convert` streams a checkpoint into one `model.safetensors`: fixes applied once and recorded,
#   trunk quantized, head kept bf16;
# - what the metadata of the converted file records, and that nothing is lost on the way;
# - that mlx-lm reads the same file and drops the head.
#
# **What runs here.** The bundled model is converted into a temporary folder and loaded back, by qmtp and by
# mlx-lm; the benchmark of a multi-gigabyte conversion is described but not run. The chapter's run time in
# this build is in the {doc}`execution table <../book/execution>`; the download button at the top of the page
# gives this notebook, to run it yourself.
#
# **At full size** ({doc}`the budget <real_checkpoint>`): {glue:md}`budget_note`
# :::

# %% tags=["hide-input"]
import inspect
import json
import shutil
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

# qmtp first: it chooses the BLAS that MLX loads when first imported (qmtp.blas)
import qmtp
import mlx.core as mx
from IPython.display import Markdown
from mlx.utils import tree_flatten, tree_map
from myst_nb import glue
from qmtp.book import budget, evaluate, inventory, results
from qmtp.convert import convert

path = inventory.model_path()
print(inventory.describe(path))
workdir = Path(tempfile.mkdtemp(prefix="qmtp-chapter3-"))
config = qmtp.ModelConfig.from_file(path)
FULL = budget.active(config)  # the full-size release (qmtp.book.budget)
load_options = dict(layers=budget.LAYERS) if FULL else {}
glue("budget_note", Markdown(budget.plan("03_converting")), display=False)

# %%
started = time.perf_counter()
if FULL:  # one conversion, kept for chapters 4 to 6 (made here, or found again)
    target = budget.decoding_model(path)
else:
    target = workdir / "q8"
    convert(path, target, bits=8, progress=False)
convert_seconds = time.perf_counter() - started

# %% [markdown]
# How long that took, beside a plain copy of the same files:

# %%
started = time.perf_counter()
shutil.copytree(path, workdir / "copy")
copy_seconds = time.perf_counter() - started
source_mb = qmtp.Checkpoint(path).nbytes / 1e6
{"source MB": source_mb, "convert s": convert_seconds, "copy s": copy_seconds}

# %% tags=["remove-cell"]
glue("source_mb", source_mb, display=False)
glue("convert_s", convert_seconds, display=False)
glue("convert_mb_s", source_mb / convert_seconds, display=False)
glue("copy_s", copy_seconds, display=False)

# %% [markdown]
# The conversion read {glue:text}`source_mb:.1f` MB of source in {glue:text}`convert_s:.2f` s
# ({glue:text}`convert_mb_s:.0f` MB/s), where copying the same files took {glue:text}`copy_s:.3f` s. At this size
# the time is mostly fixed costs (starting the streams and the writer, reading the tokenizer, writing the
# metadata), so it says nothing of a full-size conversion; the one measured at full size is in *How a conversion
# streams*, below.

# %% [markdown]
# ## What moves where
#
# The released names (`model.language_model.*`, fused `gate_up_proj`) become mlx-lm's names
# (`language_model.model.*`, experts stacked per projection as `switch_mlp`); the head keeps its `mtp.`
# prefix and gets its routed experts stacked the same way. A quantized weight becomes three tensors: the
# packed codes, one scale and one bias per group.

# %%
source, converted = qmtp.Checkpoint(path), qmtp.Checkpoint(target)
released = inventory.tensor_listing(source, "model.language_model.layers.0.mlp.experts")
trunk_experts = inventory.tensor_listing(converted, "language_model.model.layers.0.mlp.switch_mlp")
head_experts = inventory.tensor_listing(converted, "mtp.layers.0.mlp.switch_mlp")
Markdown(
    "**Layer 0's experts, as released**\n\n" + inventory.listing_table(released)
    + "\n\n**Layer 0's experts, converted**\n\n" + inventory.listing_table(trunk_experts)
    + "\n\n**The head's experts, converted (bf16)**\n\n" + inventory.listing_table(head_experts)
)

# %% tags=["remove-cell"]
# the group size the conversion above used: convert's default
group_size = inspect.signature(convert).parameters["group_size"].default
real_inter = qmtp.QWEN36_35B_A3B.moe_intermediate_size
down_quantized = config.moe_intermediate_size % group_size == 0
glue("group_size", group_size, display=False)
glue("tiny_moe_inter", config.moe_intermediate_size, display=False)
glue("real_moe_inter", real_inter, display=False)
glue("real_down_groups", real_inter // group_size, display=False)
glue("down_proj_quantized", "is" if down_quantized else "is not", display=False)
glue(
    "down_proj_outcome",
    "is quantized like gate_proj and up_proj" if down_quantized
    else "is still bf16, while gate_proj and up_proj, whose input is the hidden state, are quantized",
    display=False,
)

# %% [markdown]
# A weight is quantized in groups of {glue:text}`group_size` values along its input (last) dimension, so only a
# weight whose input dimension is a multiple of the group size can be; any other stays bf16. An expert's
# `down_proj` takes the expert's intermediate activations as input: {glue:text}`tiny_moe_inter` values wide in
# this model, which {glue:text}`down_proj_quantized` a multiple of {glue:text}`group_size`: that is why the
# converted `down_proj` above {glue:text}`down_proj_outcome`. The real model's experts are {glue:text}`real_moe_inter` wide, {glue:text}`real_down_groups`
# groups: there every expert projection is quantized.

# %% [markdown]
# ## The metadata
#
# The file records what it is: the format, the fixes now in its weights (so no loader applies them
# again), the width of every tensor and a digest of the source it came from.

# %%
meta = converted.metadata
Markdown(inventory.metadata_table(meta))

# %% [markdown]
# Two of the per-tensor entries of `qmtp.quantization`, one quantized and one kept as it was:

# %%
widths = json.loads(meta["qmtp.quantization"])
dict([next((k, v) for k, v in widths.items() if v["bits"]), next((k, v) for k, v in widths.items() if not v["bits"])])

# %%
try:
    convert(target, workdir / "again", bits=8, progress=False)
except qmtp.QmtpError as err:
    print(textwrap.fill(f"refused: {err}", 80))

# %% [markdown]
# Converting the converted folder again is refused: it would shift the norms a second time.
#
# ## Nothing lost
#
# The converted model against the source: every tensor the conversion left unquantized (norms, conv
# kernels, decay rates, the bf16 head) must be equal after the fixes, the head complete, and the logits
# close (8-bit trunk).

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    original = qmtp.load(path, **load_options)
    roundtrip = qmtp.load(target, **load_options)
texts = evaluate.heldout_texts(1)[: budget.FIXES_TEXTS] if FULL else evaluate.heldout_texts(3)
close = evaluate.logit_agreement(roundtrip, original, texts)
converted_params = dict(tree_flatten(roundtrip.parameters()))
source_params = dict(tree_flatten(original.parameters()))
quantized = {n.rsplit(".", 1)[0] for n in converted_params if n.endswith(".scales")}
unquantized = [n for n in converted_params if n.rsplit(".", 1)[0] not in quantized]
unquantized_equal = all(mx.array_equal(converted_params[n], source_params[n]).item() for n in unquantized)
head_complete = roundtrip.mtp is not None and roundtrip.mtp.has_routed_experts
assert unquantized_equal and head_complete
{"unquantized tensors": len(unquantized), "all equal to the source's": unquantized_equal,
 "head complete": head_complete, **close}

# %% tags=["remove-cell"]
glue("check_bits", budget.BITS if FULL else 8, display=False)
glue("q8_top1", close["top1_agreement"], display=False)
glue("q8_relerr", close["max_relative_error"], display=False)

# %% [markdown]
# The {glue:text}`check_bits`-bit model picks the same next token as the bf16 source on {glue:text}`q8_top1:.3f` of the
# positions (largest relative logit difference {glue:text}`q8_relerr:.3f`).
#
# ## mlx-lm reads the same file, and drops the head
#
# mlx-lm's loader opens the converted folder: it sees the conv kernels already in MLX's layout, so it does
# not shift the norms again, and its `sanitize` discards every `mtp.*` tensor.

# %%
from mlx_lm.utils import load_model

if not FULL:  # a second whole model in memory: left out at full size (qmtp.book.budget)
    reference, _ = load_model(target)
    # MLX's CPU backend multiplies unquantized experts in float32 only; qmtp loads them that way, so mlx-lm must too
    as_float32 = lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p
    reference.update(tree_map(as_float32, reference.parameters()))
    names = [n for n, _ in tree_flatten(reference.parameters())]
    mtp_names = [n for n in names if n.startswith("mtp") or ".mtp." in n]
    same = evaluate.logit_agreement(roundtrip, reference, texts)
    print("mlx-lm parameters:", len(names), "MTP:", len(mtp_names))
    print(same)

# %% tags=["remove-cell"]
glue("mlxlm_mtp_tensors", float("nan") if FULL else len(mtp_names), display=False)
glue("mlxlm_relerr", float("nan") if FULL else same["max_relative_error"], display=False)

# %% [markdown]
# mlx-lm holds {glue:text}`mlxlm_mtp_tensors` MTP tensors after loading, and its trunk logits differ from
# qmtp's on the same file by at most {glue:text}`mlxlm_relerr:.1e` relative: the same trunk, without the
# head that drafts.

# %% tags=["remove-cell"]
saved = results.save(
    "03_converting",
    path,
    {
        "bits": budget.BITS if FULL else 8,
        "top1_agreement": close["top1_agreement"],
        "max_relative_error": close["max_relative_error"],
        "unquantized_equal": bool(unquantized_equal),
        "mlx_lm_mtp_tensors": None if FULL else len(mtp_names),
    },
)

# %% [markdown]
# ## How this converter differs from lemon-mlx-engine's
#
# The converter of the engine this book started from (lemon-mlx-engine's `convert`) writes the same kind of
# file: one `model.safetensors` with `format: mlx`, head keys under `mtp.`, the head's experts stacked as
# `switch_mlp`, a `quantization` block in `config.json`, the router at 8 bits, the norms shifted in float32,
# the tokenizer files copied. Where the two differ, qmtp follows mlx-lm or what this book measures:
#
# - **the head's width**: lemon-mlx-engine's converter quantizes the head at `--bits` unless it is given `--mtp-bits 0`
#   (its `examples/convert.cpp`: `mtp_bits` defaults to `bits`), although lemon-mlx-engine's model card recommends a
#   bf16 head; qmtp keeps the head in bf16 unless asked otherwise (`mtp_bits=None`; chapter 4 measures what
#   quantizing it costs), and with `mtp_bits` set quantizes the head's router gates at the router width, as
#   in the trunk;
# - **`lm_head`**: lemon-mlx-engine defaults to 8 bits, qmtp to `bits`, as mlx-lm does (`lm_head_bits=8` gives
#   lemon-mlx-engine's);
# - **`shared_expert_gate`**: lemon-mlx-engine's router rule matches only `mlp.gate`, so it quantizes this `[1, H]` gate
#   at `--bits`; qmtp, like mlx-lm, keeps it at the router width;
# - **the `quantization` block**: lemon-mlx-engine writes only the default `{group_size, bits}`, with which its own
#   loader reads an 8-bit router as 4-bit and refuses the file; qmtp writes an entry for every module stored
#   at another width, as mlx-lm does;
# - **the fixes**: lemon-mlx-engine shifts the norms unconditionally, so converting a converted model shifts them twice
#   (chapter 2 shows what that does); qmtp records the fixes in the file and refuses a converted source;
# - **memory**: lemon-mlx-engine loads the whole model before writing; qmtp holds a few blocks of rows at a time, writes
#   into a temporary folder and renames it into place only when everything is written.

# %% [markdown]
# ## How a conversion streams
#
# `convert` never holds the model, nor even a whole tensor: it reads a block of about 16 MiB of one tensor's
# rows at a time (a few experts; the gate or up half of a fused tensor read straight from the file, without
# mapping it), fixes and quantizes it on two CPU streams while a worker thread hands the previous blocks to
# the writer, and renames the finished folder into place only after its files are on the disk. What that buys
# in time and memory is measured by `python -m qmtp bench convert`: it writes a synthetic checkpoint of the real
# layer widths and times qmtp (and, if asked, `mlx_lm.convert`) beside a plain `cp` of the source in the same
# run, with each one's peak memory. At full size that takes minutes, so it ran once outside this build, and
# this page reads the report it saved:
#
# {glue:md}`full_conversion`

# %% tags=["remove-cell"]
full_run = budget.saved_conversion()
if full_run is None:
    full_conversion = ("No full-size conversion was saved for this build (`python -m qmtp bench convert --preset "
                       "qwen3.6-35b-a3b` makes one).")
else:
    qmtp_run, cp_run = full_run["tools"]["qmtp"], full_run["tools"]["cp"]
    read_gb = full_run["source_bytes"] / 1e9
    written_gb = qmtp_run["output_bytes"] / 1e9
    disk_floors = "; ".join(
        f"{(read_gb + written_gb) / rate / 60:.1f} min on {disk} (assumed {rate:g} GB/s, not measured)"
        for disk, rate in budget.ASSUMED_DISK_GB_PER_S.items())
    full_conversion = (
        f"Measured {full_run['when']} on {full_run['where']}: `qmtp convert` turned a synthetic checkpoint of the "
        f"real model's shapes ({full_run['num_hidden_layers']} layers, {full_run['num_experts']} experts, "
        f"{read_gb:.0f} GB of bf16 source) into a {full_run['bits']}-bit one of {written_gb:.0f} GB in "
        f"{qmtp_run['seconds'] / 60:.1f} min, {qmtp_run['source_mb_per_second']:.0f} MB of source per second, "
        f"with a peak of {qmtp_run['peak_rss_bytes'] / 2**20:.0f} MiB resident, where `cp` of the same files took "
        f"{cp_run['seconds']:.1f} s. That `cp` time shows what the source was: a sparse file whose expert "
        f"weights are holes, read as zeros without touching the disk. So the measured minutes are the CPU's work "
        f"(fixing, quantizing and writing) on that machine. For the real checkpoint the release must also be "
        f"read from disk: moving {read_gb:.0f} GB in and {written_gb:.0f} GB out takes at least {disk_floors}. "
        f"A real conversion takes at least the longer of that disk time and the CPU's; how far the two overlap "
        f"was not measured, and the CPU's time is one shared two-core machine's, which does not carry over to "
        f"another. The peak memory is what carries over: `convert` holds a few blocks, not the model, so it "
        f"needs little memory at any size.")
glue("full_conversion", Markdown(full_conversion), display=False)

# %% [markdown]
# ## Exercises
#
# Each runs on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Convert with the head quantized too: `qmtp.convert(path, dst, bits=4, mtp_bits=4)` into a new temporary
#    folder, and list the head's tensors in the result.
#
#    *Where the answer shows:* the head's tensors gain `.scales` and `.biases` like the trunk's in *What moves
#    where*; what that costs in acceptance is measured in {doc}`04_quantizing`, *Does the head need bf16?*.
#
# 2. Convert the already converted folder again.
#
#    *Where the answer shows:* `convert` refuses it and says why (its metadata records the fixes): the reason
#    the *+1 applied twice* of {doc}`02_fixes` cannot happen here.
