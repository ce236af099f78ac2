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
# # 6. Throughput: what a verify pass costs
#
# Chapter 5 showed the head's drafts saving trunk passes without changing a token. Whether that saves time
# depends on what a pass costs. Decoding one token multiplies each weight it uses by one vector, so on the
# machines this model runs on a pass takes about as long as reading those weights from memory. A verify pass
# over `n` tokens reads every dense weight once for all `n`, but in each MoE layer it reads the experts
# *any* of its tokens chose. This chapter counts those experts, turns bytes into time, predicts the speedup
# for the real model and for a dense model of the same active size, and sets the prediction beside what
# is measured here. The arithmetic lives in `qmtp.book.throughput`, the measurements in `qmtp.book.bench`
# (`python -m qmtp bench mtp` and `bench decode` print the same tables).
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - how many experts a verify pass over `n` tokens reads in each MoE layer, counted and from the formula;
# - how bytes read become time on a memory-bound machine, and the speedup MTP can give an A3B MoE next to a
#   dense model of the same active size;
# - where a speculative step's time goes on the tiny model, what compiling the step and queueing ahead buy,
#   how `n_draft="auto"` chooses the width, and qmtp against mlx-lm.
#
# **What runs here.** The cost model is pure arithmetic on the real config; the tiny model's passes and
# decoding speeds are measured in this run (timings vary with the machine and its load). The chapter's run
# time in this build is in the {doc}`execution table <../book/execution>`; the download button at the top of
# the page gives this notebook.
#
# **At full size.** {glue:md}`budget_note` ({doc}`real_checkpoint` gives the memory and time.)
# :::

# %% tags=["hide-input"]
import os

import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
import textwrap

from qmtp.book import (
    bench,
    budget,
    claims,
    evaluate,
    inventory,
    machine,
    plots,
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
    ablate=(1, 4),
)
by_n = {r["n_draft"]: r for r in report["results"]}
assert all(r["same_tokens_as_plain"] for r in report["results"])
display(
    Markdown(
        inventory.markdown_table(
            [
                {
                    "n_draft": r["n_draft"],
                    "tok/s": r["tokens_per_second"],
                    "vs plain": r["speedup_vs_plain"],
                    "ideal": r["ideal_speedup"],
                    "tokens/pass": r["tokens_per_trunk_pass"],
                    "verify ms": r["trunk_seconds_per_pass"] * 1e3,
                    "head ms/draft": r["head_seconds_per_draft"] * 1e3,
                    "queue ms/pass": r["phase_seconds_per_pass"].get("build", 0) * 1e3,
                    "wait ms/pass": r["phase_seconds_per_pass"].get("sync", 0) * 1e3,
                }
                for r in report["results"]
            ],
            [
                "n_draft",
                "tok/s",
                "vs plain",
                "ideal",
                "tokens/pass",
                "verify ms",
                "head ms/draft",
                "queue ms/pass",
                "wait ms/pass",
            ],
            {
                "tok/s": "{:.0f}",
                "vs plain": "{:.2f}x",
                "ideal": "{:.2f}x",
                "tokens/pass": "{:.2f}",
                "verify ms": "{:.2f}",
                "head ms/draft": "{:.2f}",
                "queue ms/pass": "{:.2f}",
                "wait ms/pass": "{:.2f}",
            },
        )
    )
)
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
# host). For the real Qwen3.6-35B-A3B, trunk and head both at {glue:text}`real_bits` bits (the head at the
# trunk's width, as the seed's converter writes it by default), and a {glue:text}`context`-token context:

