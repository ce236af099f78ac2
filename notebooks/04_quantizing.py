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
# # 4. Quantizing
#
# MLX's affine quantization cuts each row of a weight into groups of `group_size` values and stores, per
# group, a scale `s` and a bias `b`, and per value a `bits`-bit code `q`: the value read back is
# `s * q + b`. `qmtp.quant` recomputes all of it in numpy, so every step can be looked at.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - MLX's affine format: per group a scale and a bias, per value a `bits`-bit code;
# - how the codes are packed into 32-bit words, and that a numpy reference agrees with MLX bit for bit;
# - what each {term}`trunk` width costs in perplexity and size, and whether the MTP {term}`head`
#   needs bf16;
# - how `python -m qmtp doctor` catches a backend whose quantized kernels are wrong.
#
# **What runs here.** One group is quantized by hand; the bundled model is quantized at every width, trunk and
# head separately, and evaluated; the backend self-check runs, once healthy and once with a simulated fault.
# The chapter's run time in this build, and the machine it ran on, are in the {doc}`execution table <../book/execution>`; the download
# button at the top of the page gives this notebook, to run it yourself.
#
# **At full size** ({doc}`the budget <real_checkpoint>`): {glue:md}`budget_note`
# :::

# %% tags=["hide-input"]
import math
import tempfile
import textwrap
import warnings
from pathlib import Path

# qmtp first: it chooses the BLAS that MLX loads when first imported (qmtp.blas)
import qmtp
import mlx.core as mx
import numpy as np
from IPython.display import Markdown
from myst_nb import glue
from qmtp import mtp, quant, sizes
from qmtp.book import budget, evaluate, inventory, machine, plots, quality, results
from qmtp.book.claims import HEAD_WIDTH_COST, head_width_cost
from qmtp.convert import convert

warnings.simplefilter("ignore", UserWarning)
path = inventory.model_path()
print(inventory.describe(path))
config = qmtp.ModelConfig.from_file(path)
FULL = budget.active(config)  # the full-size release (qmtp.book.budget)
glue("budget_note", Markdown(budget.plan("04_quantizing")), display=False)
model = qmtp.load(path, layers=1, head=False) if FULL else qmtp.load(path)
gate_proj = model.layers[0].mlp.experts.gate_proj
weight = np.array(gate_proj.weight[0].astype(mx.float32))  # one expert's [I, H]

# %% [markdown]
# ## One group, step by step
#
# The first group of one expert's first row, at 4 bits: the step is the range over `2^bits - 1`, nudged
# so that zero falls exactly on a code; the value of larger magnitude is stored exactly as the bias.

# %%
group = weight[:1, :64]
codes, scales, biases = quant.quantize_groups(group, group_size=64, bits=4)
decoded = quant.dequantize(quant.pack(codes, 4), scales, biases, 64, 4)
print(
    "first codes:", codes.ravel()[:12],
    "\nvalues:     ", np.round(group.ravel()[:6], 4),
    "\nread back:  ", np.round(decoded.ravel()[:6], 4),
)

# %% tags=["remove-cell"]
glue("g_min", float(group.min()), display=False)
glue("g_max", float(group.max()), display=False)
glue("g_scale", float(scales.ravel()[0]), display=False)
glue("g_bias", float(biases.ravel()[0]), display=False)
glue("g_err", float(np.abs(decoded - group).max()), display=False)
# The grid starts at the bias and ends (2^bits - 1) steps later; the step was nudged to put zero on a code, so the
# grid's far end need not reach the group's other extreme: values past it are clipped to the last code.
step = float(scales.ravel()[0])
grid_end = float(biases.ravel()[0]) + (2**4 - 1) * step
far_extreme = float(group.max()) if step > 0 else float(group.min())
glue("g_half_step", abs(step) / 2, display=False)
glue("g_grid_end", grid_end, display=False)
glue("g_far", far_extreme, display=False)
glue("g_clip", abs(far_extreme - grid_end), display=False)
clipped = abs(abs(far_extreme - grid_end) - float(np.abs(decoded - group).max())) < 1e-6
glue("g_err_explained", "the value clipped at the far end" if clipped else "a value rounded inside the grid",
     display=False)

