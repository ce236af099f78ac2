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
# # 11. MTP under load
#
# Every chapter so far decoded one sequence. A server answering several clients, or an agent asking several
# questions at once, decodes them together: B rows in one pass. The MLX engines that run this model switch MTP
# off when they do. This chapter asks whether drafting still pays as the batch grows, on this model: the
# expert-union cost model of {doc}`08_claims` extended to B rows of n_draft tokens, beside a batch measured here
# at 1, 2, 4 and 8 rows with drafting off and on, and what others published. It ends with the model behind an
# OpenAI-compatible server, called with the official client.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - how many of the 256 experts a pass over B rows of n_draft tokens reads, and when it reads them all;
# - what the calibrated cost model predicts for drafting at batch 1 to 128 on the machines others measured;
# - what a batch of 1 to 8 rows gives here with drafting off and on, and each row's acceptance;
# - how to start `python -m qmtp serve` and call it with the `openai` client.
#
# **What runs here.** `qmtp.generate_batch` on the bundled tiny model (256 experts, top-8, like the real one;
# hidden size 64), interleaved round by round (`qmtp.book.bench_batch`); arithmetic over the released config
# and the published figures (`qmtp.book.under_load`); `qmtp serve`'s app started in this process on a free port,
# with a few short requests. The chapter always uses the bundled model, whatever `QMTP_MODEL` says. Its run
# time in this build is in the {doc}`execution table <../book/execution>`.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
import qmtp.sizes
from qmtp.book import bench_batch, cost_model, inventory, plots, published, under_load
from qmtp.config import QWEN36_35B_A3B as REAL
from qmtp.loading import BUNDLED_MODEL

path = BUNDLED_MODEL
print(inventory.describe(path))
model = qmtp.load(path)

# %% [markdown]
# ## The union of experts, B rows at a time
#
# A verify pass over n tokens reads every weight of the trunk once, and of each layer's 256 routed experts
# only those its tokens chose. B rows of n_draft tokens each are B x n_draft tokens routed together, so the
# pass reads the union of up to 8 x B x n_draft experts. If every token chose its 8 independently and
# uniformly, an expert is missed by all of them with probability (1 - 8/256)^(B n), and the pass reads
#
# $$U(B, n) = 256\,\bigl(1 - (1 - 8/256)^{B n}\bigr)$$
#
# experts per layer on average (`under_load.experts_read`). Real routing is correlated between the neighbouring
# tokens of one row ({doc}`06_throughput` measures it), so a row's drafts add fewer; different rows are
# different texts, closer to independent.

# %%
[round(under_load.experts_read(batch, 1), 1) for batch in (1, 2, 4, 8, 16, 32, 64, 128)]

# %% tags=["remove-cell"]
glue("union_8_3", under_load.experts_read(8, 3), display=False)
glue("union_8_1", under_load.experts_read(8, 1), display=False)
glue("saturated_batch", next(b for b in range(1, 4096) if under_load.experts_read(b, 1) >= 0.99 * REAL.num_experts),
     display=False)

# %% mystnb={"figure": {"caption": "Experts one verify pass reads per layer against the tokens it holds, B rows of n_draft tokens (log scale): the expected union under uniform routing (blue) and the 8 per token it would be with no overlap (grey). The dots are the batches measured below, plain and at n_draft 3: 8 rows at n_draft 3 already read {glue:text}`union_8_3:.0f` of 256.", "name": "fig-union-batch"}}
fig = under_load.union_figure(REAL)

# %% [markdown]
# A plain batch of 8 reads {glue:text}`union_8_1:.0f` experts a layer; the same batch drafting 2 tokens per row
# reads {glue:text}`union_8_3:.0f`. Past about {glue:text}`saturated_batch` plain rows a pass reads 99% of the
# experts whatever it drafts: from there on a drafted token adds no bytes at all.
#
# ## What the cost model predicts
#
# {doc}`08_claims` calibrates each machine that published a plain figure by it: its bandwidth, and an
# `overhead`, the time of a plain pass beyond its bytes; `c`, the share of that overhead one more draft position
# adds, and the acceptance are fitted on the published single-stream MTP runs (`qmtp.book.cost_model`). For B
# rows (`under_load.step_seconds`) the bytes are the weights and the union of experts once per pass, and each
# row's KV cache and linear-attention state; a step yields B x tau(n) tokens. What no single-stream run says is
# what one more *row* adds to the overhead, so the model is run two ways:
#
# - **per token**: every token of the pass pays `c`, a row's as a draft's (at B = 1, exactly the cost model of
#   {doc}`08_claims`);
# - **per row**: a row pays `r`, taken from the one published plain batch of this model on a machine the cost
#   model calibrates (vllm-mlx, 8 requests on an M3 Ultra; `under_load.fit_row_share`).

