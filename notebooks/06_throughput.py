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
# # 6. Does MTP pay?
#
# Chapter 5 showed the head's drafts saving trunk passes without changing a token. Whether that saves time
# depends on what a pass costs. Decoding one token multiplies each weight it uses by one vector, so on the
# machines this model is meant for a pass takes about as long as reading those weights from memory. A verify
# pass over `n` tokens reads every dense weight once for all `n`, but in each MoE layer it reads the experts
# *any* of its tokens chose. This chapter counts those experts, turns bytes into time, predicts the speedup
# for the real model with its head in bf16 (as the release ships it; a 4-bit head is untested at full size) and for a dense model of the same active
# size, sets a prediction beside what the tiny model measures here, and times passes at the real widths on
# this machine, whose answer differs from a memory-bound GPU's for a reason the numbers show. How the
# decoding loop itself is made lean is {doc}`07_engine`. The arithmetic lives in `qmtp.book.throughput`, the
# measurements in `qmtp.book.bench` (`python -m qmtp bench mtp` prints the same tables).
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - how many experts a verify pass over `n` tokens reads in each MoE layer, counted and from the formula;
# - how bytes read become time on a memory-bound machine, and the speedup MTP can give an A3B MoE next to a
#   dense model of the same active size;
# - what a step costs on the tiny model, predicted and measured at every `n_draft`, and why a model of bytes
#   cannot predict it there;
# - what the same passes cost at the real widths on this CPU, and why a compute-bound CPU answers "does MTP
#   pay?" differently from a memory-bound GPU or APU.
#
# **What runs here.** The cost model is pure arithmetic on the real config; the tiny model's passes and
# decoding speeds, and passes at the real widths, are measured in this run (timings vary with the machine and
# its load). The chapter's run time in this build is in the {doc}`execution table <../book/execution>`; the
# download button at the top of the page gives this notebook.
#
# **At full size.** {glue:md}`budget_note` ({doc}`real_checkpoint` gives the memory and time.)
# :::

# %% tags=["hide-input"]
import os

import qmtp
from IPython.display import Markdown
from myst_nb import glue
import textwrap

from qmtp.book import (
    bench,
    budget,
    claims,
    cost_model,
    evaluate,
    inventory,
    machine,
    plots,
    published,
    results,
    throughput,
)
from qmtp.book.claims import CLAIMS
from qmtp.config import QWEN36_35B_A3B
from qmtp.sizes import sizes

path = inventory.model_path()
print(inventory.describe(path))
config = qmtp.ModelConfig.from_file(path)
FULL = budget.active(config)  # the full-size release (qmtp.book.budget)
glue("budget_note", Markdown(budget.statement("06_throughput", config)), display=False)
model = qmtp.load(budget.decoding_model(path))
QUICK = os.environ.get("QMTP_QUICK") == "1"
prompts = evaluate.heldout_prompts(model, 1)
MAX_TOKENS, REPEATS = (16, 1) if QUICK else (32, 3)
if FULL:
    MAX_TOKENS, REPEATS = budget.BENCH["max_tokens"], budget.BENCH["repeats"]
E, k = model.config.num_experts, model.config.num_experts_per_tok

# %% [markdown]
# ## Experts a verify pass touches
#
# A token routed top-`k` of `E` misses a given expert with probability `1 - k/E`. If the `n` tokens of a
# pass chose independently, an expert is missed by all of them with probability `(1 - k/E)^n`, and the
# pass reads on average
#
# $$U(n) = E\left(1 - (1 - k/E)^n\right)$$
#
# experts per layer (`throughput.expected_union`): `k` for one token, almost `2k` for two when $E \gg k$.
# Neighbouring tokens are not independent, so the measured union can be smaller. Below, greedy decoding
# at `n_draft` 1 to 5 on held-out prompts, interleaved and repeated (`bench.mtp`), logs every expert each
# verify pass read.

# %%
print(textwrap.fill("Timed on: " + machine.line(), 72))
report = bench.mtp(
    model,
    prompts[:1] if FULL else prompts,
    max_tokens=MAX_TOKENS,
    n_drafts=(1, 2, 3, 4, 5),
    repeats=REPEATS,
    auto=False,
)
by_n = {r["n_draft"]: r for r in report["results"]}
assert all(r["same_tokens_as_plain"] for r in report["results"])

# %%
Markdown(throughput.widths_table(report))

