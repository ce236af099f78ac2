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
#
# %% [markdown]
# # 9. Beyond one machine
#
# The 35B-A3B at 4 bits, its head in bf16 as this book converts it, weighs about
# {glue:text}`q4_whole_gb:.0f` GB: more than a 16 GB laptop holds. Its routed experts are almost
# all of it, and a token reads only k of the E experts of each layer. So the experts can be spread over
# several machines: with N ranks, rank r holds experts r E/N to (r+1) E/N - 1 of every MoE layer, trunk and
# head, and everything else whole (`qmtp.parallel`). Each rank computes the chosen experts it holds, one
# `all_sum` per MoE layer gathers every chosen expert's output, and each rank then weights and adds them in
# the single process's order, so the tokens are exactly one process's. This chapter shows what each rank
# holds, runs that check live on two ranks, measures the memory split and the cost of an `all_sum` on this
# machine, and asks the cost model of {doc}`06_throughput` what N machines would give, and whether spreading
# the experts makes MTP pay.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - what each of N ranks holds, and the fewest machines of a given memory that hold the 35B-A3B;
# - that two ranks decode exactly the tokens of one process, greedy and sampled, with and without drafts;
# - what one rank's memory is against one process's, and what an `all_sum` per layer costs here;
# - what the cost model predicts for 1 to 8 machines over links whose latency others published.
#
# **What runs here.** The bundled tiny model on two ranks of MLX's ring backend on this host, started by
# `mlx.launch` from this notebook (`qmtp.book.beyond.run_live`, bounded by a timeout), and once more in a
# process of its own; the sizes and predictions are arithmetic over the released config. The chapter always
# uses the bundled model, whatever `QMTP_MODEL` says: the check holds two copies of the model on one host.
# Its run time in this build is in the {doc}`execution table <../book/execution>`.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
from qmtp import sizes
from qmtp.book import beyond, budget, inventory, plots, published, throughput
from qmtp.config import QWEN36_35B_A3B as REAL
from qmtp.loading import BUNDLED_MODEL

path = BUNDLED_MODEL
print(inventory.describe(path))
table = inventory.markdown_table

# %% [markdown]
# ## What each rank holds
#
# The experts of each MoE layer are split into N contiguous blocks, one per rank; N must divide E (256
# for this model), so N is 1, 2, 4 or 8 here. What every rank keeps whole, the attention and DeltaNet
# mixers, the routers, the shared experts, the embeddings and `lm_head`, does not shrink with N. For the
# released 35B-A3B converted to 4 bits with the head kept in bf16 (as {doc}`03_converting` converts it and
# as every size and prediction of the book assumes), `qmtp.sizes.per_rank_bytes` gives each rank's share:

# %%
q4 = sizes.sizes(REAL, 4, mtp_bits=throughput.HEAD_BITS)  # the head in bf16
layout = beyond.layout_rows(q4, REAL.num_experts)
columns = ["ranks", "experts per rank", "rank 0", "last rank", "per rank"]
display(
    Markdown(
        table(
            layout,
            columns + ["of one process"],
            {"per rank": "{:.2f} GB", "of one process": "{:.2f}"},
        )
    )
)
glue("q4_whole_gb", layout[0]["per rank"], display=False)
glue("q4_two_share", layout[1]["of one process"], display=False)
glue("q4_eight_gb", layout[-1]["per rank"], display=False)
glue("q4_eight_share", layout[-1]["of one process"], display=False)

# %% [markdown]
# At 4 bits one process holds {glue:text}`q4_whole_gb:.1f` GB; each of two ranks holds
# {glue:text}`q4_two_share:.2f` of that, and each of eight {glue:text}`q4_eight_gb:.1f` GB
# ({glue:text}`q4_eight_share:.2f`): the replicated part sets a floor that more ranks do not lower.
#
# ## How many machines hold it
#
# The smallest N whose per-rank share fits a machine's memory, at each width of the trunk, the head in
# bf16 (the bf16 row is the release, nothing quantized). Each cell gives two N: for the weights alone,
# and with the runtime beside each rank's weights, the {glue:text}`runtime_gib:.1f` GiB of Python, MLX and
# activations that {doc}`real_checkpoint` adds (`qmtp.book.budget.fits`, which counts a machine's
# memory in GiB). The KV cache of a long context and the operating system need room beyond that, so a
# machine the second N only just fits may need the next in practice. A dash means no N up to 8 fits.