# %%
c, fit = cost_model.fitted_without(None)
r = under_load.fit_row_share()
m3_ultra = under_load.machine("vllm_mlx_m3_ultra")
{"c": round(c, 3), "r": round(r, 3), "tau at n_draft 2": round(fit.tokens_per_pass(2), 2),
 "plain batch of 8, per token": round(under_load.aggregate_tps(m3_ultra, 8, 1)),
 "plain batch of 8, per row": round(under_load.aggregate_tps(m3_ultra, 8, 1, r))}

# %% [markdown]
# The table is the M3 Ultra's (vllm-mlx's plain figure of {glue:text}`m3_plain:.1f` tok/s calibrates it): the
# experts a plain pass and a pass at n_draft 3 read, then under each reading the plain batch's aggregate
# tokens/s, the best n_draft and its gain over plain decoding at the same batch.

# %% tags=["remove-cell"]
glue("m3_plain", m3_ultra.plain_tps, display=False)
glue("c", c, display=False)
glue("r", r, display=False)

# %%
model_rows = under_load.model_rows("vllm_mlx_m3_ultra")
Markdown(under_load.model_table(model_rows))

# %% [markdown]
# "experts": a plain pass / a pass at n_draft 3; "token" and "row": the two readings.

# %% [markdown]
# ## Measured here: batches of 1 to 8 on the tiny model
#
# The same B prompts of different lengths decode together (`qmtp.generate_batch`, greedy, every row its
# `max_tokens`), at n_draft 1 (plain), 2 and 3, interleaved round by round with the same prompts run one after
# another by `qmtp.generate` ("one by one"); each cell keeps its median over the rounds
# (`qmtp.book.bench_batch.run`, what `python -m qmtp bench batch` prints). In the same rounds mlx-vlm decodes the
# same prompts at n_draft 3 (below). Tokens/s are aggregate over the batch; under each drafting width, each
# row's acceptance (lowest to highest).

# %%
report = bench_batch.run(model, batches=(1, 2, 4, 8), n_drafts=(1, 2, 3), max_tokens=32, rounds=3,
                         peers=["mlx-vlm"], peer_n_drafts=[3])
measured = under_load.measured_rows(report)
Markdown(under_load.measured_table(measured))

# %% tags=["remove-cell"]
answer = under_load.answer(report)
gains = answer["measured_gains"]
sizes = sorted(gains)
glue("gain_first", gains[sizes[0]][1], display=False)
glue("gain_last", gains[sizes[-1]][1], display=False)
glue("width_first", gains[sizes[0]][0], display=False)
glue("width_last", gains[sizes[-1]][0], display=False)
glue("last_batch", sizes[-1], display=False)
glue("plain_over_singles", report["goals"]["plain_batch_over_singles"]["ratio"], display=False)
paying = answer["measured_paying"]
glue("measured_pays",
     "drafting paid at every batch measured" if paying == sizes else
     "drafting paid at no batch measured" if not paying else
     f"drafting paid up to {max(paying)} rows and not beyond" if paying == sizes[:len(paying)] else
     f"drafting paid at {', '.join(map(str, paying))} rows only",
     display=False)
same = all(
    cell["acceptance"] == next(x for x in report["rows"] if x["engine"] == "batch" and x["n_draft"] == cell["n_draft"]
                               and x["batch"] == max(sizes))["acceptance"][:len(cell["acceptance"])]
    for cell in report["rows"] if cell["engine"] == "batch" and cell["n_draft"] != "1")
glue("measured_trend",
     f"the gain falls as rows are added, from {gains[sizes[0]][1]:.2f}x at one row to {gains[sizes[-1]][1]:.2f}x at "
     f"{sizes[-1]}, as the per-token reading predicts" if gains[sizes[-1]][1] < gains[sizes[0]][1] - 0.05 else
     f"the gain does not fall clearly as rows are added ({gains[sizes[0]][1]:.2f}x at one row, "
     f"{gains[sizes[-1]][1]:.2f}x at {sizes[-1]})", display=False)