# %% tags=["remove-cell"]
glue("union_n2_measured", by_n[2]["experts_per_pass_measured"], display=False)
glue("union_n2_formula", by_n[2]["experts_per_layer_independent"], display=False)
glue("union_n5_measured", by_n[5]["experts_per_pass_measured"], display=False)
glue("union_n5_formula", by_n[5]["experts_per_layer_independent"], display=False)
ratio5 = by_n[5]["union_measured_over_independent"]
glue("union_n5_ratio", ratio5, display=False)
glue(
    "union_verdict",
    (
        "The measured union is close to the formula: neighbouring tokens route almost "
        "independently here, and the union grows almost linearly with the tokens of "
        "the pass, so the expert bytes of a verify pass are nearly those of n separate "
        "passes"
        if ratio5 >= 0.9
        else "The measured union is well below the formula: neighbouring tokens share "
        "many of their experts, so a verify pass reads clearly fewer expert bytes than "
        "n separate passes"
    ),
    display=False,
)
glue("tiny_E", E, display=False)
glue("tiny_k", k, display=False)


# %% mystnb={"figure": {"caption": "Distinct experts a verify pass read in each MoE layer of the tiny model (dots, one per layer), against the formula for independent routing (red line) and the bound if no two tokens shared an expert (dashed): {glue:text}`union_n5_measured:.1f` experts per layer measured for five tokens, {glue:text}`union_n5_formula:.1f` from the formula.", "name": "fig-expert-union"}}
fig = plots.expert_union(report, E, k)

# %% [markdown]
# With `E` = {glue:text}`tiny_E` and `k` = {glue:text}`tiny_k`, a pass over two tokens read
# {glue:text}`union_n2_measured:.1f` experts per layer on average (the formula: {glue:text}`union_n2_formula:.1f`),
# a pass over five {glue:text}`union_n5_measured:.1f` (formula {glue:text}`union_n5_formula:.1f`, a ratio of
# {glue:text}`union_n5_ratio:.2f`). {glue:text}`union_verdict`.
#
# ## Bytes into time
#
# One pass reads, from the stored size of each tensor (`qmtp.sizes`): the mixers' weights, the routers, the
# shared experts and all of lm_head once; `U(n)` of the `E` routed experts in each layer; one embedding
# row per token; the KV cache of each attention layer and the recurrent state of each DeltaNet layer
# (`throughput.trunk_pass_bytes`). One draft step of the head reads its own layer with `k` experts and,
# to score its draft, lm_head again (`throughput.head_step_bytes`). Time is then
#
# $$t = \frac{\text{bytes}}{\text{bandwidth}} + \text{overhead},$$
#
# the overhead being what a pass costs whatever its width (launching kernels, Python, waiting for the
# host). For the real Qwen3.6-35B-A3B with its trunk at {glue:text}`real_bits` bits and its head in bf16 (as
# this book converts it, because the release ships it so; chapter 4 measures a quantized head on the tiny model), and a {glue:text}`context`-token context:

# %% mystnb={"figure": {"caption": "What one pass of the real Qwen3.6-35B-A3B reads, trunk at {glue:text}`real_bits` bits and head in bf16, with a {glue:text}`context`-token context, by term, computed from its config: {glue:text}`real_gb_token:.2f` GB for one token, of which routed experts are {glue:text}`real_expert_share:.0%`; {glue:text}`real_gb_verify2:.2f` GB for a verify pass over two tokens; {glue:text}`real_gb_head:.2f` GB for one step of the bf16 head, most of it lm_head.", "name": "fig-bytes-per-pass"}}
CONTEXT, BANDWIDTH, BITS = throughput.DEFAULT_CONTEXT, 256 * throughput.GB, 4
real4 = sizes(QWEN36_35B_A3B, BITS)  # the head in bf16 (mtp_bits=None)

# %% tags=["remove-cell"]
glue("real_bits", BITS, display=False)
glue("context", CONTEXT, display=False)
glue("bandwidth_gb", BANDWIDTH / throughput.GB, display=False)
glue("claim_acc2", CLAIMS["acceptance_n_draft_2"].value, display=False)
glue("claim_acc3", CLAIMS["acceptance_n_draft_3"].value, display=False)
passes = {
    "1 token": throughput.trunk_pass_bytes(QWEN36_35B_A3B, real4, 1, CONTEXT),
    "verify 2": throughput.trunk_pass_bytes(QWEN36_35B_A3B, real4, 2, CONTEXT),
    "verify 3": throughput.trunk_pass_bytes(QWEN36_35B_A3B, real4, 3, CONTEXT),
    "head step": throughput.head_step_bytes(QWEN36_35B_A3B, real4, CONTEXT),
}
fig = plots.bytes_per_pass(passes)
one_token = throughput.total(passes["1 token"])
glue("real_gb_token", one_token / 1e9, display=False)
glue("real_gb_verify2", throughput.total(passes["verify 2"]) / 1e9, display=False)
glue("real_gb_head", throughput.total(passes["head step"]) / 1e9, display=False)
glue(
    "real_expert_share", passes["1 token"]["routed experts"] / one_token, display=False
)
glue("real_ms_token", one_token / BANDWIDTH * 1e3, display=False)
glue("real_tps_bound", BANDWIDTH / one_token, display=False)
head4 = throughput.head_step_bytes(
    QWEN36_35B_A3B, sizes(QWEN36_35B_A3B, BITS, mtp_bits=BITS), CONTEXT
)
glue("real_gb_head_4", throughput.total(head4) / 1e9, display=False)