# %%
machines = (16, 32, 64, 128, 192)
bare = beyond.fit_rows(REAL, machines)
fits = beyond.fit_rows(REAL, machines, runtime=True)
cells = [f"{m} GB" for m in machines]
def both(w, r, c):  # weights only / with the runtime
    return " / ".join("-" if x[c] is None else str(x[c]) for x in (w, r))


shown = [{**w, **{c: both(w, r, c) for c in cells}} for w, r in zip(bare, fits)]
head = ["width", "whole GB", *cells]
display(Markdown(table(shown, head, {"whole GB": "{:.1f}"})))
bf16, q4_row = fits[0], fits[-1]
glue("runtime_gib", budget.RUNTIME_GB, display=False)
glue("bf16_gb", bf16["whole GB"], display=False)
glue("bf16_on_32", bf16["32 GB"], display=False)
glue("q4_on_16_bare", bare[-1]["16 GB"], display=False)
q4_two = sizes.per_rank_bytes(q4, 2)
glue("q4_two_gib", q4_two / 2**30, display=False)
on_16 = q4_row["16 GB"]
glue(
    "q4_on_16",
    f"{on_16} laptops of 16 GB hold it"
    if on_16
    else "no number up to 8 of 16 GB laptops holds it",
    display=False,
)
room = "leaves" if budget.fits(q4_two, 16) else "does not leave"
glue("q4_two_fits", room, display=False)

# %% [markdown]
# With the runtime counted, the bf16 release ({glue:text}`bf16_gb:.0f` GB) needs
# {glue:text}`bf16_on_32` machines of 32 GB, and at 4 bits {glue:text}`q4_on_16`: each of two ranks holds
# {glue:text}`q4_two_gib:.1f` GiB of weights, which {glue:text}`q4_two_fits` room for the runtime's
# {glue:text}`runtime_gib:.1f` GiB in 16 GiB (for the weights alone, {glue:text}`q4_on_16_bare` would do).
#
# The larger members of the family, Qwen3.5-122B-A10B and Qwen3.5-397B-A17B, are not in this table nor
# in the predictions below: every size here is computed from a config's values, and their `config.json`
# files could not be read at their source when this chapter was written. Only third parties' copies of
# some of their values were found, and those copies disagree with one another (on the 397B's
# shared-expert width, for one), so no preset for them is included.
#
# ## The same tokens on two ranks, live
#
# `beyond.run_live` starts two ranks of the bundled model through `mlx.launch` (MLX's ring backend over
# TCP on this host, a free port, a timeout), then the same worker in one process without a group. Each
# rank decodes one prompt greedy and sampled (temperature 0.8, one seed), plain (`n_draft=1`) and with
# two head drafts (`n_draft=3`), and writes its tokens; this notebook decodes the same four generations
# itself and compares them token for token.

# %%
live = beyond.run_live(ranks=2, timeout=120)
model = qmtp.load(path)
reference = beyond.generations(model)
checked = beyond.compare(live, reference)
display(
    Markdown(
        table(
            checked,
            ["n_draft", "sampling", "rank", "tokens", "equal", "first difference"],
        )
    )
)
assert all(r["equal"] for r in checked), "a rank's tokens differ from one process's"
glue("live_s", live["seconds"]["ranks"], display=False)
glue("live_cases", len(checked), display=False)

# %% [markdown]
# All {glue:text}`live_cases` comparisons are equal, token for token (the cell stops the chapter if one is
# not): the two ranks, started and finished in {glue:text}`live_s:.0f` s, decode what one process
# decodes, greedy or sampled, with drafts or without. `tests/test_distributed.py` checks the same for
# every `n_draft` from 1 to 5 and `"auto"`, on the bundled model and its 4-bit conversion, and each MoE
# layer bit for bit.
#
# ## The memory split, measured
#
# Each process of the check recorded the bytes of the weights it holds and its peak resident memory
# (RSS, what the operating system counts for it):

