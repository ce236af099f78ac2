# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: mystnb
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   mystnb:
#     execution_mode: force
# ---

# %% [markdown]
# # Running it on the real checkpoint
#
# Every chapter runs on the bundled tiny model unless told otherwise. This page says how to point them at the
# released weights, what each chapter then holds in memory and writes to disk, how long it is predicted to take,
# and the budget that keeps the whole book within a 64 GB or a 128 GB machine. Sizes are computed from the
# release's config (`qmtp.sizes`), times from what chapter 6 measured in this build (`qmtp.book.budget`).
#
# ## Installing, per backend
#
# qmtp's extras pick MLX's build: `pip install -e '.[cpu]'` (MLX's CPU wheel, Linux), `'.[cuda]'` (MLX's CUDA
# wheel, an NVIDIA GPU), `'.[metal]'` (MLX itself, which computes on Apple silicon's GPU through Metal). ROCm has
# no extra: `make rocm-venv` makes the project's venv with `--system-site-packages`, marks it as a ROCm venv and
# installs qmtp without any extra, so that the MLX built for the machine's AMD GPU, installed outside the venv,
# stays the one imported (an extra, or `requirements.txt`, would put an MLX wheel in front of it). MLX's own
# repository has no released ROCm backend: support is an open feature request
# ([ml-explore/mlx#2556](https://github.com/ml-explore/mlx/issues/2556)) and an open, experimental pull request
# ([ml-explore/mlx#2300](https://github.com/ml-explore/mlx/pull/2300), "[Experiment] ROCm backend"), whose thread
# shows builds from source with HIP for `gfx1151` (Strix Halo). So a ROCm MLX today is one the reader builds from
# that branch (or a fork of it); that no ROCm wheel is published is an assumption from those threads, not checked
# against every index. `python -m qmtp doctor` says which backend was imported.
#
# ## The weights
#
# The official bf16 weights are the Hugging Face repository `Qwen/Qwen3.6-35B-A3B`. With the `huggingface_hub`
# client (`pip install -U huggingface_hub`):
#
# ```sh
# hf download Qwen/Qwen3.6-35B-A3B --local-dir ~/models/Qwen3.6-35B-A3B
# ```
#
# (older clients: `huggingface-cli download` with the same arguments).
# The download is {glue:text}`release_gb:.0f` GB of safetensors. Then build the book on it, or start Jupyter
# with the variable set:
#
# ```sh
# QMTP_MODEL=~/models/Qwen3.6-35B-A3B make book
# ```
#
# Each chapter prints which model it uses in its first cell.
#
# Convert once, to the 4-bit model the chapters decode with (`python -m qmtp convert ~/models/Qwen3.6-35B-A3B q4
# --bits 4`). {glue:text}`conversion_time`

# %% tags=["hide-input"]
import textwrap

import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
from qmtp.book import budget, cost_model, inventory, machine, results

path = inventory.model_path()
print(inventory.describe(path))
throughput_saved = results.load("06_throughput", path)
widths = budget.widths_table()
release = widths[0]
glue("release_gb", release["disk GB"], display=False)
glue("release_f32", release["loaded GiB, float32"], display=False)
glue("release_bf16", release["loaded GiB, bf16"], display=False)
glue("q4_gb", widths[-1]["disk GB"], display=False)
glue("q4_f32", widths[-1]["loaded GiB, float32"], display=False)
glue("q4_bf16", widths[-1]["loaded GiB, bf16"], display=False)
glue("real_vocab", f"{qmtp.QWEN36_35B_A3B.vocab_size:,}", display=False)
glue("conversion_time", budget.conversion_sentence(budget.saved_conversion()), display=False)
glue("model_verdict", cost_model.verdict(), display=False)

GIB = 2**30
glue("release_fits_f32", budget.machines_phrase(budget.fitting(release["loaded GiB, float32"] * GIB)),
     display=False)