# %% mystnb={"figure": {"caption": "What one pass of the real Qwen3.6-35B-A3B reads, trunk and head at {glue:text}`real_bits` bits, with a {glue:text}`context`-token context, by term, computed from its config: {glue:text}`real_gb_token:.2f` GB for one token, of which routed experts are {glue:text}`real_expert_share:.0%`; {glue:text}`real_gb_verify2:.2f` GB for a verify pass over two tokens; {glue:text}`real_gb_head:.2f` GB for one step of the head, most of it lm_head.", "name": "fig-bytes-per-pass"}}
CONTEXT, BANDWIDTH, BITS = 4096, 256 * throughput.GB, 4
real4 = sizes(QWEN36_35B_A3B, BITS, mtp_bits=BITS)
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
bf16_head = throughput.head_step_bytes(
    QWEN36_35B_A3B, sizes(QWEN36_35B_A3B, BITS), CONTEXT
)
glue("real_gb_head_bf16", throughput.total(bf16_head) / 1e9, display=False)

# %% [markdown]
# One token reads {glue:text}`real_gb_token:.2f` GB, {glue:text}`real_expert_share:.0%` of it routed
# experts: at {glue:text}`bandwidth_gb:.0f` GB/s (a unified-memory APU) that is {glue:text}`real_ms_token:.1f` ms, at most
# {glue:text}`real_tps_bound:.0f` tokens/s. A verify pass over two tokens reads
# {glue:text}`real_gb_verify2:.2f` GB, and each head step another {glue:text}`real_gb_head:.2f` GB, most of
# it lm_head; with the head kept in bf16, as this book recommends, a head step reads
# {glue:text}`real_gb_head_bf16:.2f` GB. The predictions below keep the head at the trunk's width.
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
# verify pass as for one token, so its drafts cost only the head. The rates below are the reported
# {glue:text}`claim_acc2` at `n_draft=2` and {glue:text}`claim_acc3` at `n_draft=3`, read as the first two positions and shrinking by the same ratio
# after (`throughput.geometric_rates`); the machine is purely memory-bound (no overhead).

# %%
rows = throughput.real_model_table(bits=(4, 8), bandwidth=BANDWIDTH, context=CONTEXT)


def row(bits, model_kind, n):
    return next(
        r
        for r in rows
        if r["bits"] == bits and r["model"] == model_kind and r["n_draft"] == n
    )


table = [
    {
        "bits": b,
        "n_draft": n,
        "tokens/pass": row(b, "MoE", n)["tokens_per_pass"],
        "MoE ms/step": row(b, "MoE", n)["step_ms"],
        "MoE tok/s": row(b, "MoE", n)["tokens_per_second"],
        "MoE speedup": row(b, "MoE", n)["speedup"],
        "dense speedup": row(b, "dense, same active size", n)["speedup"],
    }
    for b in (4, 8)
    for n in range(2, 6)
]
display(
    Markdown(
        inventory.markdown_table(
            table,
            list(table[0]),
            {
                "tokens/pass": "{:.2f}",
                "MoE ms/step": "{:.1f}",
                "MoE tok/s": "{:.0f}",
                "MoE speedup": "{:.2f}x",
                "dense speedup": "{:.2f}x",
            },
        )
    )
)


moe = {(b, n): row(b, "MoE", n)["speedup"] for b in (4, 8) for n in range(1, 6)}
dense = {
    (b, n): row(b, "dense, same active size", n)["speedup"]
    for b in (4, 8)
    for n in range(1, 6)
}
best = max(moe, key=moe.get)
glue("moe4_n2", moe[(4, 2)], display=False)
glue("moe8_n2", moe[(8, 2)], display=False)
glue("moe4_n5", moe[(4, 5)], display=False)
glue("dense4_n2", dense[(4, 2)], display=False)
glue("dense4_best", max(dense[(4, n)] for n in range(1, 6)), display=False)
glue("moe_best", moe[best], display=False)
glue("moe_best_n", best[1], display=False)
glue("claim_low", CLAIMS["speedup_moe"].value[0], display=False)
glue("claim_high", CLAIMS["speedup_moe"].value[1], display=False)
radeon = CLAIMS["speedup_radeon_890m"].value
glue("claim_radeon", radeon[1] / radeon[0], display=False)

