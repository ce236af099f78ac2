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
# # 7. The engine
#
# {doc}`06_throughput` priced a step from its passes. This chapter is about the code around them: where a
# step's time goes in the decoding loop, what compiling the step and queueing the next one ahead buy, how
# `n_draft="auto"` chooses the width, which BLAS the matrix products run on, and how qmtp compares with the two
# other MLX engines that run this model, mlx-lm (plain decoding) and mlx-vlm (its own MTP drafting), on the
# tiny model and, against mlx-lm, at the real widths. The measurements live in `qmtp.book.bench`
# (`python -m qmtp bench mtp` and `bench decode` print the same tables).
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - where a speculative step's time goes on the tiny model: the passes, the head's drafts, the loop around
#   them;
# - what compiling the step and queueing ahead buy, and how `n_draft="auto"` chooses the width;
# - qmtp against mlx-lm and mlx-vlm on the same checkpoint, and against mlx-lm at the real widths, where
#   both wait on the same MLX kernel.
#
# **What runs here.** The tiny model's decoding, interleaved with mlx-lm's and mlx-vlm's on the same prompts,
# and four layers at the real widths decoded by qmtp and by mlx-lm, all measured in this run (timings vary
# with the machine and its load). The chapter's run time in this build, and the machine it ran on, are in the
# {doc}`execution table <../book/execution>`; the download button at the top of the page gives this notebook.
#
# **At full size** ({doc}`the budget <real_checkpoint>`): {glue:md}`budget_note`
# :::

# %% tags=["hide-input"]
import os

import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
from qmtp import blas
from qmtp.book import bench, budget, evaluate, inventory, machine, peer, plots, results

path = inventory.model_path()
print(inventory.describe(path))
config = qmtp.ModelConfig.from_file(path)
FULL = budget.active(config)  # the full-size release (qmtp.book.budget)
glue("budget_note", Markdown(budget.plan("07_engine")), display=False)
model = qmtp.load(budget.decoding_model(path))
QUICK = os.environ.get("QMTP_QUICK") == "1"
prompts = evaluate.heldout_prompts(model, 1)
MAX_TOKENS, REPEATS = (16, 1) if QUICK else (32, 3)
N_DRAFTS = (1, 2, 3, 4, 5)
if FULL:
    MAX_TOKENS, REPEATS = budget.ENGINE["max_tokens"], budget.ENGINE["repeats"]
    N_DRAFTS = budget.ENGINE["n_drafts"]
# mlx-vlm beside qmtp on the same checkpoint: not at full size (a second whole model)
why_no_peer = "not loaded at full size" if FULL else peer.not_installed_reason()
peer_engine = None if why_no_peer else peer.MlxVlmEngine(path)

# %% [markdown]
# ## Where a step's time goes
#
# qmtp decodes at each `n_draft` from 1 to 5, `n_draft="auto"`, the loop with parts of it taken away, and
# mlx-vlm's own MTP decoding, all on the same held-out prompts, interleaved prompt by prompt and repeated
# (`bench.mtp`), so that the shared machine's slow spells fall on all of them alike. The loop's phases are
# timed as it runs (`speculative.PhaseTimer`): "queue" is the host calling the compiled step and queueing it
# (`mx.async_eval`), "wait" the host waiting for the step's tokens. The verify pass and the head's drafts are
# also compiled and timed alone.

# %%
report = bench.mtp(
    model,
    prompts[:1] if FULL else prompts,
    max_tokens=MAX_TOKENS,
    n_drafts=N_DRAFTS,
    repeats=REPEATS,
    ablate=(1, 4),
    peer=peer_engine,
)
assert all(r["same_tokens_as_plain"] for r in report["results"])
Markdown(bench.step_table(report))