# %%
memory = beyond.memory_rows(live)
display(
    Markdown(
        table(
            memory,
            ["process", "experts held", "weights", "peak RSS"]
            + ["weights / one", "RSS / one"],
            {
                "weights": "{:.1f} MiB",
                "peak RSS": "{:.0f} MiB",
                "weights / one": "{:.2f}",
                "RSS / one": "{:.2f}",
            },
        )
    )
)
rank0 = memory[1]
glue("weights_share", rank0["weights / one"], display=False)
glue("rss_share", rank0["RSS / one"], display=False)
glue("weights_mib", memory[0]["weights"], display=False)
glue("rss_mib", memory[0]["peak RSS"], display=False)
as_loaded = sizes.sizes(  # float32 in memory, nothing quantized: as the ranks hold it
    model.config,
    sizes.UNQUANTIZED,
    mtp_bits=None,
    router_bits=sizes.UNQUANTIZED,
    dtype_bytes=4,
)
share = beyond.layout_rows(as_loaded, model.config.num_experts, ranks=(1, 2))[1]
glue("predicted_share", share["of one process"], display=False)
heavier = rank0["RSS / one"] > 1
glue("rss_verdict", "outweigh" if heavier else "do not outweigh", display=False)

# %% [markdown]
# Each rank holds {glue:text}`weights_share:.4f` of one process's weights, as the arithmetic of
# `per_rank_bytes` says for float32 weights ({glue:text}`predicted_share:.4f`). Its peak RSS is
# {glue:text}`rss_share:.2f` times one process's: the bundled model's weights are
# {glue:text}`weights_mib:.0f` MiB of a {glue:text}`rss_mib:.0f` MiB process, so Python, MLX and the ring
# backend's buffers, which every rank carries whole, {glue:text}`rss_verdict` what the split saves. The
# split pays in memory where the experts dominate the process, as they do at the real widths.
#
# ## An all_sum per layer, and what this machine cannot show
#
# The ranks also timed a chain of `all_sum`s of one token's [1, k, H] expert outputs, one per MoE layer
# as a decode step issues them, and plain decoding once warm:

# %%
rank_0 = live["ranks"][0]
loopback = rank_0["all_sum_per_layer"]["fastest"]
glue("loopback_us", loopback * 1e6, display=False)
glue("loopback_median_us", rank_0["all_sum_per_layer"]["median"] * 1e6, display=False)
glue("ranks_tps", rank_0["plain_tokens_per_second"], display=False)
glue("alone_tps", live["alone"]["plain_tokens_per_second"], display=False)
ratio = rank_0["plain_tokens_per_second"] / live["alone"]["plain_tokens_per_second"]
glue("tps_ratio", ratio, display=False)
median = rank_0["all_sum_per_layer"]["median"]
print(f"all_sum per MoE layer on loopback: fastest chain {loopback * 1e6:.0f} us, "
      f"median {median * 1e6:.0f} us")
print(f"plain decoding: {live['alone']['plain_tokens_per_second']:.0f} tok/s alone, "
      f"{rank_0['plain_tokens_per_second']:.0f} tok/s on two ranks ({ratio:.2f}x)")