# %% mystnb={"figure": {"caption": "Predicted speedup over plain decoding for the real model's config on a purely memory-bound machine at {glue:text}`bandwidth_gb:.0f` GB/s, with the reported acceptance: the MoE (solid) at best {glue:text}`moe_best:.2f`x, at n_draft {glue:text}`moe_best_n`, a dense model of the same active size (dashed) up to {glue:text}`dense4_best:.2f`x at 4 bits; the grey band is the {glue:text}`claim_low:.1f`x to {glue:text}`claim_high:.1f`x reported for A3B MoE models.", "name": "fig-predicted-speedups"}}
fig = plots.predicted_speedups(rows, claimed=CLAIMS["speedup_moe"].value)

# %% [markdown]
# On paper the MoE gains {glue:text}`moe4_n2:.2f`x at `n_draft=2` (4-bit; {glue:text}`moe8_n2:.2f`x at 8-bit)
# and at best {glue:text}`moe_best:.2f`x (`n_draft` = {glue:text}`moe_best_n`); by `n_draft=5` the growing
# union of experts and the head's lm_head reads bring it to {glue:text}`moe4_n5:.2f`x. A dense model of
# the same active size gains {glue:text}`dense4_n2:.2f`x at `n_draft=2` and up to
# {glue:text}`dense4_best:.2f`x. The reported speedups for A3B MoE models, {glue:text}`claim_low:.1f`x to
# {glue:text}`claim_high:.1f`x, sit where this model puts them, and a fixed overhead per pass only lowers
# the ceiling further; the seed's own {glue:text}`claim_radeon:.2f`x on a Radeon 890M is "roughly
# throughput-neutral" indeed.
#
# ## The tiny model: prediction beside measurement
#
# The tiny model moves a few megabytes per pass. Fitting $t = \text{overhead} + \text{bytes}/\text{bandwidth}$
# to its measured verify passes (`n_draft` 2 to 5, bytes from the measured unions) and its head steps
# gives the two numbers of its machine (`throughput.fit_machine`). With them and the measured acceptance,
# the cost model prices each speculative step, and the predicted speedup sets that price against the
# measured plain pass.

# %%
cost = report["cost_model"]
display(
    Markdown(
        inventory.markdown_table(
            [
                {
                    "n_draft": p["n_draft"],
                    "tokens/pass": p["tokens_per_pass"],
                    "ms/step predicted": p["predicted_step_seconds"] * 1e3,
                    "ms/step measured": p["measured_step_seconds"] * 1e3,
                    "tok/s": by_n[p["n_draft"]]["tokens_per_second"],
                    "speedup predicted": p["predicted_speedup"],
                    "speedup measured": p["measured_speedup"],
                }
                for p in cost["predictions"]
            ],
            [
                "n_draft",
                "tokens/pass",
                "ms/step predicted",
                "ms/step measured",
                "tok/s",
                "speedup predicted",
                "speedup measured",
            ],
            {
                "tokens/pass": "{:.2f}",
                "ms/step predicted": "{:.1f}",
                "ms/step measured": "{:.1f}",
                "tok/s": "{:.0f}",
                "speedup predicted": "{:.2f}x",
                "speedup measured": "{:.2f}x",
            },
        )
    )
)
plain, predicted = by_n[1], {p["n_draft"]: p for p in cost["predictions"]}
drafting = [r for r in report["results"] if r["n_draft"] > 1]
best = max(drafting, key=lambda r: r["speedup_vs_plain"])
glue("tiny_overhead_ms", cost["overhead"] * 1e3, display=False)
glue("tiny_pass_ms", plain["trunk_seconds_per_pass"] * 1e3, display=False)
glue("tiny_verify2_ms", by_n[2]["trunk_seconds_per_pass"] * 1e3, display=False)
glue("tiny_bandwidth", cost["bandwidth"] / 1e9, display=False)
glue("tiny_mb_pass", plain["trunk_bytes_per_pass"] / 1e6, display=False)
glue("tiny_blas", report["blas"], display=False)
glue(
    "tiny_build_share",
    by_n[2]["phase_seconds_per_pass"].get("build", 0)
    / by_n[2]["decode_seconds_per_pass"],
    display=False,
)
glue("tiny_ideal_n2", by_n[2]["ideal_speedup"], display=False)
glue("tiny_head_ms", by_n[2]["head_seconds_per_draft"] * 1e3, display=False)
glue("tiny_pred_n2", predicted[2]["predicted_speedup"], display=False)
glue("tiny_meas_n2", by_n[2]["speedup_vs_plain"], display=False)
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