# %% [markdown]
# The group spans {glue:text}`g_min:.4f` to {glue:text}`g_max:.4f`; its scale is {glue:text}`g_scale:.5f`
# and its bias {glue:text}`g_bias:.4f`, and no value is read back further than {glue:text}`g_err:.5f`
# from where it was. That is more than half a step ({glue:text}`g_half_step:.5f`), the most that rounding to
# the nearest code could cost. The extra comes from the nudge: fifteen steps of the nudged size from the bias
# end at {glue:text}`g_grid_end:.4f`, short of the group's other extreme, {glue:text}`g_far:.4f`, so the
# values beyond the grid's end are clipped to the last code, and the largest error,
# {glue:text}`g_clip:.5f`, is {glue:text}`g_err_explained`. Anchoring zero and the edge exactly is bought with
# a larger error at the far end of the group.
#
# ## How the codes are packed
#
# Each row is one stream of codes, lowest bit first, cut into little-endian 32-bit words. Four-bit codes
# fit eight to a word; six-bit codes do not divide 32, so some straddle two words: a reader that assumes
# `32 / bits` codes per word corrupts them.

# %% mystnb={"figure": {"caption": "Sixteen 4-bit codes in little-endian 32-bit words: {glue:text}`per_word_4` codes fill each word exactly, so no code crosses a word boundary.", "name": "fig-pack-4"}}
fig = plots.bit_packing(4)