glue("release_fits_bf16", budget.machines_phrase(budget.fitting(release["loaded GiB, bf16"] * GIB)),
     display=False)
macs = budget.fitting(widths[-1]["loaded GiB, bf16"] * GIB, machines=(16, 24, 32, 48, 64, 96, 128))
glue("q4_fits_mac", f"a Mac with {macs[0]} GB of memory or more", display=False)
glue("runtime_gb", budget.RUNTIME_GB, display=False)
glue("fixes_loads", budget.FIXES_LOADS, display=False)
# one conversion per trunk width, one per head width, and the 6-bit one of the fault
conversions = len(budget.QUANT_TRUNK_WIDTHS) + len(budget.QUANT_HEAD_WIDTHS) + 1
glue("quant_conversions", conversions, display=False)

# %% [markdown]
# ## Memory and disk at each width
#
# On a CPU qmtp computes in float32, so every weight that is not quantized takes four bytes once loaded; when that
# does not fit, it keeps the weights in bfloat16 and still computes in float32 (`qmtp.load` says so). The table
# adds {glue:text}`runtime_gb:.1f` GiB for Python, MLX, the activations and transient copies to decide what fits.

# %% tags=["hide-input"]
columns = ("disk GB", "loaded GiB, float32", "loaded GiB, bf16")
one_decimal = {c: "{:.1f}" for c in columns}
Markdown(inventory.markdown_table(widths, list(widths[0]), one_decimal))

# %% [markdown]
# The release itself ({glue:text}`release_f32:.0f` GiB in float32, {glue:text}`release_bf16:.0f` GiB in
# bfloat16) fits {glue:text}`release_fits_f32` in float32; in bfloat16 it fits
# {glue:text}`release_fits_bf16` (with the runtime). A conversion with a 4-bit
# trunk and the head in bf16 is {glue:text}`q4_gb:.1f` GB on disk and {glue:text}`q4_f32:.1f` GiB loaded: that
# is the model to decode with on either machine.
#
# ## What each chapter does at full size, and how long
#
# Run as written, chapter 2 would load the whole model {glue:text}`fixes_loads` times and chapter 4 would convert
# it {glue:text}`quant_conversions` times.
# When `QMTP_MODEL` points at a model with the release's widths, the chapters follow a budget instead
# (`qmtp.book.budget`; each chapter states its own plan at the top, under *At full size*, and says no more about
# it): chapters 2 to 4 work on the first
# {glue:text}`budget_layers` trunk layers (`qmtp.load(path, layers=...)`), chapter 3 converts the whole model once,
# to {glue:text}`budget_bits` bits, and chapters 4 to 6 decode with that one conversion. On the bundled model, or
# any model narrower than the release, the budget does not apply: every chapter runs as written, and no number in
# the book changes.

# %% tags=["hide-input"]
seconds = budget.pass_seconds(throughput_saved["real_width"])
plan = budget.chapters(seconds)
formats = {"memory GiB": "{:.1f}", "disk GB": "{:.1f}", "minutes": "{:.0f}"}
display(Markdown(inventory.markdown_table(plan, list(plan[0]), formats)))
peak = max(r["memory GiB"] for r in plan)
glue("budget_layers", budget.LAYERS, display=False)
glue("budget_bits", budget.BITS, display=False)
glue("plan_peak", peak, display=False)
glue("plan_disk", release["disk GB"] + sum(r["disk GB"] for r in plan), display=False)
glue("plan_fits", budget.machines_phrase(budget.fitting(peak * GIB, runtime=False)), display=False)
build_gib = machine.memory_bytes() / GIB if machine.memory_bytes() else None
glue("build_gib", build_gib or 0.0, display=False)
glue("book_time", budget.whole_book_sentence(plan, build_gib), display=False)
glue("measured_layers", seconds["measured_layers"], display=False)
glue("measured_ms", seconds["first_layers"] * 1e3, display=False)
glue("full_pass_s", seconds["full"], display=False)
glue("head_draft_ms", seconds["head_draft"] * 1e3, display=False)
glue("disk_rate", budget.DISK_GB_PER_S, display=False)
glue("measured_on", "the real model itself" if throughput_saved["real_width_on_model"]
     else "a stand-in with the release's widths and random weights", display=False)