# %% [markdown]
# One token reads {glue:text}`real_gb_token:.2f` GB, {glue:text}`real_expert_share:.0%` of it routed
# experts: at {glue:text}`bandwidth_gb:.0f` GB/s (a unified-memory APU) that is {glue:text}`real_ms_token:.1f`
# ms, at most {glue:text}`real_tps_bound:.0f` tokens/s. A verify pass over two tokens reads
# {glue:text}`real_gb_verify2:.2f` GB, and each step of the bf16 head another {glue:text}`real_gb_head:.2f` GB,
# most of it lm_head (a head rounded to the trunk's {glue:text}`real_bits` bits would read
# {glue:text}`real_gb_head_4:.2f` GB, but chapter 4 could not show that its drafts stay as good).
#
# ## Predicted speedup: the MoE against a dense model
#
# With per-position acceptance rates $a_1, a_2, \dots$ (a draft at position $i$ is proposed only when the
# ones before it were accepted), a step that verifies $n_\text{draft} - 1$ drafts emits on average
#
# $$\tau = 1 + \sum_{i=1}^{n_\text{draft}-1} \prod_{j \le i} a_j$$
#
# tokens, and costs one verify pass plus $n_\text{draft} - 1$ head steps against $\tau$ plain passes
# (`throughput.predicted_speedup`). A dense model of the same active size reads the same weights for a
# verify pass as for one token, so its drafts cost only the head. The prediction is
# `throughput.machine_prediction`, the same one that {doc}`findings` reports and that {doc}`08_claims` sets
# beside each published machine: the head in bf16, the machine purely memory-bound (no fixed cost per pass),
# and {glue:text}`acceptance_rule`. No source here gives an acceptance of its own, so the table below uses
# the reported rates.

# %%
rows = throughput.real_model_table(bits=(4, 8), bandwidth=BANDWIDTH, context=CONTEXT)
Markdown(throughput.predictions_table(rows))

# %% tags=["remove-cell"]
glue("acceptance_rule", throughput.acceptance_rule(), display=False)



def row(bits, model_kind, n):
    return next(
        r
        for r in rows
        if r["bits"] == bits and r["model"] == model_kind and r["n_draft"] == n
    )


moe = {(b, n): row(b, "MoE", n)["speedup"] for b in (4, 8) for n in range(1, 6)}
dense = {
    (b, n): row(b, "dense, same active size", n)["speedup"]
    for b in (4, 8)
    for n in range(1, 6)
}
best = max((key for key in moe if key[0] == 4), key=moe.get)  # the 4-bit trunk's best
glue("moe4_n2", moe[(4, 2)], display=False)
glue("moe8_n2", moe[(8, 2)], display=False)
glue("moe4_n5", moe[(4, 5)], display=False)
glue("dense4_n2", dense[(4, 2)], display=False)
glue("dense4_best", max(dense[(4, n)] for n in range(1, 6)), display=False)
glue("moe_best", moe[best], display=False)
glue("moe_best_n", best[1], display=False)
glue(
    "moe_best_clause",
    (
        "its best width on such a machine"
        if best[1] == 2
        else f"and at best {moe[best]:.2f}x (`n_draft` = {best[1]})"
    ),
    display=False,
)
calibrated = cost_model.calibrated_best()  # the published machines, each calibrated by its plain figure
glue("cal_machines", calibrated["machines"], display=False)
glue("cal_low", calibrated["low"], display=False)
glue("cal_high", calibrated["high"], display=False)
widths = calibrated["widths"]
glue("cal_widths", f"{widths[0]} to {widths[-1]}" if len(widths) > 1 else widths[0], display=False)
low, high = CLAIMS["speedup_moe"].value
glue("claim_low", low, display=False)
glue("claim_high", high, display=False)
glue(
    "claim_range_verdict",
    (
        "brackets this prediction: its best, "
        f"{moe[best]:.2f}x, is inside that range"
        if low <= moe[best] <= high
        else f"lies {'above' if moe[best] < low else 'below'} this prediction: its "
        f"best, {moe[best]:.2f}x, is outside that range"
    ),
    display=False,
)
# A fixed cost per pass (2 ms) at n_draft=2: its direction depends on who pays it.
OVERHEAD = 0.002
effect = throughput.overhead_effect(BANDWIDTH, 2, OVERHEAD, BITS, CONTEXT)
glue("overhead_ms", OVERHEAD * 1e3, display=False)
glue("overhead_once", effect["once per step"], display=False)
glue("overhead_every", effect["every pass and draft"], display=False)
radeon = published.predict(
    next(r for r in published.FIELD if r.key == "lemon_radeon_890m")
)
glue("radeon_published", radeon.row.speedup, display=False)
glue("radeon_gb_s", radeon.row.bandwidth / throughput.GB, display=False)
glue("radeon_predicted", radeon.speedup, display=False)
glue(
    "radeon_verdict",
    (
        "the two agree"
        if published.agrees(radeon)
        else "the published run gains "
        + ("more" if radeon.row.speedup > radeon.speedup else "less")
        + " than the prediction (chapter 8 gives the reasons a run and the model "
        "can part)"
    ),
    display=False,
)