# %% tags=["remove-cell"]
by_n = {r["n_draft"]: r for r in report["results"]}
step_ms = {n: r["step_seconds_mean"] * 1e3 for n, r in by_n.items()}
passes_ms = {n: (r["trunk_seconds_per_pass"] + (n - 1) * r["head_seconds_per_draft"]) * 1e3 for n, r in by_n.items()}
# the share of a step in the loop spent outside its passes (0 where noise says less)
outside = {n: max(0.0, 1 - passes_ms[n] / step_ms[n]) for n in by_n}
glue("plain_step_ms", step_ms[1], display=False)
glue("plain_outside", outside[1], display=False)
glue("n4_outside", outside[4], display=False)
phases = by_n[2]["phase_seconds_per_pass"]
queue_share = phases.get("build", 0) * 1e3 / step_ms[2]
wait_share = phases.get("sync", 0) * 1e3 / step_ms[2]
glue("queue_share", queue_share, display=False)
glue("wait_share", wait_share, display=False)
glue(
    "phase_reading",
    "most of the step is spent queueing it, because on the CPU MLX computes on the host's own cores, so "
    "queueing a step runs most of its computation there and then, and waiting finds it done"
    if queue_share > wait_share
    else "most of the step is spent waiting for its tokens while the computation runs; the host's own work "
    "of calling the compiled step and queueing it is the smaller part",
    display=False,
)

# %% mystnb={"figure": {"caption": "One step of the tiny model's decoding loop, in ms, at each n_draft: the verify pass (blue) and the head's drafts (green), each compiled and timed alone, and the rest of the step as the loop ran it (grey), up to the step in the loop, tokens per pass over tokens per second (black): {glue:text}`plain_outside:.0%` of a plain step is outside its pass, {glue:text}`n4_outside:.0%` at n_draft 4.", "name": "fig-step-profile"}}
fig = plots.step_profile(report)

# %% [markdown]
# "tok/s" is the median over the rounds; "step ms", "queue ms" and "wait ms" are means per step over every round
# (the phase timers add up every round, a slow spell included, so the step they are set beside is timed over the
# same runs, and queue and wait never add up to more than the step). A plain step in the loop takes
# {glue:text}`plain_step_ms:.2f` ms, {glue:text}`plain_outside:.0%` of it outside the pass itself
# ({glue:text}`n4_outside:.0%` at `n_draft=4`). The loop's phase timers split the step differently: at n_draft=2
# "queue" takes {glue:text}`queue_share:.0%` of a step and "wait" {glue:text}`wait_share:.0%`:
# {glue:text}`phase_reading`. The loop
# model of {doc}`06_throughput` counts what the loop adds once per step ($t_\text{loop}$), beside the passes'
# own fixed cost: a cost paid once per step is shared by every token the step yields, which is why drafting
# can pay on the tiny model.
#
# ## Choosing the width as you go
#
# The best `n_draft` depends on the head's acceptance, which depends on the text, and on what a wider pass
# costs, which depends on the model and the machine. `n_draft="auto"` (`qmtp.adaptive.DraftPlanner`) estimates
# both. The acceptance at each draft position is counted from the drafts proposed and kept, carried from one
# generation to the next and faded step by step, each rate pulled towards the rate of the position before it:
# at width w the positions past w - 1 are never proposed, and a low rate seen there once, if it were kept,
# would shut every wider width out for good. Nothing is timed before the first token: the cost of a step
# at each width is learned from the steps the loop runs anyway, the interval between reading one step's
# tokens and the next's where both steps have the same width (the loop queues a step before it reads the one
# before, so beside a change of width an interval is partly its neighbour's). A width is kept for a few steps
# once chosen, so that its steps are timed; a width not yet run is priced by the line through the measured
# ones, so the planner moves to a neighbour only when what it has measured says that pays, and compiles each
# width when it first uses it. The costs stay with the model, and each generation refines them. Each step
# then takes the width with the most expected tokens per second, $\tau(k)/c(k+1)$, with $\tau$ the tokens
# per pass of the section on speedup, and falls back to plain
# decoding for good when drafting stops paying. It ran in the same rounds as the fixed widths above:

# %%
auto = report["auto"]
assert auto["same_tokens_as_plain"]
Markdown(bench.width_share_table(auto))

# %% tags=["remove-cell"]
glue("auto_tps", auto["tokens_per_second"], display=False)
glue("auto_vs_plain", auto["speedup_vs_plain"], display=False)
glue("auto_vs_best", auto["over_best_fixed"], display=False)
glue("auto_best_n", auto["best_fixed_n_draft"], display=False)
glue("auto_tokens_per_pass", auto["tokens_per_trunk_pass"], display=False)
glue("auto_first_token_ms", auto["first_token_seconds"] * 1e3, display=False)
glue("auto_first_token_ratio", auto["first_token_over_plain"], display=False)
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
# {glue:text}`auto_first_token_ms:.1f` ms after the call, {glue:text}`auto_first_token_ratio:.2f` times plain
# decoding's (medians over the rounds): it times nothing before it. The fixed widths' speeds are those of the
# same rounds, so part of any gap is the machine's noise.
#
# ## What the lean loop buys
#
# Two choices are meant to make the loop above lean: each step is one compiled function (`mx.compile` traces
# `qmtp.decoding.step` once per width and replays the trace), and the host queues step s + 1 before it
# reads the tokens of step s, so that the computation need not wait for Python. The same rounds ran the same loop with
# one or both taken away (`generate(..., engine=qmtp.Engine(compiled=False, queue_ahead=False))`; `python -m qmtp bench mtp
# --ablate 1 4` prints the same rows), at plain decoding and at `n_draft=4`, so that what each is worth is
# measured:

# %%
ablation = report["ablation"]
assert all(r["same_tokens_as_lean"] for r in ablation)
Markdown(bench.ablation_table(report))

# %% tags=["remove-cell"]
lean = {n: by_n[n]["tokens_per_second"] for n in (1, 4)}
effects = bench.lean_loop_effects(ablation)
eager = {r["n_draft"]: r for r in ablation if r["loop"].startswith("eager")}
for n in (1, 4):
    for half, what in (("trace", "the trace"), ("queue ahead", "queueing ahead")):
        glue(f"{half.replace(' ', '_')}_n{n}", bench.effect_phrase(what, effects[n][half]), display=False)
    glue(f"both_n{n}", effects[n]["both"], display=False)
glue("eager_n4_vs_lean_plain", eager[4]["tokens_per_second"] / lean[1], display=False)
glue("eager_n4_vs_eager_plain", eager[4]["tokens_per_second"] / eager[1]["tokens_per_second"], display=False)
glue("lean_n4_vs_plain", lean[4] / lean[1], display=False)
worth = {"the trace": effects[4]["trace"], "queueing ahead": effects[4]["queue ahead"]}
glue(
    "gain_verdict",
    (
        "neither half is worth measurably more than the other here"
        if abs(worth["the trace"] - worth["queueing ahead"]) <= bench.NOISE
        else f"{max(worth, key=worth.get)} is worth more here"
    ),
    display=False,
)
pays = {n: effects[n]["queue ahead"] > 1 + bench.NOISE for n in (1, 4)}
glue(
    "queue_note",
    (
        "Queueing ahead pays at both widths: the host prepares the next step while "
        "the current one computes."
        if pays[1] and pays[4]
        else "Queueing ahead does not pay here at either width: on the CPU MLX "
        "computes on the host's own cores, so the host cannot run far ahead of the "
        "computation."
        if not (pays[1] or pays[4])
        else "Queueing ahead pays only at "
        + ("plain decoding." if pays[1] else "n_draft=4.")
    ),
    display=False,
)

# %% [markdown]
# "of the lean loop" is, for each round, a loop's speed over the lean loop's at the same `n_draft`, and its
# median over the rounds, so that a slow spell of the shared machine falls on both sides of the ratio; "tok/s"
# and "vs plain (lean)" are medians of each loop's own speeds, so the two columns need not match exactly.
# From the per-round ratios, at plain decoding {glue:text}`trace_n1` (both loops reading each step before
# queueing the next), and {glue:text}`queue_ahead_n1`; the lean loop, with both, runs at
# {glue:text}`both_n1:.2f`x the eager loop without either. At `n_draft=4` {glue:text}`trace_n4`, and
# {glue:text}`queue_ahead_n4`; both together, {glue:text}`both_n4:.2f`x: {glue:text}`gain_verdict`.
# {glue:text}`queue_note`
#
# A speculative loop is only faster if it beats a plain loop as lean as itself. Eager drafting at
# `n_draft=4` runs at {glue:text}`eager_n4_vs_eager_plain:.2f`x eager plain decoding and
# {glue:text}`eager_n4_vs_lean_plain:.2f`x the lean plain loop; the lean loop at `n_draft=4` runs at
# {glue:text}`lean_n4_vs_plain:.2f`x its own plain decoding.
#
# ## The matrix products: which BLAS
#
# An unquantized matrix product on MLX's CPU backend goes to a BLAS. The `mlx[cpu]` wheel for Linux carries
# netlib's reference BLAS, on which a product of n rows costs n products of one; `qmtp.blas` loads the
# machine's OpenBLAS for MLX when there is one (`QMTP_BLAS=bundled` keeps the wheel's). In this build:
# {glue:text}`blas_used`. Quantized products (every weight of a converted model) do not go through a BLAS:
# they are MLX's own kernel, whatever the BLAS.
#
# ## qmtp against mlx-lm and mlx-vlm
#
# Plain greedy decoding of the same checkpoint by qmtp and by mlx-lm's `generate_step`, both computing in
# float32 on the CPU, interleaved round by round (`bench.decode`); and mlx-vlm's own MTP drafting
# (`--draft-kind mtp`, its `block_size` the same count as `n_draft`) in the same rounds as qmtp's widths above.