glue("acceptance_same",
     "Each row's acceptance is the same at every batch size: a row drafts and verifies exactly as it would alone"
     if same else "Rows' acceptance differs between batch sizes", display=False)

# %% [markdown]
# Plain decoding of 4 rows together gives {glue:text}`plain_over_singles:.2f`x the tokens/s of the same 4 one after
# another. At one row the best drafting width (n_draft {glue:text}`width_first`) gives
# {glue:text}`gain_first:.2f`x plain decoding's tokens/s; at {glue:text}`last_batch` rows n_draft
# {glue:text}`width_last` gives {glue:text}`gain_last:.2f`x: {glue:text}`measured_pays`.
# {glue:text}`acceptance_same`. On this model a pass moves a few megabytes: its time is dispatch and the
# per-token arithmetic, not bandwidth, the regime the per-token reading describes once the union of the real
# model is full.

# %% [markdown]
# ### Beside mlx-vlm's batched drafting
#
# mlx-vlm (the `peer` extra, as in {doc}`07_engine`) decodes a batch with MTP drafts too: its `BatchGenerator`
# with `draft_kind="mtp"` loads the same file, trunk and head. It ran in the rounds above at n_draft 3 (it has no
# auto width; its plain batch and the other widths are left to `python -m qmtp bench batch`, to keep this chapter
# short), every row's tokens compared with qmtp's greedy batch. Its Qwen3.5/3.6
# model asks for uniform acceptance (`requires_uniform_batch_acceptance`: its batch cache keeps one length for
# all rows), so in each round every row keeps as many drafts as the row that accepted fewest; qmtp's rows
# accept each their own. Aggregate tokens/s, qmtp's first; in brackets each row's acceptance.

# %%
Markdown(under_load.peer_table(report))

# %% tags=["remove-cell"]
glue("peer_sentences", under_load.peer_sentences(report), display=False)

# %% [markdown]
# {glue:text}`peer_sentences`

# %% [markdown]
# ### A long prompt joining running rows
#
# A request joins the batch at a step boundary. Its prompt can be read in chunks of its own between the rows'
# steps, each sized to take about 0.8 of a step (`qmtp.continuous`, fitted on the chunks' measured times), so
# the rows wait for the chunk as well as for their own step; or as one more row of the rows' own pass, reading
# as many of its tokens a step as the step is wide, its drafts replaced by the prompt's next tokens and all of
# them kept. The batch chooses (`join="auto"`): a row when a chunk within its budget would read fewer than 4
# times the step's width, since a chunk's fixed cost then eats the budget. Here 4 rows decode, then a
# 2,000-token prompt joins; every step is timed until the new row's first token (`bench_batch.join_stall`),
# at n_draft 1 and 3, each way in turn.

# %%
stalls = [bench_batch.join_stall(model, rows=4, prompt_tokens=2000, n_draft=n, join=join)
          for n in (1, 3) for join in ("chunks", "auto")]
Markdown(under_load.join_table(stalls))

# %% tags=["remove-cell"]
chunk_plain, row_plain, chunk_draft, row_draft = stalls
for name, run in (("chunk_plain", chunk_plain), ("row_plain", row_plain), ("chunk_draft", chunk_draft),
                  ("row_draft", row_draft)):
    glue(f"{name}_median", run["median_while_joining"] / run["step_seconds"], display=False)
    glue(f"{name}_p90", run["p90_over_step"], display=False)
    glue(f"{name}_longest", run["longest_over_step"], display=False)
    glue(f"{name}_prefill", run["prefill_seconds"], display=False)
smallest = chunk_plain["smallest_chunk_tokens"]
glue("stall_smallest_tokens", f"{smallest} token{'' if smallest == 1 else 's'}", display=False)
glue("stall_smallest_over_step", chunk_plain["smallest_chunk_seconds"] / chunk_plain["step_seconds"], display=False)
glue("row_mode_chosen", "read as a row at both widths" if row_plain["steps_as_a_row"] and row_draft["steps_as_a_row"]
     else "not read as a row at every width", display=False)
glue("row_goal", under_load.join_verdict([row_plain, row_draft]), display=False)