# %% mystnb={"figure": {"caption": "The tiny model on this machine: measured speedup over plain decoding at each n_draft (bars; whiskers the slowest and fastest rounds), the fitted cost model's prediction (red dots) and the tokens per pass that bound both (grey): {glue:text}`tiny_meas_n2:.2f`x measured at n_draft 2 against {glue:text}`tiny_pred_n2:.2f`x predicted, and {glue:text}`tiny_verdict`.", "name": "fig-measured-vs-predicted"}}
fig = plots.measured_vs_predicted(report)

# %% [markdown]
# A plain pass of the tiny model reads {glue:text}`tiny_mb_pass:.1f` MB in {glue:text}`tiny_pass_ms:.1f` ms;
# a verify pass over two tokens takes {glue:text}`tiny_verify2_ms:.1f` ms. The fit puts
# {glue:text}`tiny_overhead_ms:.1f` ms of every pass in a fixed overhead and prices the rest at an effective
# {glue:text}`tiny_bandwidth:.2f` GB/s: not the memory's bandwidth, but the rate at which a longer pass's
# extra work costs time, most of it more operations to dispatch (one more step of every DeltaNet
# recurrence, one more query in every attention layer, more experts to gather, and one more row through every
# matrix product, which MLX hands to {glue:text}`tiny_blas` (`qmtp.blas`: the `mlx[cpu]` wheel for Linux
# carries netlib's reference BLAS, on which a product of n rows costs n products of one; qmtp loads the
# machine's OpenBLAS for MLX when there is one).
#
# A speculative step is one function of arrays (`qmtp.decoding.step`: draft, verify, accept, roll back),
# with greedy acceptance computed on the device, so the loop reads one small array per trunk pass and queues
# the next pass before reading it. On the CPU that overlap is small: MLX lets the host run only a few
# operations ahead of the computation, so queueing a pass ("build" in the bench's table) takes
# {glue:text}`tiny_build_share:.0%` of a pass's time at `n_draft=2` and waiting for its tokens almost
# nothing. A head draft step costs {glue:text}`tiny_head_ms:.2f` ms; if a verify pass cost what a plain pass
# costs, `n_draft=2` would give {glue:text}`tiny_ideal_n2:.2f`x ("ideal" in the table); what lies between
# that and the measurement is the price of the extra rows. The model predicts {glue:text}`tiny_pred_n2:.2f`x at `n_draft=2`,
# {glue:text}`tiny_meas_n2:.2f`x is measured, and {glue:text}`tiny_verdict`. On a memory-bound machine at
# the real widths the bytes term dominates and the union of experts takes most of the gain back, as the
# previous section predicts: the same equation with a different term in charge. Whether this machine is one
# is measured next.
#
# ## At the real widths, measured
#
# The real model is not here, but its widths can be: the first four of its layers (three DeltaNet, one
# attention) with all 256 experts, its head and its vocabulary of 248,320, built in memory as a 4-bit
# conversion loads on a 24 GB machine (the trunk 4-bit, the head's experts in bf16; `bench.real_width_model`).
# Its weights are seeded constants, except the embeddings and the routers, which are random so that tokens
# route apart: a product takes the same time whatever its values. Each pass is compiled and timed alone
# (`bench.real_width_passes`). If time followed bytes, as on a memory-bound machine, each pass's time over
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
display(
    Markdown(
        inventory.markdown_table(
            [
                {
                    "pass": r["pass"],
                    "ms": r["seconds"] * 1e3,
                    "time / plain": r["time_over_plain"],
                    "MB read": r["bytes"] / 1e6,
                    "bytes / plain": r["bytes_over_plain"],
                }
                for r in real_passes["rows"]
            ],
            ["pass", "ms", "time / plain", "MB read", "bytes / plain"],
            {
                "ms": "{:.0f}",
                "time / plain": "{:.2f}x",
                "MB read": "{:.0f}",
                "bytes / plain": "{:.2f}x",
            },
        )
    )
)
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
# {glue:text}`real_break_even:.2f` plain passes, {glue:text}`real_verdict`. Where a pass's time follows its
# bytes (an accelerator reading from memory), the bytes column is the one that prices it, and the prediction
# of the previous sections applies.
#
# ## Choosing the width as you go
#
# The best `n_draft` depends on the head's acceptance, which depends on the text, and on what a wider pass
# costs, which depends on the model and the machine. `n_draft="auto"` (`qmtp.adaptive.DraftPlanner`) estimates
# both. The acceptance at each draft position is counted from the drafts proposed and kept, carried from one
# generation to the next and faded step by step, each rate pulled towards the rate of the position before it:
# at width w the positions past w - 1 are never proposed, and a low rate seen there once, if it were kept,
# would shut every wider width out for good. Nothing is timed before the first token: the cost of a step
# at each width is learned from the steps the loop runs anyway, the interval between reading one step's tokens
# and the next's where both steps have the same width (the loop queues a step before it reads the one before,
# so beside a change of width an interval is partly its neighbour's). A width is kept for a few steps once
# chosen, so that its steps are timed; a width not yet run is priced by the line through the measured ones,
# so the planner moves to a neighbour only when what it has measured says that pays, and compiles each width
# when it first uses it. The costs stay with the model, and each generation refines them. Each step then
# takes the width with the most expected tokens per second, $\tau(k)/c(k+1)$, with $\tau$ the tokens per
# pass of the section on speedup, and falls back to plain decoding for good when drafting stops paying. It ran
# in the same rounds as the fixed widths above:

# %%
auto = report["auto"]
assert auto["same_tokens_as_plain"]
display(
    Markdown(
        inventory.markdown_table(
            [
                {"width": n, "share of steps": share}
                for n, share in auto["width_share"].items()
            ],
            ["width", "share of steps"],
            {"share of steps": "{:.0%}"},
        )
    )
)
glue("auto_tps", auto["tokens_per_second"], display=False)
glue("auto_vs_plain", auto["speedup_vs_plain"], display=False)
glue("auto_vs_best", auto["over_best_fixed"], display=False)
glue("auto_best_n", auto["best_fixed_n_draft"], display=False)
glue("auto_tokens_per_pass", auto["tokens_per_trunk_pass"], display=False)
glue("auto_first_token_ms", auto["first_token_seconds"] * 1e3, display=False)
glue("plain_first_token_ms", by_n[1]["first_token_seconds"] * 1e3, display=False)
glue(
    "auto_verdict",
    (
        "within 5% of the best fixed width"
        if auto["over_best_fixed"] >= 0.95
        else "more than 5% short of the best fixed width: on this machine its timings "
        "or its acceptance estimates led it to a width that was not the best in these "
        "rounds"
    ),
    display=False,
)

# %% [markdown]
# With `auto`, decoding ran at {glue:text}`auto_tps:.0f` tokens/s, {glue:text}`auto_vs_plain:.2f`x plain
# decoding and {glue:text}`auto_vs_best:.2f`x the best fixed width (`n_draft` = {glue:text}`auto_best_n`),
# {glue:text}`auto_tokens_per_pass:.2f` tokens per pass: {glue:text}`auto_verdict`. Its first token came
# {glue:text}`auto_first_token_ms:.1f` ms after the call, against {glue:text}`plain_first_token_ms:.1f` ms for
# plain decoding (medians over the rounds): it times nothing before it. The fixed widths' speeds are those of
# the same rounds, so part of any gap is the machine's noise.
#
# ## What the lean loop buys
#
# Two choices make the loop above lean: each step is one compiled function (`mx.compile` traces
# `qmtp.decoding.step` once per width and replays the trace), and the host queues step s + 1 before it
# reads the tokens of step s, so the machine never waits for Python. The same rounds ran the same loop with
# one or both taken away (`generate(..., compiled=False, queue_ahead=False)`; `python -m qmtp bench mtp
# --ablate 1 4` prints the same rows), at plain decoding and at `n_draft=4`:

# %%
ablation = report["ablation"]
assert all(r["same_tokens_as_lean"] for r in ablation)
lean = {n: by_n[n]["tokens_per_second"] for n in (1, 4)}
rows = [
    {
        "loop": "compiled, queued ahead",
        "n_draft": n,
        "tok/s": lean[n],
        "of the lean loop": 1.0,
        "vs plain (lean)": lean[n] / lean[1],
    }
    for n in (1, 4)
]
rows += [
    {
        "loop": r["loop"].replace("eager", "eager (not compiled)"),
        "n_draft": r["n_draft"],
        "tok/s": r["tokens_per_second"],
        "of the lean loop": r["over_lean"],
        "vs plain (lean)": r["tokens_per_second"] / lean[1],
    }
    for r in ablation
]
display(
    Markdown(
        inventory.markdown_table(
            rows,
            ["loop", "n_draft", "tok/s", "of the lean loop", "vs plain (lean)"],
            {
                "tok/s": "{:.0f}",
                "of the lean loop": "{:.2f}x",
                "vs plain (lean)": "{:.2f}x",
            },
        )
    )
)
eager = {r["n_draft"]: r for r in ablation if r["loop"].startswith("eager")}
unqueued = {r["n_draft"]: r for r in ablation if not r["loop"].startswith("eager")}
glue("eager_n4_vs_lean_plain", eager[4]["tokens_per_second"] / lean[1], display=False)
glue(
    "eager_n4_vs_eager_plain",
    eager[4]["tokens_per_second"] / eager[1]["tokens_per_second"],
    display=False,
)
glue("eager_n1_of_lean", eager[1]["over_lean"], display=False)
glue("unqueued_n4_of_lean", unqueued[4]["over_lean"], display=False)
glue("lean_n4_vs_plain", lean[4] / lean[1], display=False)
trace_gain = (
    unqueued[4]["tokens_per_second"] / eager[4]["tokens_per_second"]
)  # both read before queueing
overlap_gain = 1 / unqueued[4]["over_lean"]
glue("trace_gain", trace_gain, display=False)
glue("overlap_gain", overlap_gain, display=False)
glue(
    "gain_verdict",
    (
        "the trace is worth more than the overlap"
        if trace_gain > overlap_gain
        else "the overlap is worth more than the trace"
    ),
    display=False,
)

# %% [markdown]
# Without its trace a step builds its graph operation by operation, which at the tiny model's sizes is a
# large part of a step: eager plain decoding runs at {glue:text}`eager_n1_of_lean:.2f`x the lean loop.
# Eager drafting at `n_draft=4` is {glue:text}`eager_n4_vs_eager_plain:.2f`x eager plain decoding, but
# {glue:text}`eager_n4_vs_lean_plain:.2f`x the lean plain loop, against {glue:text}`lean_n4_vs_plain:.2f`x
# for the lean one: a speculative loop is only faster if it beats a plain loop as lean as itself. At
# `n_draft=4` the trace alone gives {glue:text}`trace_gain:.2f`x (both loops reading each step before
# queueing the next) and queueing ahead another {glue:text}`overlap_gain:.2f`x: {glue:text}`gain_verdict`
# here (on the CPU, MLX lets the host run only a little ahead of the computation).
#
# ## qmtp against mlx-lm
#
# Plain greedy decoding of the same checkpoint by qmtp and by mlx-lm's `generate_step`, both computing in
# float32 on the CPU, interleaved round by round (`bench.decode`; `python -m qmtp bench decode --scaled DIR`
# runs the same comparison on a synthetic model of the real layer widths).