# %% mystnb={"figure": {"caption": "Predicted speedup over plain decoding for the real model's config on a purely memory-bound machine at {glue:text}`bandwidth_gb:.0f` GB/s, with the reported acceptance and the head in bf16: the MoE with a 4-bit trunk (solid) at best {glue:text}`moe_best:.2f`x, at n_draft {glue:text}`moe_best_n`, a dense model of the same active size (dashed) up to {glue:text}`dense4_best:.2f`x at 4 bits; the grey band is the {glue:text}`claim_low:.1f`x to {glue:text}`claim_high:.1f`x that lemon-mlx-engine's card gives for A3B MoE models, summarising three runs (one engine's summary, not the field's range: the findings page sets the published runs out one by one).", "name": "fig-predicted-speedups"}}
fig = plots.predicted_speedups(rows, claimed=CLAIMS["speedup_moe"].value)

# %% [markdown]
# On paper the MoE with a 4-bit trunk gains {glue:text}`moe4_n2:.2f`x at `n_draft=2`,
# {glue:text}`moe_best_clause` ({glue:text}`moe8_n2:.2f`x with an 8-bit trunk); by `n_draft=5` the growing
# union of experts and the head's lm_head reads bring it to {glue:text}`moe4_n5:.2f`x. A dense model of
# the same active size gains {glue:text}`dense4_n2:.2f`x at `n_draft=2` and up to
# {glue:text}`dense4_best:.2f`x. The card of lemon-mlx-engine, the engine this project began from, claims
# {glue:text}`claim_low:.1f`x to {glue:text}`claim_high:.1f`x for A3B MoE models (summarised from
# {cite:p}`vllmmlx245,llamacpp22673,kyuz0strix53`; {doc}`08_claims` sets each published run beside this
# prediction) {glue:text}`claim_range_verdict`.
#
# No published machine is purely memory-bound: their plain decoding runs far below the bytes bound, and the
# extra time is shared by the tokens of a step or paid per token, in proportions the bytes do not tell. The
# model of {doc}`findings` (`qmtp.book.cost_model`) calibrates each of the {glue:text}`cal_machines` published
# machines by its plain figure and fits that share on the other sources' runs; it puts their best width at
# `n_draft` {glue:text}`cal_widths`, for {glue:text}`cal_low:.2f`x to {glue:text}`cal_high:.2f`x, not at
# the memory-bound machine's.
#
# A fixed cost per pass (launching kernels, synchronising with the host) moves the prediction in a direction
# that depends on who pays it (`throughput.overhead_effect`). Paid once per step, by the verify pass, with
# the head's drafts inside the same step, it is shared by every token the step yields: with
# {glue:text}`overhead_ms:.0f` ms of it, `n_draft=2` gains {glue:text}`overhead_once:.2f`x instead of
# {glue:text}`moe4_n2:.2f`x. Paid by every head draft as well, a step pays it `n_draft` times for fewer
# tokens than that: {glue:text}`overhead_every:.2f`x. The loop model of the next section is the first case.
#
# One published run sits beside this prediction in {doc}`08_claims`: lemon-mlx-engine on a Radeon 890M,
# {glue:text}`radeon_published:.2f`x (published, {cite:p}`lemonmlx`; not measured here), where the same
# prediction at that machine's {glue:text}`radeon_gb_s:.0f` GB/s gives {glue:text}`radeon_predicted:.2f`x:
# {glue:text}`radeon_verdict`.
#
# ## The tiny model: prediction beside measurement
#
# The tiny model moves a few megabytes per pass. Drawn against their bytes, the verify passes timed alone
# (`n_draft` 2 to 5, bytes from the measured unions) lie on a line that crosses zero bytes at
# {glue:text}`tiny_bytes_intercept_ms:.1f` ms. {glue:text}`bytes_story` The loop model prices a pass by its
# tokens instead, each adding one more step of every DeltaNet recurrence, one more query in every attention
# layer, more experts to gather and one more row through every matrix product, all dispatched operation by
# operation, and adds the loop around the passes (`throughput.fit_loop`):
#
# $$t_\text{step}(n) = t_\text{loop} + t_0 + n\,t_\text{token} + (n - 1)\,t_\text{head},$$
#
# $t_0 + n\,t_\text{token}$ the line through the verify passes timed alone, $t_\text{head}$ a head draft
# timed alone, and $t_\text{loop}$ what a step of the decoding loop costs beyond its passes (calling the
# compiled step, queueing it, reading its tokens, the host's books), taken from plain decoding alone: its
# step in the loop, 1 over its tokens per second, less the line at one token. Every other width is then a
# prediction, $\tau\,t_\text{step}(1)/t_\text{step}(n)$.