# %% [markdown]
# The goal was at most twice the step between a running row's tokens. In chunks the median step while the
# prompt joined took {glue:text}`chunk_plain_median:.2f`x the rows' step alone at n_draft 1 and
# {glue:text}`chunk_draft_median:.2f`x at n_draft 3, the 90th percentile {glue:text}`chunk_plain_p90:.2f`x and
# {glue:text}`chunk_draft_p90:.2f`x. The cause is a chunk's fixed cost: it is a pass of its own over every
# layer, and the smallest the batch ran ({glue:text}`stall_smallest_tokens`) took
# {glue:text}`stall_smallest_over_step:.2f`x the 4 rows' plain step, whatever its tokens. With the choice left to
# the batch, the prompt was {glue:text}`row_mode_chosen`: the median {glue:text}`row_plain_median:.2f`x and
# {glue:text}`row_draft_median:.2f`x, the 90th percentile {glue:text}`row_plain_p90:.2f`x and
# {glue:text}`row_draft_p90:.2f`x, so the goal is {glue:text}`row_goal`. A fifth row costs the pass little, but
# not nothing: the rows' buffers grow with the prompt as it is read (attention reads the whole buffer), and the
# longest steps are the few where the step is compiled again (a new row, a longer buffer). The price is paid
# by the joining request: its prompt is read a step's width at a time, {glue:text}`row_plain_prefill:.1f` s
# and {glue:text}`row_draft_prefill:.1f` s to its first token against {glue:text}`chunk_plain_prefill:.1f` s
# and {glue:text}`chunk_draft_prefill:.1f` s in chunks. On a machine where a chunk of hundreds of tokens costs
# about a step (a GPU, a larger model), the chunks' fixed cost is a small share and the batch keeps to
# chunks.

# %% mystnb={"figure": {"caption": "The best drafting width's aggregate tokens/s over plain decoding at the same batch. Lines: the cost model on four machines calibrated by their published plain figures, every token paying c (solid), and the M3 Ultra with a row paying r (dashed). Black squares: measured here on the tiny model. Above 1, drafting pays.", "name": "fig-gain-batch"}}
fig = under_load.gain_figure(report)

# %% [markdown]
# ## At the real widths
#
# The tiny model's passes move a few megabytes, and its union of experts fills at once. A batched pass at the
# real widths is measured outside the build (`python -m qmtp bench batch --real-width`, minutes): the real
# model's first 4 layers (3 DeltaNet, 1 attention) with their 256 experts, top-8, 4-bit, built in memory
# (`bench.real_width_model`), each token routed by its own embedding, so tokens choose experts independently,
# as U(B, n) assumes. For each B and n_draft, B rows 64 tokens in take one pass of n tokens each: the 4 layers
# timed compiled (lm_head apart, once for one token), and the experts each layer read counted from the routers'
# choices. The report, saved in `book/measured/`, ran on {glue:text}`rw_where`, {glue:text}`rw_when`.

# %%
real_width = under_load.saved("real width")
Markdown(under_load.real_width_rows_table(real_width))

# %% tags=["remove-cell"]
rw = {(x["batch"], x["n_draft"]): x for x in real_width["rows"]}
glue("rw_where", real_width["where"], display=False)
glue("rw_when", real_width["when"], display=False)
for b, n in ((8, 1), (1, 5), (8, 5)):
    glue(f"rw_{b}_{n}", rw[(b, n)]["time_over_one_token"], display=False)
    glue(f"rw_experts_{b}_{n}", rw[(b, n)]["experts_read"], display=False)
glue("rw_lm_head_ms", real_width["lm_head_one_token_seconds"] * 1e3, display=False)
glue("rw_lm_head_over", real_width["lm_head_one_token_seconds"] / rw[(1, 1)]["seconds"], display=False)
per_token = rw[(8, 5)]["time_over_one_token"] / rw[(8, 5)]["tokens"]
union_growth = rw[(8, 5)]["experts_read"] / rw[(1, 1)]["experts_read"]
glue("rw_verdict",
     f"A pass's time grew nearly in proportion to its tokens ({per_token:.2f} of a one-token pass per token at 40 "
     f"tokens), far faster than the experts it read ({union_growth:.0f}x those of one token): on this CPU a "
     "drafted token costs its own compute, the per-token reading's regime" if per_token > 0.5 else
     f"A pass's time grew much more slowly than its tokens ({per_token:.2f} of a one-token pass per token at 40 "
     f"tokens), closer to the experts it read ({union_growth:.0f}x those of one token): a drafted token is cheap "
     "while the union is unfilled", display=False)