# %% [markdown]
# "memory GiB" is the chapter's peak: the largest set of weights it holds at once and
# {glue:text}`runtime_gb:.1f` GiB for the runtime and the transient copies of the largest tensors (what the
# budgeted chapters 2 to 4 were measured to need on a full-size checkpoint, `tests/test_full_size.py`); "disk GB"
# is what it writes. Under the budget the book peaks at {glue:text}`plan_peak:.1f` GiB, which fits
# {glue:text}`plan_fits`, and needs {glue:text}`plan_disk:.0f` GB of disk with the release.
#
# **The minutes are a prediction**, not a measurement, for the machine that built this page (named in the
# {doc}`execution table <../book/execution>`): {glue:text}`book_time` Chapter 6 timed a plain pass of {glue:text}`measured_layers`
# layers of {glue:text}`measured_on` at {glue:text}`measured_ms:.0f` ms and a head draft at
# {glue:text}`head_draft_ms:.0f` ms (a draft is one layer, but it ends in `lm_head`, the product with all
# {glue:text}`real_vocab` rows of the vocabulary, which a pass of only a few layers pays once too); scaled by
# the bytes each reads, a pass of the whole 4-bit model would take {glue:text}`full_pass_s:.1f` s. A pass over n positions is priced as n passes (on this CPU it costs that much,
# chapter 6), and reading weights from disk at an assumed {glue:text}`disk_rate:.0f` GB/s. On a machine whose
# passes follow their bytes (Apple silicon, a GPU) the passes take a small fraction of that.
#
# The budget is sized to finish, not to settle: chapter 5 decodes one prompt of a few tokens and chapter 6
# times each width once, so their full-size acceptance and speed are indicative. To settle them on a fast
# machine, run the benchmark with more tokens and repeats
# (`python -m qmtp bench mtp q4 --max-tokens 256 --repeats 3`; see its `--help`), which prints each width's
# acceptance and tokens per second side by side.
#
# ## On Apple silicon or a GPU
#
# MLX computes on its default device: the GPU on Apple silicon (Metal), and on a CUDA or ROCm build of MLX,
# the accelerator. There qmtp keeps the weights that are not quantized in bfloat16 (`qmtp.load` picks float32
# only on the CPU, whose expert kernel computes only in float32), so the 4-bit conversion takes
# {glue:text}`q4_bf16:.1f` GiB loaded, and with the runtime's {glue:text}`runtime_gb:.1f` GiB it fits
# {glue:text}`q4_fits_mac`, as far as the GPU may take that memory:
#
# - **macOS** caps how much unified memory the GPU may wire (lock); `sudo sysctl iogpu.wired_limit_mb` reads the
#   cap and `sudo sysctl iogpu.wired_limit_mb=N` raises it until reboot, 0 meaning the system's default
#   ([Posaceanu](https://ark.marianposaceanu.com/apple_silicon_gpu_memory_blog)). Third-party pages put that
#   default at roughly two thirds to three quarters of the memory
#   ([thinkdifferent.blog](https://www.thinkdifferent.blog/blog/the-macbook-pro-setting-that-doubles-your-ai-performance/));
#   an assumption, not measured here: on a Mac whose memory only just holds the model, raise the cap first.
# - **Strix Halo** splits its memory twice: a fixed carve-out set in the BIOS (the UMA frame buffer, "iGPU memory
#   size") and GTT, system memory the kernel driver maps into the GPU's address space on demand, limited by
#   kernel options (`amdgpu.gttsize`, `ttm.pages_limit`)
#   ([AMD, Strix Halo system optimization](https://rocm.docs.amd.com/en/latest/how-to/system-optimization/strixhalo.html)).
#   The model must fit what the carve-out and GTT together allow the GPU, not the machine's total.
#
# Check the device with `python -m qmtp doctor`, which also runs the backend's quantized kernels
# against a float64 reference before you trust their numbers.
#
# ## Decoding speed per kind of hardware
#
# What a reader's machine decodes at, with and without MTP, and which `n_draft` to set, is the findings page's
# {doc}`bottom line <findings>` (Strix Halo, Apple M-series, NVIDIA GPUs, a CPU), from the calibrated cost model
# (`qmtp.book.cost_model.bottom_line`). How far to trust it: {glue:text}`model_verdict`
#
# ## On several machines
#
# The chat command spreads the routed experts over ranks: `python -m qmtp chat q4 --ranks 2` runs two ranks on
# this host (`mlx.launch`, MLX's ring backend), and `python -m qmtp chat q4 --hostfile hosts.json` runs them on
# the hosts of an `mlx.launch` hostfile; `--timeout S` ends every rank after S seconds. Which link pays between
# which machines, the hostfile and what to check first are in {doc}`chapter 9's how-to <09_beyond>`.
#
# ## Five lines
#
# On a 4-bit conversion (`python -m qmtp convert ~/models/Qwen3.6-35B-A3B q4 --bits 4`, about
# {glue:text}`q4_gb:.0f` GB, the head kept bf16):
#
# ```python
# import qmtp
# model = qmtp.load("q4")
# chat = [{"role": "user", "content": "Write a haiku about rain."}]
# out = qmtp.generate(model, messages=chat, enable_thinking=False, max_tokens=64, n_draft=2)
# print(out.text)
# print(out.stats.acceptance_rate, out.stats.tokens_per_second)
# ```
#
# The real model is a chat model: `messages=` renders its chat template (as transformers does), and the
# generation stops at any of its end-of-turn tokens. The bundled tiny model speaks the same format, so the
# same lines run on the model of this build (a request of its corpus's kind in place of the haiku):