# %%
if not FULL:  # mlx-lm would hold a second whole model (qmtp.book.budget)
    versus = bench.decode(model, prompts, max_tokens=MAX_TOKENS, repeats=REPEATS)
    assert versus["same_tokens"]
    print(bench.decode_table(versus))
if report.get("peer") is not None:
    display(Markdown(bench.peer_table(report)))

# %% tags=["remove-cell"]
glue("blas_used", blas.describe(), display=False)
glue("real_vocab", f"{qmtp.QWEN36_35B_A3B.vocab_size:,}", display=False)
glue("real_hidden", f"{qmtp.QWEN36_35B_A3B.hidden_size:,}", display=False)
glue("real_experts", qmtp.QWEN36_35B_A3B.num_experts, display=False)
if FULL:
    versus = bench.not_compared()
    print("mlx-lm is not loaded at full size")
glue("qmtp_tps", versus["engines"]["qmtp"]["tokens_per_second"], display=False)
glue("mlx_lm_tps", versus["engines"]["mlx-lm"]["tokens_per_second"], display=False)
glue("qmtp_ratio", versus["ratio"], display=False)
vlm = report.get("peer")
if vlm is not None:
    vlm_best = vlm["best_qmtp_over_best_peer"]
    vlm_same = all(r["same_tokens_as_qmtp"] for r in vlm["results"])
    vlm_line = (
        f"Over the same rounds the best qmtp width ran at {vlm_best:.2f}x the best "
        f"mlx-vlm width ({vlm['engine']}); mlx-vlm's tokens were "
        + ("the same as qmtp's at every width." if vlm_same else "not all the same as "
           "qmtp's: see the table.")
    )
else:
    vlm_best, vlm_line = float("nan"), f"mlx-vlm was not run here ({why_no_peer})."
glue("vlm_line", vlm_line, display=False)

# %% [markdown]
# qmtp decodes {glue:text}`qmtp_tps:.0f` tokens/s against mlx-lm's {glue:text}`mlx_lm_tps:.0f`
# (ratio {glue:text}`qmtp_ratio:.2f`), with the same greedy tokens. {glue:text}`vlm_line` qmtp gets there by
# running a whole decode or verify step as one compiled function of the state it carries (`mx.compile` over
# `qmtp.decoding.step`), which fuses its elementwise work and replays it without Python, and by queueing the
# next pass before reading the current token. At the tiny widths a pass costs what it dispatches, so this is
# where an engine's own overheads show.
#
# ## At the real widths: qmtp and mlx-lm
#
# The same comparison on four layers at the real widths, with all {glue:text}`real_experts` experts and the vocabulary of {glue:text}`real_vocab`
# (`bench.real_width_model`, as in {doc}`06_throughput`), decoded by qmtp and by mlx-lm's own model code
# holding the same arrays, quantized the same way (`bench.mlx_lm_twin`). With `QMTP_MODEL` at the full-size
# release the comparison is not run (mlx-lm would hold a second whole model).

# %%
if not FULL:
    real = bench.real_width_model()
    wide = bench.decode(real, [prompts[0]], max_tokens=3 if QUICK else 4, repeats=2,
                        reference=bench.mlx_lm_twin(real))
    assert wide["same_tokens"]
    lm_head = bench.lm_head_seconds(real)
    del real  # 5 GB
    print(bench.decode_table(wide))
    print(lm_head)

# %% tags=["remove-cell"]
if FULL:
    wide = bench.not_compared()
    lm_head = {"split": float("nan"), "whole": float("nan"), "blocks": 1}
    print("not run at full size")