# %%
Markdown(throughput.loop_model_table(report))

# %% tags=["remove-cell"]
cost = report["cost_model"]
predicted = {p["n_draft"]: p for p in cost["predictions"]}
plain = by_n[1]
drafting = [r for r in report["results"] if r["n_draft"] > 1]
best = max(drafting, key=lambda r: r["speedup_vs_plain"])
gaps = {
    n: p["predicted_speedup"] / p["measured_speedup"] - 1 for n, p in predicted.items()
}
worst_n = max(gaps, key=lambda n: abs(gaps[n]))
spread = {
    r["n_draft"]: (r["tokens_per_second_max"] - r["tokens_per_second_min"])
    / r["tokens_per_second"]
    for r in report["results"]
}
glue("tiny_bytes_intercept_ms", cost["bytes_intercept"] * 1e3, display=False)
glue(
    "bytes_story",
    (
        "A pass's time grows faster than its bytes, and a fit of t = overhead + "
        "bytes / bandwidth cannot have a negative overhead: it clamps it to "
        f"{cost['overhead'] * 1e3:.1f} ms and draws its line through the origin, "
        "flatter than the data, so it prices the long passes too cheaply and the "
        "gain of drafting too low (crosses in the figure below)."
        if cost["bytes_intercept"] < 0
        else "A fit of t = overhead + bytes / bandwidth finds "
        f"{cost['overhead'] * 1e3:.1f} ms of overhead in this run; its prediction "
        "is the crosses in the figure below, and it still cannot tell a pass that "
        "costs more for its tokens from one that costs more for its bytes."
    ),
    display=False,
)
loop_ms = cost["loop_overhead"] * 1e3
glue(
    "tiny_loop_phrase",
    (
        f"the loop adds {loop_ms:.1f} ms to every step "
        f"({cost['loop_overhead'] / cost['plain_loop_seconds']:.0%} of a plain step), "
        "which a model of the passes alone cannot see: they were timed without the "
        "loop around them"
        if loop_ms > 0
        else "the loop adds nothing measurable: a plain step in the loop took "
        f"{-loop_ms:.1f} ms less than the line through the verify passes gives at "
        "one token (that line, fitted on passes of 2 to 5 tokens, overstates a "
        "one-token pass)"
    ),
    display=False,
)
step_fixed = cost["loop_overhead"] + cost["pass_fixed"]  # t_loop + t_0
per_token = cost["pass_per_token"]
glue(
    "tiny_fixed_phrase",
    (
        "What a step costs whatever its width, the loop's cost and the passes' fixed "
        f"cost together, {step_fixed * 1e3:.1f} ms, is {step_fixed / per_token:.0f} "
        "times what one more token of the pass adds"
        if per_token > 0
        else "In this run the passes timed alone did not grow with their tokens (a "
        "slope of "
        f"{per_token * 1e3:.2f} ms per token is the shared machine's noise), so nearly "
        f"all of a step's cost, {step_fixed * 1e3:.1f} ms, is fixed"
    ),
    display=False,
)
glue("tiny_fixed_ms", cost["pass_fixed"] * 1e3, display=False)
glue("tiny_token_ms", cost["pass_per_token"] * 1e3, display=False)
glue("tiny_head_ms", cost["head_per_draft"] * 1e3, display=False)
glue("tiny_pass_ms", plain["trunk_seconds_per_pass"] * 1e3, display=False)
glue("tiny_loop_plain_ms", predicted[1]["loop_step_seconds"] * 1e3, display=False)
glue("tiny_plain_tps", plain["tokens_per_second"], display=False)
glue("tiny_mb_pass", plain["trunk_bytes_per_pass"] / 1e6, display=False)
glue("tiny_pred_n2", predicted[2]["predicted_speedup"], display=False)
glue("tiny_meas_n2", by_n[2]["speedup_vs_plain"], display=False)
glue("tiny_bytes_n5", predicted[5]["bytes_model_speedup"], display=False)
glue("tiny_pred_n5", predicted[5]["predicted_speedup"], display=False)
glue("tiny_meas_n5", by_n[5]["speedup_vs_plain"], display=False)
glue("tiny_worst_n", worst_n, display=False)
glue("tiny_worst_gap", abs(gaps[worst_n]), display=False)
glue(
    "tiny_worst_dir",
    "above" if gaps[worst_n] > 0 else "below",
    display=False,
)
glue("tiny_spread_max", max(spread.values()), display=False)
glue("tiny_spread_n", max(spread, key=spread.get), display=False)
glue("repeats", REPEATS, display=False)
glue(
    "tiny_gap_verdict",
    (
        "within the spread of the rounds themselves"
        if abs(gaps[worst_n]) <= spread[worst_n]
        else "wider than the spread of the rounds: the step in the loop does not cost "
        "the same at every width (a wider step replays a larger compiled graph and "
        "keeps more books), which a single loop cost taken from plain decoding "
        "cannot see"
    ),
    display=False,
)
glue(
    "tiny_verdict",
    (
        f"drafting pays here, at best {best['speedup_vs_plain']:.2f}x "
        f"(n_draft={best['n_draft']})"
        if best["speedup_vs_plain"] > 1
        else f"drafting does not pay here: even the best n_draft ({best['n_draft']}) "
        f"runs at {best['speedup_vs_plain']:.2f}x of plain decoding"
    ),
    display=False,
)