# %% [markdown]
# 8 rows of one token took {glue:text}`rw_8_1:.2f`x the time of one token's pass and read
# {glue:text}`rw_experts_8_1:.0f` experts a layer; one row at n_draft 5, {glue:text}`rw_1_5:.2f`x, reading
# {glue:text}`rw_experts_1_5:.0f`; 8 rows at n_draft 5 (40 tokens), {glue:text}`rw_8_5:.2f`x, reading
# {glue:text}`rw_experts_8_5:.0f` of 256. {glue:text}`rw_verdict`. The counted union stays below U(B, n), which
# takes every expert as equally likely: these routers, random weights over random embeddings, are not uniform, so
# tokens share more experts than U(B, n) counts (the real model's trained routers are not uniform either). lm_head alone
# took {glue:text}`rw_lm_head_ms:.0f` ms for one token at the real vocabulary, {glue:text}`rw_lm_head_over:.1f`x
# these 4 layers' one-token pass (the real model has 40).

# %% [markdown]
# ### Memory per row at full size
#
# A row holds its own decoding state: the KV buffers of the 10 attention layers and the head's (as long as the
# positions the batch's longest row has reached, rounded up to a power of two: they grow as rows decode), the
# 30 DeltaNet layers' state (conv inputs and the recurrent S, in float32), and, during a verify pass of n tokens, one
# snapshot of that state per position, so the roll back can keep the last accepted one (`qmtp.book.under_load.row_memory`).
# Beside the 4-bit model (head in bf16) and a runtime assumed at {glue:text}`runtime_gb:.0f` GB, with
# {glue:text}`os_share:.0f`% of the machine left to the operating system (both assumptions, named in `qmtp.book.under_load`),
# the largest batch per machine size:

# %%
Markdown(under_load.batch_fits_table(REAL, contexts=(4096, 32768), n_drafts=(1, 5), machines_gb=(24, 64, 128)))

# %% tags=["remove-cell"]
glue("runtime_gb", under_load.RUNTIME_BYTES / 1e9, display=False)
glue("os_share", under_load.OS_SHARE * 100, display=False)
row_plain, row_five = (under_load.row_memory(REAL, 4096, n) for n in (1, 5))
glue("row_plain_mb", row_plain.total_bytes / 1e6, display=False)
glue("row_five_mb", row_five.total_bytes / 1e6, display=False)
glue("snapshot_share", row_five.snapshot_bytes / row_five.total_bytes * 100, display=False)
glue("weights_gb", qmtp.sizes.sizes(REAL, bits=4).total_bytes / 1e9, display=False)
glue("rows_64_plain", under_load.largest_batch(REAL, 64e9, 4096, 1), display=False)
glue("rows_64_five", under_load.largest_batch(REAL, 64e9, 4096, 5), display=False)

# %% [markdown]
# At 4,096 positions a plain row holds {glue:text}`row_plain_mb:.0f` MB and a row at n_draft 5
# {glue:text}`row_five_mb:.0f` MB, {glue:text}`snapshot_share:.0f`% of it the snapshots: drafting wide costs memory
# per row as well as compute, so 64 GB holds {glue:text}`rows_64_plain` plain rows or {glue:text}`rows_64_five` at
# n_draft 5. A 24 GB machine holds none: the {glue:text}`weights_gb:.1f` GB of weights and the runtime already pass
# what the operating system leaves.

# %% [markdown]
# ## What the field reports
#
# Published figures of MTP with several requests at once (`qmtp.book.published.UNDER_LOAD`; "as reported":
# not read at the source when the row was written, taken from the project's notes). None of them measures this
# model's MoE batched with drafting on a machine the cost model calibrates: vllm-mlx, the one that runs the
# 35B-A3B on a named machine, switches MTP off for more than one request {cite:p}`vllmmlx245`, as mlx-lm's MTP
# pull request does in its server {cite:p}`mlxlm990`. llama.cpp keeps drafting in each of its slots: four slots
# with MTP gave 1.97x one slot's throughput {cite:p}`unsloth8172`. oMLX reports batched depth-1 drafting
# keeping about 56% acceptance against 61% alone {cite:p}`omlx3265`, while its row-wise batched drafting ran
# below plain batching {cite:p}`omlx3569`; vLLM's own path for hybrid models had fallen below plain decoding at
# serving batch sizes until ReplaySSM replayed the linear layers' inputs instead of keeping a state per draft
# {cite:p}`vllm49232`.