# %% [markdown]
# An `all_sum` per layer took {glue:text}`loopback_us:.0f` µs on loopback in the fastest of the chains
# ({glue:text}`loopback_median_us:.0f` µs in the median one: the chains share the cores with everything
# else this machine runs), and plain decoding ran at
# {glue:text}`ranks_tps:.0f` tokens/s on two ranks against {glue:text}`alone_tps:.0f` alone
# ({glue:text}`tps_ratio:.2f` times). That difference is not a network's: the two ranks share this machine's
# two cores and its memory bandwidth, so each waits for the other's turn on the cores at every
# collective, and the tiny model's step is so short that those waits are most of it. This machine can
# show that the ranks are lossless, what each holds, and what a collective costs when its ranks share a
# host. It cannot show what N machines, each reading its own memory, would gain: that needs N machines,
# and below it is a prediction.
#
# ## What N machines would give: the cost model
#
# Section 5 of `qmtp.book.throughput` prices a pass over n tokens on N machines as the busiest rank's
# bytes (everything replicated, plus its share of the union of the pass's experts) over the memory
# bandwidth, plus one `all_sum` per MoE layer. The latency of that `all_sum` is the link's: two figures
# {cite:t}`geerling2025rdma` published for four M3 Ultra Mac Studios. This host's loopback, measured above,
# is listed beside them but not priced: it is two processes on one host, not a link between machines, and
# on a shared machine it swings with the load by more than the links differ.

# %%
links = {beyond.NO_LATENCY: 0.0}
links.update({k.name: k.seconds for k in published.LINKS})
here = f"{loopback * 1e6:.0f} us"
rows = [{"link": "loopback (not priced)", "latency": here, "source": "measured in this run"}]
for k in published.LINKS:
    us = f"{k.bound} {k.seconds * 1e6:.0f} us"
    rows.append({"link": k.name, "latency": us, "source": f"{{cite:t}}`{k.source}`"})
display(Markdown(table(rows, ["link", "latency", "source"])))
for k in published.LINKS:
    glue(f"{k.key}_us", k.seconds * 1e6, display=False)

# %% [markdown]
# RDMA over Thunderbolt 5, MLX's JACCL backend, at most {glue:text}`rdma_thunderbolt5_us:.0f` µs, and TCP
# between the same Macs, about {glue:text}`tcp_between_macs_us:.0f` µs: the source's latencies of a
# transfer between two of its Macs, which the model takes as the latency of one `all_sum` per MoE layer
# (published figures, not measured here; the RDMA figure is the source's upper bound, so the model's RDMA
# rows are its worst case). No published latency for 10 GbE was found with a source that could be cited;
# TCP over 10 GbE is priced by the TCP row. A third row, with no latency at all, is the bound that
# separates what the experts' split does from what the links do. Each machine is given the memory
# bandwidth of an M3 Ultra or a Strix Halo (`qmtp.book.published`, from the vendors' bus widths and
# transfer rates), one rank per machine, the 35B-A3B at 4 bits with its head in bf16,
# {glue:text}`context` tokens of context as in {doc}`06_throughput`, and, as there,
# {glue:text}`reported_acceptance`. No published latency between Strix Halo machines was found: the
# Strix Halo rows over RDMA and TCP are Mac link latencies applied to Strix Halo bandwidth, an
# assumption, and the column "latency from" says so on each of them.

# %%
memories = {"M3 Ultra": published.M3_ULTRA, "Strix Halo": published.STRIX_HALO}
measured_on = {k.name: k.measured_on for k in published.LINKS}
predicted = beyond.prediction_rows(REAL, 4, memories, links, measured_on=measured_on)
glue("reported_acceptance", throughput.reported_acceptance(), display=False)
glue("context", throughput.DEFAULT_CONTEXT, display=False)
display(
    Markdown(
        table(
            predicted,
            ["memory", "link", "latency from", "ranks", "plain tok/s", "best n_draft"]
            + ["best tok/s", "MTP speedup"],
            {"plain tok/s": "{:.0f}", "best tok/s": "{:.0f}", "MTP speedup": "{:.2f}"},
        )
    )
)
says = beyond.verdicts(predicted)
for key, value in says.items():
    glue(f"v_{key}", value, display=False)
real = [k for k in links if k != beyond.NO_LATENCY]
named = ", ".join(real[:-1]) + " and " + real[-1]
plain = "slower" if says["plain_slower"] else "not always slower"
free = (
    "with no latency at all it would be faster"
    if says["plain_free_faster"]
    else "even with no latency at all it would not always be faster"
)
glue("v_plain", f"{plain} than on one over every real link ({named})", display=False)
glue("v_plain_free", free, display=False)
more = says["grows"] == says["pairs"]
glue("v_pays", "gains more" if more else "does not always gain more", display=False)
everywhere = says["best_slower"] == says["several"]
buys = (
    "memory, not speed"
    if everywhere
    else "memory, and speed only in the cases just named"
)
glue("v_buys", buys, display=False)