# %% mystnb={"figure": {"caption": "The tiny model on this machine: measured speedup over plain decoding at each n_draft (bars: the median of {glue:text}`repeats` rounds, whiskers the slowest and the fastest round), the loop model's prediction (red dots), the bytes model's (grey crosses) and the tokens per pass that bound both (grey dashes): {glue:text}`tiny_meas_n5:.2f`x measured at n_draft 5, {glue:text}`tiny_pred_n5:.2f`x from the loop model and {glue:text}`tiny_bytes_n5:.2f`x from bytes; {glue:text}`tiny_verdict`.", "name": "fig-measured-vs-predicted"}}
fig = plots.measured_vs_predicted(report)

# %% [markdown]
# The table reconciles three clocks. "passes ms" is a step's verify pass and head drafts, each compiled and
# timed alone, outside the loop, in rounds that call every width once (`bench.interleaved_pass_costs`: a slow
# spell of this shared machine falls on all widths alike, so they cannot swap places); "loop ms" is the step as the loop ran it, tokens per pass over tokens per second (so
# {glue:text}`tiny_plain_tps:.0f` tokens/s of plain decoding is {glue:text}`tiny_loop_plain_ms:.1f` ms per
# step); "model ms" is $t_\text{step}(n)$. A plain pass timed alone takes {glue:text}`tiny_pass_ms:.1f` ms
# and reads {glue:text}`tiny_mb_pass:.1f` MB; {glue:text}`tiny_loop_phrase`. The passes cost
# {glue:text}`tiny_fixed_ms:.1f` ms plus {glue:text}`tiny_token_ms:.2f` ms per token, a head draft
# {glue:text}`tiny_head_ms:.2f` ms. {glue:text}`tiny_fixed_phrase`: that fixed cost per step,
# $t_\text{loop} + t_0$, is what the dispatch-bound story is about, and the reason drafting can pay on the
# tiny model, since it is shared by every token the step yields.
#
# At `n_draft=2` the loop model predicts {glue:text}`tiny_pred_n2:.2f`x and {glue:text}`tiny_meas_n2:.2f`x is
# measured. The largest gap is at `n_draft` = {glue:text}`tiny_worst_n`, the prediction
# {glue:text}`tiny_worst_gap:.0%` {glue:text}`tiny_worst_dir` the measurement: {glue:text}`tiny_gap_verdict`.
# The whiskers are not a confidence interval: each round decodes every prompt at every width, interleaved, and
# the whiskers are the slowest and the fastest of the {glue:text}`repeats` rounds, the noise of a shared
# machine (up to {glue:text}`tiny_spread_max:.0%` of the median, at `n_draft` = {glue:text}`tiny_spread_n`).
# The speedup is a ratio of medians, each width against plain decoding of the same rounds.
#
# On a memory-bound machine at the real widths the bytes term dominates and the union of experts takes most
# of the gain back, as the previous section predicts. Whether this machine is one is measured next.
#
# ## At the real widths, measured
#
# The real model is not here, but its widths can be: the first four of its layers (three DeltaNet, one
# attention) with all 256 experts, its head and its vocabulary of 248,320, built in memory as a 4-bit
# conversion loads on a 24 GB machine (the trunk 4-bit, the head's experts in bf16; `bench.real_width_model`).
# Its weights are seeded constants, except the embeddings and the routers, which are random so that tokens
# route apart: a product takes the same time whatever its values. Each pass is compiled and timed alone, every
# width once per round (`bench.real_width_passes`). If time followed bytes, as on a memory-bound machine, each pass's time over
# the plain pass would be its bytes over the plain pass's (what it reads, with independent routing). With
# `QMTP_MODEL` set to a full-size conversion, the same cell times the model itself.