# %%
Markdown(under_load.field_table(under_load.field_rows()))

# %% tags=["remove-cell"]
published_8 = next(x for x in published.UNDER_LOAD if x.key == under_load.PLAIN_BATCH).tps["plain"]
glue("published_8", published_8, display=False)
glue("model_8_token", answer["plain_8_model"], display=False)
glue("token_error", answer["plain_8_model"] / published_8 - 1, display=False)
glue("break_even_m3", answer["break_even_m3"] or "none up to 512", display=False)
glue("break_even_low", answer["break_even_low"] or "none", display=False)
glue("break_even_high", answer["break_even_high"] or "none", display=False)
glue("limit_token", answer["limit_token"], display=False)
glue("limit_row", answer["limit_row"], display=False)
glue("tau2", answer["tau2"], display=False)
glue("row_reading",
     "under the per-row reading drafting never stops paying up to 512 rows on the M3 Ultra"
     if answer["break_even_m3_row"] is None else
     f"under the per-row reading it stops paying at {answer['break_even_m3_row']} rows on the M3 Ultra",
     display=False)

# %% [markdown]
# ## When drafting still pays
#
# The answer turns on what one more token costs once the union is full. Drafting spends a pass's tokens on
# guesses: at n_draft 2 a step yields {glue:text}`tau2:.2f` tokens for 2 in the pass. At B = 1 the second token
# is nearly free in bytes (it adds a few of the 256 experts), which is why MTP pays a little on this MoE. As B
# grows the plain batch's own rows fill the union, and past a few dozen rows every pass reads all 256 experts
# whatever it drafts. From there a drafted token's marginal cost is its compute and dispatch, not bandwidth:
#
# - if each token of the pass costs `c` of a plain pass's overhead (the per-token reading, {glue:text}`c:.2f`),
#   the gain tends to tau(2)/2 = {glue:text}`limit_token:.2f`x, and drafting stops paying at
#   {glue:text}`break_even_m3` rows on the M3 Ultra ({glue:text}`break_even_low` to
#   {glue:text}`break_even_high` rows over the four machines of the figure);
# - if a row costs only `r` = {glue:text}`r:.2f` of it (what vllm-mlx's plain batch of 8 implies), the pass's
#   overhead stays shared, the gain tends to tau(2)/(1 + c) = {glue:text}`limit_row:.2f`x at n_draft 2 and more
#   at wider widths, and {glue:text}`row_reading`.
#
# The per-token reading prices vllm-mlx's plain batch of 8 at {glue:text}`model_8_token:.0f` tok/s against the
# {glue:text}`published_8:.1f` published ({glue:text}`token_error:+.0%`): on that engine a row costs much less
# than a draft, so for it the per-row reading is the better guide, and it says MTP could have stayed on. On
# the tiny model measured here {glue:text}`measured_trend`. So on this model,
# drafting pays under load where the batch leaves the union of experts unfilled (a few rows) or where the
# engine's cost per extra row stays far below its cost per extra draft position; where each extra token costs
# its own compute, as on a CPU or in a compute-bound server, turn drafting off above a handful of rows, or let
# `n_draft="auto"` measure it (the continuous batch chooses one width per step from the batch's own costs).

# %% [markdown]
# ## Serving it
#
# `qmtp serve` puts the model behind an OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`,
# `/v1/models`, `/health`), drafting with its head (`--n-draft`, `auto` by default with a head: the width of
# each step chosen from the batch's own measured costs, plain included; a request's own `n_draft` overrides it).
# It binds 127.0.0.1 unless told otherwise and needs the `serve` extra (`pip install -e .[serve]`):
#
# ```bash
# python -m qmtp serve --port 8000                      # the bundled model; or a checkpoint folder first
# python -m qmtp serve path/to/checkpoint --n-draft 3 --max-batch 8 --api-key secret
# ```
#
# Any OpenAI client then talks to it. Here the same app runs in this process on a free port
# (`under_load.serving`, uvicorn in a thread), and one chat completion at temperature 0, thinking off, comes
# back exactly as greedy `qmtp.generate` gives it over the same messages: a field the request leaves out takes
# vLLM's default (temperature, top_p, top_k, min_p and repetition_penalty from the model's
# `generation_config.json`, the presence and frequency penalties 0), so the card's presence penalty, which
# `sampling="model"` would apply, is not; the cell checks it.