# %% tags=["remove-cell"]
glue("per_word_4", 32 // 4, display=False)
split = [c for c in range(16) if (6 * c) // 32 != (6 * c + 5) // 32]
glue("split_6", " and ".join(map(str, split)), display=False)

# %% mystnb={"figure": {"caption": "Sixteen 6-bit codes in the same words: 32 is not a multiple of 6, so codes {glue:text}`split_6` each have their low bits at the top of one word and their high bits at the bottom of the next, and a reader that assumes 32 / bits codes per word corrupts them.", "name": "fig-pack-6"}}
fig = plots.bit_packing(6)

# %% [markdown]
# ## The numpy reference agrees with MLX bit for bit
#
# For every width and group size, on a weight of the model: packed words, scales and biases compared as
# raw bits, and values read back.

# %%
rows = []
for bits in (2, 3, 4, 5, 6, 8):
    for group_size in (32, 64):
        words, s, b = quant.quantize(weight, group_size, bits)
        mw, ms, mb = mx.quantize(mx.array(weight), group_size=group_size, bits=bits)
        same = (
            np.array_equal(words, np.array(mw))
            and np.array_equal(s.view(np.uint32), np.array(ms).view(np.uint32))
            and np.array_equal(b.view(np.uint32), np.array(mb).view(np.uint32))
            and np.array_equal(
                quant.dequantize(words, s, b, group_size, bits),
                np.array(mx.dequantize(mw, ms, mb, group_size=group_size, bits=bits)),
            )
        )
        error = np.sqrt(
            np.mean((quant.dequantize(words, s, b, group_size, bits) - weight) ** 2)
            / np.mean(weight**2)
        )
        rows.append(
            {
                "bits": bits,
                "group": group_size,
                "bit-exact with mx.quantize": same,
                "relative RMS error": error,
            }
        )
assert all(r["bit-exact with mx.quantize"] for r in rows)
Markdown(
    inventory.markdown_table(rows, list(rows[0]), {"relative RMS error": "{:.4f}"})
)

# %% [markdown]
# ## What the usual description leaves out
#
# The usual description of `mx.quantize`, the steps above for 2 to 8 bits, read from MLX's own
# `mlx/backend/cpu/quantized.cpp` {cite:p}`mlx`, is right about every step it names, and silent on three cases
# that `qmtp.quant` had to learn by comparing with MLX itself. Each is checked here on the installed MLX:
#
# - **one bit**: MLX accepts `bits=1` and quantizes it without the edge anchoring: the bias is the group's
#   minimum and the one step spans the whole range;
# - **tiny constant groups**: a constant group whose value is below half the step's floor of 1e-7 gets no
#   anchor and decodes to 0.0, while a larger constant decodes exactly to itself;
# - **bfloat16 weights**: the scales and biases are stored in bfloat16, but the codes were computed from their
#   float32 values, so a kernel's `scale * code + bias` in bfloat16 is not quite what the codes were chosen
#   for (`quant.dequantize(..., bfloat16=True)` reproduces what MLX returns).

# %%
rng = np.random.default_rng(0)
sample = rng.standard_normal((4, 64)).astype(np.float32)
words, s, b = quant.quantize(sample, 64, 1)
mw, ms, mb = mx.quantize(mx.array(sample), group_size=64, bits=1)
one_bit = {
    "1 bit: qmtp's codes, scales and biases equal MLX's": bool(
        np.array_equal(words, np.array(mw))
        and np.array_equal(s, np.array(ms))
        and np.array_equal(b, np.array(mb))
    ),
    "1 bit: the bias is the group's minimum": bool(
        np.array_equal(np.array(mb)[:, 0], sample.min(axis=1))
    ),
}
constant_decodes = {}
for value in (4e-8, 6e-8, 0.3):
    constant = mx.full((1, 64), value, mx.float32)
    quantized = mx.quantize(constant, group_size=64, bits=4)
    constant_decodes[value] = float(mx.dequantize(*quantized, group_size=64, bits=4)[0, 0])
bf16_scales = mx.quantize(mx.array(sample).astype(mx.bfloat16), group_size=64, bits=4)[1]
assert all(one_bit.values())
{**one_bit, "4-bit constant groups, value: decoded": constant_decodes,
 "a bfloat16 weight's scales are stored as": bf16_scales.dtype}

# %% [markdown]
# ## Perplexity and size by trunk width
#
# Each width is a real conversion of this model (head kept in bf16), loaded back and measured on held-out
# text ({numref}`fig-trunk-widths`).

# %%
texts = evaluate.heldout_texts(2)
prompts = evaluate.heldout_prompts(model, 2)
if FULL:  # each width rounded in memory, first layers only (so no acceptance)
    del model  # the one layer read above: one model at a time
    mx.clear_cache()
    nan = float("nan")
    rounded = quality.by_trunk_width_in_memory(
        lambda: qmtp.load(path, layers=budget.LAYERS, head=False),
        texts[: budget.FIXES_TEXTS],
        budget.QUANT_TRUNK_WIDTHS,
        length=budget.TEXT_TOKENS,
    )
    source_row = rounded.pop("bf16")
    trunk = {
        b: {
            **m,
            "trunk_bytes": sizes.sizes(config, bits=b).trunk_bytes,
            "acceptance_n_draft_2": nan,
        }
        for b, m in rounded.items()
    }
    source_acceptance = nan
    model = qmtp.load(budget.decoding_model(path))  # chapter 3's conversion
    prompts = prompts[: budget.DECODE["prompts"]]
else:
    trunk = quality.by_trunk_width(path, texts, prompts, widths=(8, 6, 4, 3, 2))
    source_row = {"perplexity": evaluate.text_metrics(model, texts).perplexity}
    source_acceptance = evaluate.acceptance(model, prompts, n_draft=2, max_tokens=40)[
        "rate"
    ]
source = {"trunk_bytes": sizes.sizes(config, bits=sizes.UNQUANTIZED).trunk_bytes,
          "perplexity": source_row["perplexity"], "acceptance_n_draft_2": source_acceptance}
Markdown(quality.trunk_width_table(trunk, source))

# %% mystnb={"figure": {"caption": "Each trunk width a conversion of this model, the head in bf16 (sizes in the table above). Left: held-out perplexity, {glue:text}`trunk_ppl_8:.2f` at 8 bits, {glue:text}`trunk_ppl_4:.2f` at 4 and {glue:text}`trunk_ppl_2:.2f` at 2. Right: acceptance at n_draft 2, which falls sooner, from {glue:text}`trunk_8_acc:.3f` at 8 bits to {glue:text}`trunk_4_acc:.3f` at 4 and {glue:text}`trunk_2_acc:.3f` at 2.", "name": "fig-trunk-widths"}}
fig = plots.width_curves(trunk, "trunk bits")

# %% tags=["remove-cell"]
for bits in (8, 4, 2):
    glue(f"trunk_ppl_{bits}", trunk[bits]["perplexity"], display=False)
    glue(f"trunk_{bits}_acc", trunk[bits]["acceptance_n_draft_2"], display=False)

# %% [markdown]
# ## Does the head need bf16?
#
# lemon-mlx-engine's model card says to keep the head in bf16, while its converter quantizes it at `--bits`
# unless told otherwise (chapter 3); qmtp keeps it in bf16 unless `mtp_bits` is given. The trunk at 8 bits,
# the head at each width: the head's drafts are only useful while they agree with the trunk, so what matters
# is acceptance ({numref}`fig-head-widths`).

# %%
if FULL:  # the head of chapter 3's conversion, rounded in memory at each width
    head = {}
    for w in budget.QUANT_HEAD_WIDTHS:
        rounded_head = {} if w is None else {"head": mtp.with_weight_bits(model.mtp, w)}
        accepted = evaluate.acceptance(
            model,
            prompts,
            n_draft=2,
            **rounded_head,
            max_tokens=budget.DECODE["max_tokens"],
        )
        head["bf16" if w is None else w] = {
            "head_bytes": sizes.sizes(config, bits=budget.BITS, mtp_bits=w).head_bytes,
            "perplexity": float("nan"),
            "acceptance_n_draft_2": accepted["rate"],
        }
else:
    head = quality.by_head_width(path, texts, prompts, widths=(None, 8, 6, 4, 3))
Markdown(quality.head_width_table(head))

# %% mystnb={"figure": {"caption": "Each head width with the trunk at 8 bits. Left: the trunk's held-out perplexity, which the head's width cannot change. Right: acceptance at n_draft 2, {glue:text}`head_bf16_acc:.3f` with the head in bf16, {glue:text}`head_4_acc:.3f` at 4 bits and {glue:text}`head_3_acc:.3f` at 3.", "name": "fig-head-widths"}}
fig = plots.width_curves(head, "head bits")

# %% tags=["remove-cell"]
glue("head_bf16_acc", head["bf16"]["acceptance_n_draft_2"], display=False)
glue("head_3_acc", head[3]["acceptance_n_draft_2"], display=False)
glue("head_4_acc", head[4]["acceptance_n_draft_2"], display=False)
trunk_acc = {b: m["acceptance_n_draft_2"] for b, m in trunk.items()}
head_acc = {w: m["acceptance_n_draft_2"] for w, m in head.items()}
glue("trunk_4_drop", trunk_acc[8] - trunk_acc[4], display=False)
head_4_drop = head_acc["bf16"] - head_acc[4]
glue("head_4_drop", head_4_drop, display=False)
glue("head_cost_rule", HEAD_WIDTH_COST, display=False)
glue("head_4_reading", "at least" if head_4_drop >= HEAD_WIDTH_COST else "less than", display=False)
glue("head_4_cost", head_width_cost(head_acc), display=False)
glue("head_4_saves_mb", (head["bf16"]["head_bytes"] - head[4]["head_bytes"]) / 1e6, display=False)
bf16_rate, bf16_drafts = head_acc["bf16"], head["bf16"].get("drafts_n_draft_2", 0)
head_noise = 2 * math.sqrt(bf16_rate * (1 - bf16_rate) / bf16_drafts) if bf16_drafts else float("nan")
glue("head_noise", head_noise, display=False)
glue("head_noise_reading", "beyond" if head_4_drop > head_noise else "within", display=False)
glue("head_vs_trunk", "less" if head_4_drop < trunk_acc[8] - trunk_acc[4] else "no less", display=False)
glue(
    "trunk_4_ppl_rise",
    trunk[4]["perplexity"] / trunk[8]["perplexity"] - 1,
    display=False,
)

# %% [markdown]
# With the head in bf16 its drafts are accepted {glue:text}`head_bf16_acc:.3f` of the time, at 4 bits
# {glue:text}`head_4_acc:.3f` and at 3 bits {glue:text}`head_3_acc:.3f`, while a 2-bit trunk brings acceptance down
# to {glue:text}`trunk_2_acc:.3f`.
#
# Set the two 4-bit choices side by side. Taking the trunk from 8 to 4 bits costs
# {glue:text}`trunk_4_drop:.3f` of acceptance (from {glue:text}`trunk_8_acc:.3f` to
# {glue:text}`trunk_4_acc:.3f`), although its perplexity rises by only {glue:text}`trunk_4_ppl_rise:.1%`.
# For the head, {glue:text}`head_4_cost` (the rule {doc}`08_claims` applies to the claim "keep the head in
# bf16"); the difference is {glue:text}`head_noise_reading` twice the sampling error of the bf16 head's rate
# ({glue:text}`head_noise:.3f`, a rate over this many drafts). So on this model a 4-bit head costs {glue:text}`head_vs_trunk` than a 4-bit trunk. A
# drafter is judged on whether it agrees with its verifier, and a 4-bit trunk changes both sides at once: the head
# reads the quantized trunk's hidden state, which it was not trained on, and is checked against the quantized
# trunk's choices, where a small shift in the logits flips a near-tie. A 4-bit head changes only the drafter.
#
# This book converts with the head in bf16 (`mtp_bits=None`, the default) because the release ships it in bf16
# and keeping it so changes nothing the head computes; a 4-bit head would save {glue:text}`head_4_saves_mb:.1f` MB
# here. What the tiny model shows is only the cost measured above, on its small head and easy task. Whether the
# real head keeps its acceptance at 4 bits is not tested in this book, so {doc}`08_claims` rates lemon-mlx-engine's
# rule (keep the head in bf16) not testable here, from these same two numbers.

# %% [markdown]
# ## Checking the backend
#
# `qmtp.quant.check_backend()` (also `python -m qmtp doctor`) runs the installed MLX's quantized matmul
# at each width and compares it with float64 arithmetic on the reference's dequantized weights.

# %%
backend = quant.check_backend()
print(quant.report(backend))

# %% [markdown]
# A fault of this kind is said to exist in the ROCm build of MLX that lemon-mlx-engine builds on (the
# `rocm-support` branch of NripeshN/mlx {cite:p}`nripeshmlxrocm`): its `mlx/backend/rocm/quantized/qmm.hip`
# sent 6-bit weights down a tiled quantized-matmul path that handled only 4 and 8 bits, and so returned
# uninitialised memory. This is unverified: it rests on a reading of that source file, not on a published bug
# report, and no ROCm machine ran it for this book; the reader can read the file at the link.
# `quant.simulated_fault(6)` makes this machine's MLX behave that way, to show what the check reports and what a 6-bit model then writes.

# %%
workdir = Path(tempfile.mkdtemp(prefix="qmtp-chapter4-"))
prompt = "Once upon a time, a little fox named"
six = None
if not FULL:  # at full size a 6-bit conversion costs tens of GB: the check alone
    convert(path, workdir / "q6", bits=6, progress=False)
    six = qmtp.load(workdir / "q6")
    print(
        textwrap.fill(
            "healthy 6-bit: " + repr(qmtp.generate(six, prompt, max_tokens=24).text), 80
        )
    )
with quant.simulated_fault(6):
    faulty_backend = quant.check_backend()
    print(quant.report(faulty_backend))
    if six is not None:
        print(
            textwrap.fill(
                "faulty 6-bit: " + repr(qmtp.generate(six, prompt, max_tokens=24).text),
                80,
            )
        )

# %% tags=["remove-cell"]
saved = results.save(
    "04_quantizing",
    path,
    {
        "head_width_acceptance": {
            str(w): m["acceptance_n_draft_2"] for w, m in head.items()
        },
        "head_bf16_over_4bit_mb": (head["bf16"]["head_bytes"] - head[4]["head_bytes"])
        / 1e6,
        "trunk_width_perplexity": {str(b): m["perplexity"] for b, m in trunk.items()},
        "trunk_width_acceptance": {
            str(b): m["acceptance_n_draft_2"] for b, m in trunk.items()
        },
        "backend_faulty_widths": [c.bits for c in backend if not c.ok],
        "simulated_fault_flagged": [c.bits for c in faulty_backend if not c.ok],
        "mlx_version": mx.__version__,
        "machine": machine.describe(),
    },
)

# %% [markdown]
# ## Exercises
#
# Each runs on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Quantize the head to 4 bits and measure its acceptance: `qmtp.convert(path, dst, bits=8, mtp_bits=4)`,
#    then `evaluate.acceptance(qmtp.load(dst), prompts, n_draft=2)` with the prompts this chapter uses.
#
#    *Where the answer shows:* compare with the 4-bit row of the head table in *Does the head need bf16?*;
#    {doc}`05_mtp_decoding` shows what acceptance means per step.
#
# 2. In the cell of *One group, step by step*, change `group_size=64` and the `64` of `dequantize` to 32; for
#    128, also take `weight[:1, :128]`.
#
#    *Where the answer shows:* the largest error of a value read back, in the sentence under that cell,
#    shrinks with smaller groups; the file-size side of that trade is in *Perplexity and size by trunk width*.