glue("wide_qmtp", wide["engines"]["qmtp"]["tokens_per_second"], display=False)
glue("wide_mlx_lm", wide["engines"]["mlx-lm"]["tokens_per_second"], display=False)
glue("wide_ratio", wide["ratio"], display=False)
glue(
    "wide_verdict",
    "the same speed within a tenth" if abs(wide["ratio"] - 1) <= 0.1 else f"a ratio of {wide['ratio']:.2f}",
    display=False,
)
# per token, how far apart the engines are, and how much of that the split lm_head saves
gap_ms = (1 / wide["engines"]["mlx-lm"]["tokens_per_second"] - 1 / wide["engines"]["qmtp"]["tokens_per_second"]) * 1e3
saved_ms = (lm_head["whole"] - lm_head["split"]) * 1e3
glue("wide_gap_ms", gap_ms, display=False)
glue("lm_whole_ms", lm_head["whole"] * 1e3, display=False)
glue("lm_split_ms", lm_head["split"] * 1e3, display=False)
glue("lm_blocks", lm_head["blocks"], display=False)
gap_reading = peer.real_width_gap(wide["engines"]["qmtp"]["tokens_per_second"],
                                 wide["engines"]["mlx-lm"]["tokens_per_second"],
                                 lm_head["whole"] * 1e3, lm_head["split"] * 1e3, lm_head["blocks"])
glue("gap_reading", gap_reading, display=False)

# %% [markdown]
# At the real widths qmtp decodes {glue:text}`wide_qmtp:.2f` tokens/s and mlx-lm
# {glue:text}`wide_mlx_lm:.2f`, {glue:text}`wide_verdict`, with the same tokens: {glue:text}`wide_gap_ms:.0f` ms a
# token apart. Both engines spend most of their time in the same MLX kernel, the CPU's quantized matrix product,
# whose cost on this machine {doc}`06_throughput` measured; they differ in how they call it. qmtp's one addition
# there is `qmtp.cores`: lm_head, {glue:text}`real_vocab` rows of {glue:text}`real_hidden` weights and one such
# product per token, cut into blocks of rows computed on separate CPU streams, so on separate cores, with exactly
# the same logits (`QMTP_CORES=1` turns it off). Timed alone in this run (`bench.lm_head_seconds`), lm_head takes
# {glue:text}`lm_whole_ms:.0f` ms whole, as mlx-lm runs it, and {glue:text}`lm_split_ms:.0f` ms in
# {glue:text}`lm_blocks` blocks, as qmtp runs it: {glue:text}`gap_reading`.

# %% tags=["remove-cell"]
saved = results.save(
    "07_engine",
    path,
    {
        "plain_tokens_per_second": by_n[1]["tokens_per_second"],
        "step_ms": {str(n): v for n, v in step_ms.items()},
        "outside_passes": {str(n): v for n, v in outside.items()},
        "auto_over_best_fixed": auto["over_best_fixed"],
        "auto_over_plain": auto["speedup_vs_plain"],
        "ablation": report["ablation"],
        "qmtp_over_mlx_lm": versus["ratio"],
        "qmtp_over_mlx_vlm_best": vlm_best,
        "real_width_qmtp_over_mlx_lm": wide["ratio"],
        "real_width_lm_head_ms": {"whole": lm_head["whole"] * 1e3, "split": lm_head["split"] * 1e3,
                                  "blocks": lm_head["blocks"]},
        "real_width_tokens_per_second": {
            name: e["tokens_per_second"] for name, e in wide["engines"].items()
        },
        "blas": blas.describe(),
        "machine": machine.describe(),
    },
)

# %% [markdown]
# ## Exercises
#
# 1. Run `python -m qmtp bench mtp` in a terminal, then `QMTP_BLAS=bundled python -m qmtp bench mtp`.
#
#    *Where the answer shows:* the first line of each table names the BLAS; compare the "verify ms" column
#    for `n_draft` 1 and 5, and the "vs plain" column.
#
# 2. Set `QMTP_CORES=1` and rerun `python -m qmtp bench decode`.
#
#    *Where the answer shows:* the qmtp row of *qmtp against mlx-lm*; on the tiny model lm_head is not split,
#    so the number should not move.
#
# 3. Decode eagerly: `qmtp.generate(model, prompts[0], max_tokens=32, n_draft=4, engine=qmtp.Engine(compiled=False))`, and
#    compare `.stats.tokens_per_second` with the same call without `compiled=False`.
#
#    *Where the answer shows:* the "eager (not compiled)" row of *What the lean loop buys*.