# %%
real = model if claims.is_real_model(model.config) else bench.real_width_model()
seconds_per_pass = budget.BENCH["pass_budget_s"] if FULL or QUICK else 4.0
real_passes = bench.real_width_passes(
    real, prompts[0], n_drafts=(2, 3), budget=seconds_per_pass
)
if real is not model:
    del real  # 5 GB: not kept for the rest of the chapter

# %%
Markdown(throughput.real_width_table(real_passes))

# %% tags=["remove-cell"]
by_pass = {r["pass"]: r for r in real_passes["rows"]}
plain_row, verify2, verify3, head_row = (
    by_pass[k]
    for k in ("plain, 1 token", "verify, 2 tokens", "verify, 3 tokens", "head draft")
)
# A step at n_draft=2 pays when its tokens per pass (2 at most) exceed its cost in
# plain passes.
real_break_even = verify2["time_over_plain"] + head_row["time_over_plain"]
glue("real_layers", real_passes["layers"], display=False)
glue("real_plain_ms", plain_row["seconds"] * 1e3, display=False)
glue("real_v2_time", verify2["time_over_plain"], display=False)
glue("real_v2_bytes", verify2["bytes_over_plain"], display=False)
glue("real_v3_time", verify3["time_over_plain"], display=False)
glue("real_v3_bytes", verify3["bytes_over_plain"], display=False)
glue("real_extra_token", (verify3["time_over_plain"] - 1) / 2, display=False)
glue("real_head_time", head_row["time_over_plain"], display=False)
glue("real_head_bytes", head_row["bytes_over_plain"], display=False)
glue("real_break_even", real_break_even, display=False)
# The whole model on this machine: its pass priced at the measured pass's seconds per
# byte (qmtp.book.budget.pass_seconds), the head's draft as measured (its own layer
# and lm_head do not grow with the trunk's layers).
whole = budget.pass_seconds(real_passes)
head_over_whole = whole["head_draft"] / whole["full"]
break_even_40 = verify2["time_over_plain"] + head_over_whole
glue("whole_layers", QWEN36_35B_A3B.num_hidden_layers, display=False)
glue("whole_pass_s", whole["full"], display=False)
glue("whole_head_share", head_over_whole, display=False)
glue("whole_break_even", break_even_40, display=False)
glue("cpu_gb_s", plain_row["bytes"] / plain_row["seconds"] / 1e9, display=False)
glue(
    "whole_verdict",
    (
        "still more than the 2 tokens a pass at n_draft=2 can yield: drafting cannot "
        "pay on this CPU for the whole model either"
        if break_even_40 >= 2
        else "fewer than the 2 tokens a perfect head would give: at 40 layers drafting "
        f"could pay here once a pass yields more than {break_even_40:.2f} tokens"
    ),
    display=False,
)
glue(
    "real_bound",
    (
        "compute-bound, not memory-bound"
        if verify2["time_over_plain"] > 1.5 * verify2["bytes_over_plain"]
        else "close to memory-bound"
    ),
    display=False,
)
glue(
    "real_verdict",
    (
        f"so drafting cannot pay on this machine at the real widths: even a head that "
        f"is always right gives 2 tokens per pass, fewer than the "
        f"{real_break_even:.2f} it needs"
        if real_break_even >= 2
        else f"so drafting can pay here once a pass yields more than "
        f"{real_break_even:.2f} tokens"
    ),
    display=False,
)