# %%
if FULL:  # mlx-lm would hold a second whole model (qmtp.book.budget)
    nan = {"tokens_per_second": float("nan")}
    versus = {
        "engines": {"qmtp": nan, "mlx-lm": nan},
        "ratio": float("nan"),
        "same_tokens": True,
    }
    print("mlx-lm is not loaded at full size")
else:
    versus = bench.decode(model, prompts, max_tokens=MAX_TOKENS, repeats=REPEATS)
    print(bench.decode_table(versus))
glue("qmtp_tps", versus["engines"]["qmtp"]["tokens_per_second"], display=False)
glue("mlx_lm_tps", versus["engines"]["mlx-lm"]["tokens_per_second"], display=False)
glue("qmtp_ratio", versus["ratio"], display=False)
glue(
    "same_tokens",
    "the same" if versus["same_tokens"] else "NOT the same",
    display=False,
)
assert versus["same_tokens"]

# %% [markdown]
# qmtp decodes {glue:text}`qmtp_tps:.0f` tokens/s against mlx-lm's {glue:text}`mlx_lm_tps:.0f`
# (ratio {glue:text}`qmtp_ratio:.2f`), and both produce {glue:text}`same_tokens` greedy tokens. qmtp gets
# there by running a whole decode or verify step as one compiled function of the state it carries
# (`mx.compile` over `qmtp.decoding.step`), which fuses its elementwise work and replays it without Python,
# and by queueing the next pass before reading the current token. At the tiny widths a pass costs what it dispatches, so this
# is where an engine's own overheads show. At the real widths both engines spend their time in the same
# MLX matrix kernels, each operation on one core. There qmtp's one advantage is `qmtp.cores`: lm_head, the
# widest weight a step reads, is cut into blocks of rows computed on separate CPU streams, so on separate
# cores, with exactly the same logits (`python -m qmtp bench decode --scaled DIR` measures it; `QMTP_CORES=1`
# turns it off). The tiny model's lm_head is too small for that to pay, so it is not split here.

# %%
saved = results.save(
    "06_throughput",
    path,
    {
        "predicted_moe_4bit": {str(n): moe[(4, n)] for n in range(1, 6)},
        "predicted_dense_4bit": {str(n): dense[(4, n)] for n in range(1, 6)},
        "measured_speedup": {
            str(r["n_draft"]): r["speedup_vs_plain"] for r in drafting
        },
        "qmtp_over_mlx_lm": versus["ratio"],
        "plain_tokens_per_second": by_n[1]["tokens_per_second"],
        "auto_over_best_fixed": auto["over_best_fixed"],
        "real_gb_per_token": one_token / 1e9,
        "real_expert_share": passes["1 token"]["routed experts"] / one_token,
        "bandwidth_gb_s": BANDWIDTH / throughput.GB,
        "real_width": real_passes,
        "real_width_break_even": real_break_even,
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
# 2. Run `python -m qmtp bench mtp` in a terminal, then `QMTP_BLAS=bundled python -m qmtp bench mtp`.
#
#    *Where the answer shows:* the first line of each table names the BLAS; compare the "verify ms" column
#    for `n_draft` 1 and 5, and the "vs plain" column.
#
# 3. Set `QMTP_CORES=1` and rerun `python -m qmtp bench decode`.
#
#    *Where the answer shows:* the qmtp row of *qmtp against mlx-lm*; on the tiny model lm_head is not split,
#    so the number should not move.
