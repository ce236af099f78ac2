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
# # 1. Anatomy of the checkpoint
#
# A checkpoint is a set of safetensors files: each starts with a JSON header that names every tensor,
# its dtype, its shape and where its bytes lie. Everything in this chapter is read from those headers
# alone, so it runs the same on the bundled tiny model and on the full release
# (`QMTP_MODEL=/path/to/Qwen3.6-35B-A3B`).
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - what a safetensors header tells without reading a single weight: every tensor's part, kind, dtype and
#   shape;
# - the layer pattern of the hybrid trunk (linear attention three times, then full attention);
# - the real model's parameter counts and file sizes, computed from its `config.json` alone.
#
# **What runs here.** Headers and a config are read, nothing is loaded or executed on the model: the same
# cells run on the bundled tiny model and on the full release (`QMTP_MODEL`). The chapter's run time in this
# build is in the {doc}`execution table <../book/execution>`; the download button at the top of the page gives
# this notebook, to run it yourself.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown
from myst_nb import glue
from qmtp import sizes
from qmtp.book import inventory, plots, results
from qmtp.book.claims import CLAIMS

path = inventory.model_path()
print(inventory.describe(path))

# %% [markdown]
# ## What is stored, by part and by kind
#
# Listing reads only the headers: `qmtp.Checkpoint(path)` parses each file's JSON and keeps, for every
# tensor, the file, offset and byte count. The table groups the tensors the way the model uses them;
# the MTP {term}`head` is counted apart from the {term}`trunk`.

# %%
Markdown(inventory.category_table(inventory.by_category(path)))

# %%
config = qmtp.ModelConfig.from_file(path)
counts = sizes.parameter_counts(config)
Markdown(inventory.count_table(counts))

# %% tags=["remove-cell"]
glue("active_share", 100 * counts["active"] / counts["total"], display=False)
glue("head_share", 100 * counts["head"] / counts["total"], display=False)

# %% [markdown]
# Of all parameters of the model this page reads (the bundled tiny model unless `QMTP_MODEL` names another),
# {glue:text}`active_share:.1f`% take part in one token's forward pass (the "A" in
# {term}`A3B`: top-k routed experts, the shared expert, attention, one embedding row and lm_head), and the MTP
# head holds {glue:text}`head_share:.1f`% of the total: a full decoder layer with its own router and all
# its routed experts.
#
# ## The layer pattern
#
# Three gated-DeltaNet (linear attention) layers, then one gated full-attention layer, repeated; every
# layer is a sparse MoE; the MTP head is one more full-attention layer ({numref}`fig-layer-pattern`).

# %% mystnb={"figure": {"caption": "The layer pattern of the model this chapter reads, from its config: {glue:text}`n_linear` gated-DeltaNet layers (blue) and {glue:text}`n_full` gated-attention layers (orange), three of the first before each one of the second; under every mixer a mixture of {glue:text}`n_experts` experts of which each token uses {glue:text}`top_k`; the MTP head (green) is one more full-attention layer after them.", "name": "fig-layer-pattern"}}
fig = plots.layer_pattern(config)

# %% tags=["remove-cell"]
glue("n_linear", config.layer_types.count("linear_attention"), display=False)
glue("n_full", config.layer_types.count("full_attention"), display=False)
glue("n_experts", config.num_experts, display=False)
glue("top_k", config.num_experts_per_tok, display=False)

# %% [markdown]
# ## The real model, from its config alone
#
# `qmtp.QWEN36_35B_A3B` holds the released config. The same arithmetic gives the real model's
# parameter counts and the size of each conversion: trunk quantized to 4, 6 or 8 bits (router and
# shared-expert gates at 8), head kept in bf16 or quantized too.

# %%
real = qmtp.QWEN36_35B_A3B
variants = {bits: sizes.sizes(real, bits=bits) for bits in (4, 6, 8)}
variant_rows = inventory.variant_rows(variants, card_gb=CLAIMS["variant_sizes_gb"].value)
Markdown(inventory.variant_table(variant_rows))

# %%
head_sizes = {w: sizes.sizes(real, bits=4, mtp_bits=w).head_bytes / 1e9 for w in (None, 8, 6, 4)}
head_sizes