# %%
import openai

messages = [{"role": "user", "content": "Tell me a story about a dog."}]
no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
with under_load.serving(model) as base_url:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    served_model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=served_model, messages=messages, temperature=0,
                                           max_tokens=24, extra_body=no_thinking)
    load = under_load.load_rounds(base_url, served_model, clients=(1, 4), n_drafts=(1, 3, "auto"),
                                  max_tokens=8)
direct = qmtp.generate(model, messages=messages, max_tokens=24, temperature=0, n_draft=3,
                       enable_thinking=False)
assert reply.choices[0].message.content == direct.text
print(reply.choices[0].message.content)

# %% [markdown]
# Four clients at once against one, each asking for 8 tokens, at the request's n_draft 1, 3 and auto (the official
# client, temperature 0; `under_load.load_rounds`). "vs one" is the round's wall time over the one-client
# round's: 4 requests served one after another would take about 4x.

# %%
Markdown(under_load.load_table(load))

# %% tags=["remove-cell"]
from qmtp.serve.main import engine_class  # noqa: E402

glue("engine_name", engine_class().__name__, display=False)
four = [x for x in load if x["clients"] == 4]
glue("four_vs_one", max(x["wall s"] / next(y for y in load if y["n_draft"] == x["n_draft"] and y["clients"] == 1)
                        ["wall s"] for x in four), display=False)

# %% [markdown]
# The server's engine is {glue:text}`engine_name` (`qmtp.serve.main.engine_class`): concurrent requests share its
# decoding steps, so 4 clients took {glue:text}`four_vs_one:.2f`x the wall time of one.
#
# ### The server under load, beside mlx_lm.server
#
# A longer load run is too slow for the build: `python -m qmtp bench serve --clients 1,4,16` starts each server
# as its own process on a free port and streams 64 new tokens per request at temperature 0 from 1, 4 and 16
# clients at once, `qmtp serve` at n_draft 1 and 3 and `mlx_lm.server` on the same bundled model (a float32
# copy: MLX's CPU kernels for a bfloat16 mixture of experts compute in float32, and mlx_lm.server serves the
# model plain, as it serves this family). All three servers run at once, each client count goes to each of
# them in turn, the order reversed from round to round, and every cell is the median of
# {glue:text}`serve_repeats` rounds (`--repeats`).
# Its report, saved in `book/measured/`, ran on
# {glue:text}`serve_where`, {glue:text}`serve_when`. mlx_lm.server ends a request at the end token (it has no
# option to ignore it), so its tokens per request fall below 64.

# %%
serve_run = under_load.saved("serve")
Markdown(under_load.serve_rows_table(serve_run))

# %% tags=["remove-cell"]
at_16, at_4, at_1 = (under_load.serve_summary(serve_run, clients) for clients in (16, 4, 1))
glue("serve_where", serve_run["where"], display=False)
glue("serve_when", serve_run["when"], display=False)
glue("serve_repeats", serve_run.get("repeats", 1), display=False)
glue("serve_best_16", at_16["best"], display=False)
glue("serve_over_mlx_lm_16", at_16["best_over_mlx_lm"], display=False)
glue("serve_draft_1", at_1["aggregate"]["qmtp serve, n_draft 3"] / at_1["aggregate"]["qmtp serve, n_draft 1"],
     display=False)
glue("serve_draft_4", at_4["aggregate"]["qmtp serve, n_draft 3"] / at_4["aggregate"]["qmtp serve, n_draft 1"],
     display=False)
glue("serve_draft_16", at_16["aggregate"]["qmtp serve, n_draft 3"] / at_16["aggregate"]["qmtp serve, n_draft 1"],
     display=False)

# %% [markdown]
# At 16 clients the fastest in aggregate was {glue:text}`serve_best_16`, at {glue:text}`serve_over_mlx_lm_16:.2f`x
# mlx_lm.server's tokens/s (which counts fewer tokens per request, each request ending at its end token). Drafting
# at n_draft 3 gave {glue:text}`serve_draft_1:.2f`x the aggregate of n_draft 1 at one client,
# {glue:text}`serve_draft_4:.2f`x at 4 and {glue:text}`serve_draft_16:.2f`x at 16: on this CPU, as in the batches
# above, a drafted token costs its own compute once rows share the pass.