# %% [markdown]
# At the real widths a plain pass through these {glue:text}`real_layers` layers takes
# {glue:text}`real_plain_ms:.0f` ms. A verify pass over two tokens takes {glue:text}`real_v2_time:.2f`x as long
# while reading only {glue:text}`real_v2_bytes:.2f`x the bytes, and over three tokens
# {glue:text}`real_v3_time:.2f`x for {glue:text}`real_v3_bytes:.2f`x: each extra token costs about
# {glue:text}`real_extra_token:.2f` of a plain pass. This machine is {glue:text}`real_bound`: here the time of
# a quantized product grows with its rows, so a pass over n tokens costs nearly n passes, however many experts
# its tokens share. A head draft costs {glue:text}`real_head_time:.2f` of a plain pass (it reads
# {glue:text}`real_head_bytes:.2f`x a plain pass's bytes: its own layer and the shared lm_head, which in four
# layers instead of forty weighs far more than in the whole model). A step at `n_draft=2` therefore costs
# {glue:text}`real_break_even:.2f` plain passes of these four layers, {glue:text}`real_verdict`.
#
# ## Scaled to the whole model, and why a GPU answers differently
#
# The four layers overstate the head: its draft step reads its own layer and all of lm_head, whatever the
# trunk's depth, so beside four layers it looks as dear as a plain pass. Priced at the measured pass's
# seconds per byte (`budget.pass_seconds`), a plain pass of all {glue:text}`whole_layers` layers would take
# {glue:text}`whole_pass_s:.1f` s on this machine, and the head's draft {glue:text}`whole_head_share:.2f` of
# it. The verify pass's ratio does not shrink with depth: on this CPU every layer's products cost per token.
# A step at `n_draft=2` of the whole model would so cost {glue:text}`whole_break_even:.2f` plain passes,
# {glue:text}`whole_verdict`.
#
# This CPU got through the weights of the four layers at {glue:text}`cpu_gb_s:.1f` GB/s, against the
# {glue:text}`bandwidth_gb:.0f` GB/s assumed above for a memory-bound APU: MLX's CPU kernel for quantized
# products unpacks and multiplies every weight once for every row of activations, so the work, not the
# reading, sets the pace, and a verify pass over n tokens does nearly n times the work of one. On a GPU or an
# APU decoding from unified memory (the machines of the published measurements in {doc}`08_claims`) the same
# product reads each weight once for all n rows while its arithmetic units wait for memory: what a wider
# pass adds follows the bytes it adds, a verify pass over two tokens should cost about
# {glue:text}`real_v2_bytes:.2f`x a plain pass rather than {glue:text}`real_v2_time:.2f`x, and the
# prediction of the earlier sections applies (a fixed cost per pass, which the published engines do show,
# moves it as the section on fixed costs says; {doc}`08_claims` compares it with their runs). The same
# head and the same drafts can answer "does MTP pay?" differently on the two kinds of machine, because each
# waits for a different resource.

# %% tags=["remove-cell"]
saved = results.save(
    "06_throughput",
    path,
    {
        "predicted_moe_4bit": {str(n): moe[(4, n)] for n in range(1, 6)},
        "predicted_dense_4bit": {str(n): dense[(4, n)] for n in range(1, 6)},
        "measured_speedup": {
            str(r["n_draft"]): r["speedup_vs_plain"] for r in drafting
        },
        "plain_tokens_per_second": by_n[1]["tokens_per_second"],
        "real_gb_per_token": one_token / 1e9,
        "real_expert_share": passes["1 token"]["routed experts"] / one_token,
        "bandwidth_gb_s": BANDWIDTH / throughput.GB,
        "real_width": real_passes,
        "real_width_break_even": real_break_even,
        "whole_model_break_even": break_even_40,
        "whole_model_head_share": head_over_whole,
        "cost_model": {
            name: cost[name]
            for name in (
                "bytes_intercept",
                "overhead",
                "loop_overhead",
                "pass_fixed",
                "pass_per_token",
                "head_per_draft",
            )
        },
        "predicted_tiny": {
            str(n): p["predicted_speedup"] for n, p in predicted.items()
        },
        "real_width_on_model": claims.is_real_model(model.config),
        "machine": machine.describe(),
        "real_width_summary": {
            "layers": real_passes["layers"],
            "measured_on": (
                "real model"
                if claims.is_real_model(model.config)
                else "real-width layers"
            ),
            "plain_ms": plain_row["seconds"] * 1e3,
            "verify2_time_over_plain": verify2["time_over_plain"],
            "verify2_bytes_over_plain": verify2["bytes_over_plain"],
            "head_time_over_plain": head_row["time_over_plain"],
            "break_even_n_draft_2": real_break_even,
            "compute_bound": verify2["time_over_plain"]
            > 1.5 * verify2["bytes_over_plain"],
        },
    },
)


# %% [markdown]
# ## Exercises
#
# 1. Count the union for a model with fewer experts: `throughput.expected_union(64, 8, n)` for `n` 1 to 5.
#
#    *Where the answer shows:* beside the formula's curve in the figure of the expert union: fewer experts
#    fill up sooner, so each extra token verified costs less.
#
# 2. Price the real model on a slower machine: `throughput.real_model_table(bits=(4,), bandwidth=100e9)`,
#    then add `overhead=0.005, head_overhead=0.0` (5 ms per step, the drafts sharing it), then
#    `overhead=0.005` alone (5 ms per pass and per head draft).
#
#    *Where the answer shows:* the "MoE speedup" column of the table of predictions: bandwidth alone changes
#    no ratio; a fixed cost paid once per step raises every ratio, as the loop's cost does on the tiny model;
#    paid by every head draft too, it lowers them.
#
# 3. Fit the bytes model yourself: `throughput.fit_line([r["trunk_bytes_per_pass"] for r in drafting],
#    [r["trunk_seconds_per_pass"] for r in drafting])` in a cell after the benchmark.
#
#    *Where the answer shows:* the intercept, in seconds, is the one in the section on the tiny model: below
#    zero where a pass's time grows faster than its bytes.