# %% mystnb={"figure": {"caption": "Predicted tokens/s of the 35B-A3B at 4 bits against the number of machines of M3 Ultra bandwidth, one rank each, for each link's per-layer all_sum latency and for none at all: plain decoding dashed, the best n_draft solid with that n_draft written beside each point. With one machine there is no all_sum; from two on, each pass pays one per MoE layer.", "name": "fig-machines-scaling"}}
fig = plots.machines_scaling(predicted, "M3 Ultra")

# %% [markdown]
# On one machine MTP's best speedup is {glue:text}`v_speedup_one:.2f` over plain decoding, at `n_draft`
# = {glue:text}`v_n_one`. On {glue:text}`v_most` machines with no latency at all it would be
# {glue:text}`v_speedup_free:.2f`: each machine reads only its share of the union of the verify pass's
# experts, so a wider pass costs each machine less than it costs one. Over the real links it is
# {glue:text}`v_speedup_many_min:.2f` to {glue:text}`v_speedup_many_max:.2f`, at `n_draft` from
# {glue:text}`v_n_many_min` to {glue:text}`v_n_many_max`, larger than on one machine for
# {glue:text}`v_grows` of the {glue:text}`v_pairs` pairs of memory and link. On top of the split, a
# pass pays one `all_sum` per MoE layer whatever its width, so the more tokens a pass verifies, the fewer
# passes pay them: the slower the link, the more MTP gains. So, relative to plain decoding on the same
# machines, MTP {glue:text}`v_pays` on several machines than on one.
#
# That is a relative gain, not speed. In tokens/s, plain decoding on two or more machines is
# {glue:text}`v_plain`; {glue:text}`v_plain_free`, so it is the links, not the split, that cost. And the
# best `n_draft` on several machines is slower than the best on one machine in {glue:text}`v_best_slower`
# of the {glue:text}`v_several` rows of two or more machines over the real links: over
# {glue:text}`v_slow_link`, {glue:text}`v_slow_memory` machines reach at most
# {glue:text}`v_slow_best_many:.0f` tokens/s on two to {glue:text}`v_most` of them, against
# {glue:text}`v_slow_best_one:.0f` on one. {glue:text}`v_faster`. For a model that fits one machine,
# then, spreading it buys {glue:text}`v_buys`. For a model that needs several machines (the bf16 release
# on machines of 32 or 64 GB, or the larger members of the family) there is no one-machine figure to
# compare with; there MTP's speedup over plain decoding on the same machines is the one above.
#
# ## Summary
#
# - Rank r of N holds experts r E/N to (r+1) E/N - 1 of every MoE layer and everything else whole; at
#   4 bits two ranks hold {glue:text}`q4_two_share:.2f` of the 35B-A3B each.
# - Two ranks on this host decoded exactly one process's tokens, greedy and sampled, at `n_draft` 1 and 3.
# - Each rank held {glue:text}`weights_share:.2f` of the weights; its RSS, dominated by the runtime at the
#   tiny model's size, was {glue:text}`rss_share:.2f` times one process's.
# - An `all_sum` per layer cost {glue:text}`loopback_us:.0f` µs here; two ranks sharing two cores decode
#   slower than one process, which is contention, not a network.
# - The cost model says MTP's speedup over plain decoding on the same machines is larger on N machines than
#   on one in {glue:text}`v_grows` of {glue:text}`v_pairs` cases: each machine reads only its share of a
#   verify pass's experts, and the tokens of a verify pass share its per-layer `all_sum`s. In tokens/s,
#   though, plain decoding on several machines is {glue:text}`v_plain`, and the best on several machines
#   is below one machine's best in {glue:text}`v_best_slower` of {glue:text}`v_several` rows: for a model
#   that fits one machine, several buy {glue:text}`v_buys`.