# %% tags=["remove-cell"]
real_counts = sizes.parameter_counts(real)
glue("real_total", real_counts["total"] / 1e9, display=False)
glue("real_active", real_counts["active"] / 1e9, display=False)
glue("real_active_share", 100 * real_counts["active"] / real_counts["total"], display=False)
glue("real_head_share", 100 * real_counts["head"] / real_counts["total"], display=False)
glue("head_bf16_gb", head_sizes[None], display=False)
glue("head_8_gb", head_sizes[8], display=False)
glue("head_4_gb", head_sizes[4], display=False)
glue("claimed_head_gb", CLAIMS["head_size_gb"].value, display=False)
for row in variant_rows:
    glue(f"total_gib_{row['trunk bits']}", row["total GiB"], display=False)
    glue(f"trunk_gb_{row['trunk bits']}", row["trunk GB"], display=False)
    glue(f"card_{row['trunk bits']}", row["lemon-mlx-engine's card (GB)"], display=False)

# %% [markdown]
# The real model has {glue:text}`real_total:.1f` B parameters, {glue:text}`real_active:.2f` B of them
# ({glue:text}`real_active_share:.1f`%) active per token, and its head holds {glue:text}`real_head_share:.1f`%
# of them.
# The model card of lemon-mlx-engine, the MLX engine this book started from, gives
# {glue:text}`card_4`, {glue:text}`card_6` and {glue:text}`card_8` GB: those
# are the whole file, trunk and bf16 head, counted in GiB: {glue:text}`total_gib_4:.1f`,
# {glue:text}`total_gib_6:.1f` and {glue:text}`total_gib_8:.1f` GiB. Set beside the trunk alone in GB
# ({glue:text}`trunk_gb_4:.1f`, {glue:text}`trunk_gb_6:.1f`, {glue:text}`trunk_gb_8:.1f`) they only seem to
# agree, because leaving the head out and counting in GB instead of GiB nearly cancel. The head's own size does
# not agree: kept in bf16, as lemon-mlx-engine's card recommends, it weighs {glue:text}`head_bf16_gb:.2f` GB, not
# the {glue:text}`claimed_head_gb` GB that card states; that figure matches a 4-bit head
# ({glue:text}`head_4_gb:.2f` GB), and an 8-bit head weighs {glue:text}`head_8_gb:.2f` GB.

# %% tags=["remove-cell"]
saved = results.save("01_anatomy", path, {
    "trunk_gb": {row["trunk bits"]: row["trunk GB"] for row in variant_rows},
    "total_gib": {row["trunk bits"]: row["total GiB"] for row in variant_rows},
    "head_gb": {("bf16" if w is None else str(w)): gb for w, gb in head_sizes.items()},
    "real_parameters_b": real_counts["total"] / 1e9,
    "real_active_b": real_counts["active"] / 1e9,
})

# %% [markdown]
# ## Exercises
#
# Each runs on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Size the head of the model this page reads (the bundled tiny one unless `QMTP_MODEL` names another) at each
#    width: call `sizes.sizes(config, bits=4, mtp_bits=w).head_bytes` for `w` in `(None, 8, 4)` (`config` is
#    that model's, read above; `None` keeps the head in bf16) and compare the ratios with the real model's. The
#    real model needs no download for this: pass `qmtp.QWEN36_35B_A3B`, its released config, in place of `config`
#    (as `head_sizes` above does).
#
#    *Where the answer shows:* divide each by the bf16 size, and do the same with `head_sizes` above for the real
#    model: the tiny head shrinks less than the real one, and the head's rows of the table in *What is stored, by
#    part and by kind* show which kinds of tensor its bytes sit in; {doc}`04_quantizing`
#    measures what the 4-bit head costs in acceptance.
#
# 2. Convert the tiny model (`python -m qmtp convert qmtp/assets/tiny /tmp/tiny4 --bits 4`) and run this
#    chapter with `QMTP_MODEL=/tmp/tiny4`.
#
#    *Where the answer shows:* the table in *What is stored, by part and by kind* gains the `.scales` and
#    `.biases` of the quantized trunk, while the head's tensors stay bf16 ({doc}`03_converting` explains why).