# %%
model = qmtp.load(budget.decoding_model(path))
chat = [{"role": "user", "content": "Tell me a story."}]
out = qmtp.generate(model, messages=chat, enable_thinking=False, max_tokens=64, n_draft=2)
print(textwrap.fill(out.text, 72))
print(f"acceptance {out.stats.acceptance_rate:.2f}, "
      f"{out.stats.tokens_per_second:.1f} tokens/s")

# %% [markdown]
# ## A conversation
#
# `qmtp.Conversation` keeps the decoding state between turns, so a later turn prefills only the tokens its
# prompt does not share with what the model has already run; a fresh `generate` of the same history prefills
# all of them. Timed here on the model of this build:

# %%
conversation = qmtp.Conversation(model, enable_thinking=False, n_draft=2, max_tokens=32)
conversation.send("Tell me a story.")
second = conversation.send("Tell me another story.")
fresh = qmtp.generate(model, messages=conversation.messages[:-1], enable_thinking=False, max_tokens=32, n_draft=2)
for name, g in (("second turn", second), ("fresh run", fresh)):
    print(name, "prefilled", g.stats.prefilled_tokens, "of", g.stats.prompt_tokens, "prompt tokens,",
          round(g.stats.prefill_seconds * 1e3), "ms")

# %% tags=["remove-cell"]
glue("conv_same", "the same reply" if second.text == fresh.text else "a different reply", display=False)
glue("conv_saved", fresh.stats.prefilled_tokens - second.stats.prefilled_tokens, display=False)

# %% [markdown]
# The second turn ran {glue:text}`conv_saved` fewer prompt tokens than the fresh run and gave
# {glue:text}`conv_same`. On the bundled model a prefill is milliseconds either way; on the real model every
# prompt token is a position of a full pass, so the tokens saved are what a long conversation saves.
# {doc}`Chapter 10 <10_conversations>` explains which part of a turn's prompt can be kept and why the reply is
# unchanged, and times a conversation's turns with thinking on, off and kept against fresh runs.
