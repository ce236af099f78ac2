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
# # 9. Beyond one machine
#
# The 35B-A3B at 4 bits, its head in bf16 as this book converts it, weighs about
# {glue:text}`q4_whole_gb:.0f` GB: more than a 16 GB laptop holds, and the family's larger members weigh far
# more. Their routed experts are almost all of them, and a token reads only k of the E experts of each layer.
# So the experts can be spread over several machines: with N ranks, rank r holds experts r E/N to
# (r+1) E/N - 1 of every MoE layer, trunk and head, and everything else whole (`qmtp.parallel`). Each rank
# computes the chosen experts it holds, one `all_sum` per MoE layer gathers every chosen expert's output, and
# each rank then weights and adds them in the single process's order, so the tokens are exactly one process's.
# This chapter sizes what each rank holds for the 35B-A3B, the 122B-A10B and the 397B-A17B, runs the exactness
# check live on two ranks, prices N machines over the links that really join such machines, and ends with how
# to run it on machines of your own.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - what each of N ranks holds, for three members of the family, and the fewest machines of a given memory
#   that hold each;
# - that two ranks decode exactly the tokens of one process, greedy and sampled, with and without drafts;
# - which links exist between Macs and between Strix Halo boxes, and which MLX backend uses each;
# - what the calibrated cost model of {doc}`findings` predicts for 1 to 4 machines, with its validated error;
# - the hostfile and the commands for real machines, and what to check first.
#
# **What runs here.** The bundled tiny model on two ranks of MLX's ring backend on this host, started by
# `mlx.launch` from this notebook (`qmtp.book.beyond.run_live`, bounded by a timeout), and once more in a
# process of its own; `python -m qmtp chat` on two ranks started by `mlx.launch` directly, as the how-to starts
# JACCL's (`beyond.direct_launch_check`); the sizes and predictions are arithmetic over the configs and the published figures of
# `qmtp.book.published`. The chapter always uses the bundled model, whatever `QMTP_MODEL` says: the check holds
# two copies of the model on one host. Its run time is in the {doc}`execution table <../book/execution>`.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
from qmtp import launch, sizes
from qmtp.book import beyond, budget, cost_model, inventory, plots, published, throughput
from qmtp.config import QWEN36_35B_A3B as REAL
from qmtp.loading import BUNDLED_MODEL

path = BUNDLED_MODEL
print(inventory.describe(path))
table = inventory.markdown_table

# %% [markdown]
# ## What each rank holds
#
# The experts of each MoE layer are split into N contiguous blocks, one per rank; N must divide E, so N is 1,
# 2, 4 or 8 here. What every rank keeps whole, the attention and DeltaNet mixers, the routers, the shared
# experts, the embeddings and `lm_head`, does not shrink with N. For the released 35B-A3B converted to 4 bits
# with the head kept in bf16 (as {doc}`03_converting` converts it), `qmtp.sizes.per_rank_bytes` gives each
# rank's share:

# %%
q4 = sizes.sizes(REAL, 4, mtp_bits=throughput.HEAD_BITS)  # the head in bf16
layout = beyond.layout_rows(q4, REAL.num_experts)

# %% tags=["remove-input"]
glue("q4_whole_gb", layout[0]["per rank"], display=False)
glue("q4_two_share", layout[1]["of one process"], display=False)
glue("q4_eight_gb", layout[-1]["per rank"], display=False)
glue("q4_eight_share", layout[-1]["of one process"], display=False)
Markdown(
    table(
        layout,
        ["ranks", "experts per rank", "rank 0", "last rank", "per rank", "of one process"],
        {"per rank": "{:.2f} GB", "of one process": "{:.2f}"},
    )
)

# %% [markdown]
# At 4 bits one process holds {glue:text}`q4_whole_gb:.1f` GB; each of two ranks holds
# {glue:text}`q4_two_share:.2f` of that, and each of eight {glue:text}`q4_eight_gb:.1f` GB
# ({glue:text}`q4_eight_share:.2f`): the replicated part sets a floor that more ranks do not lower.
#
# ### The family's larger members
#
# The shapes of Qwen3.5-122B-A10B and Qwen3.5-397B-A17B used here are not checked against Qwen's own
# `config.json` (unverified): they come from **third-party copies** (`qmtp.book.published.THIRD_PARTY_CONFIGS`): for the
# 122B-A10B the values several copies agree on, for the 397B-A17B the model script of THUDM's slime
# {cite:p}`slime397b` with the values most copies agree on. The copies disagree on one value of the 397B-A17B,
# its shared expert's width: {glue:text}`shared_disagreement`. Each row counts the parameters of the config
# (as `qmtp.sizes.parameter_counts` does, the vision encoder left out) beside the member's name, and the bytes
# one of N ranks holds at 4 bits, the head in bf16:

# %%
family = beyond.member_rows(bits=4)

# %% tags=["remove-input"]
wide = published.THIRD_PARTY_CONFIGS[1]
glue("shared_disagreement", wide.disagreement, display=False)
by_member = {r["member"]: r for r in family}
glue("active_1024", by_member["397B-A17B"]["counted B"].split(" / ")[1], display=False)
glue(
    "active_4096",
    by_member[f"397B-A17B, shared expert {wide.other.shared_expert_intermediate_size}"]["counted B"].split(" / ")[1],
    display=False,
)
glue("b397_one", by_member["397B-A17B"]["1 rank"], display=False)
glue("b397_four", by_member["397B-A17B"]["4 ranks"], display=False)
glue("b122_one", by_member["122B-A10B"]["1 rank"], display=False)
Markdown(
    table(
        family,
        ["member", "config from", "named B", "counted B", "experts", "1 rank", "2 ranks", "4 ranks", "8 ranks"],
        {k: "{:.1f}" for k in ("1 rank", "2 ranks", "4 ranks", "8 ranks")},
    )
    .replace("| named B |", "| B, named (total / active) |", 1)
    .replace("| counted B |", "| B, counted |", 1)
    .replace("| 1 rank |", "| GB on 1 rank |", 1)
)

# %% [markdown]
# With a shared expert 1024 wide the 397B-A17B's config uses {glue:text}`active_1024` B parameters per token,
# with 4096 {glue:text}`active_4096` B, against the 17 B of its name: one more reason to read 1024, and the
# second reading changes no size here by more than a few percent. The 122B-A10B at 4 bits is
# {glue:text}`b122_one:.0f` GB, which one large machine holds; the 397B-A17B is {glue:text}`b397_one:.0f` GB,
# {glue:text}`b397_four:.0f` GB on each of four ranks.
#
# ## How many machines hold them
#
# The smallest N whose per-rank share fits a machine's memory beside the runtime's
# {glue:text}`runtime_gib:.1f` GiB of Python, MLX and activations ({doc}`real_checkpoint`;
# `qmtp.book.budget.fits`, which counts a machine's memory in GiB), at each width of the trunk, the head in
# bf16 (the bf16 rows are the release, nothing quantized). The KV cache of a long context and the operating
# system need room beyond that, so a machine the N only just fits may need the next in practice. A dash: no N up
# to 8 fits.

# %%
fits = beyond.fit_table(machines_gb=(16, 32, 64, 128, 256))

# %% tags=["remove-input"]
glue("runtime_gib", budget.RUNTIME_GB, display=False)
Markdown(
    table(
        [{**r, **{k: ("-" if r[k] is None else r[k]) for k in r if k.endswith(" GB")}} for r in fits
         if "shared expert" not in r["member"]],
        ["member", "width", "whole GB", "16 GB", "32 GB", "64 GB", "128 GB", "256 GB"],
        {"whole GB": "{:.0f}"},
    )
)

# %% [markdown]
# ## The same tokens on two ranks, live
#
# `beyond.run_live` starts two ranks of the bundled model through `mlx.launch` (MLX's ring backend over TCP on
# this host, a free port, a timeout), then the same worker in one process without a group. Each rank decodes
# one prompt greedy and sampled (temperature 0.8, one seed), plain (`n_draft=1`) and with two head drafts
# (`n_draft=3`), and writes its tokens; this notebook decodes the same four generations itself and compares
# them token for token.

# %%
live = beyond.run_live(ranks=2, timeout=120)
model = qmtp.load(path)
reference = beyond.generations(model)
checked = beyond.compare(live, reference)

# %% tags=["remove-input"]
assert all(r["equal"] for r in checked), "a rank's tokens differ from one process's"
glue("live_s", live["seconds"]["ranks"], display=False)
glue("live_cases", len(checked), display=False)
Markdown(table(checked, ["n_draft", "sampling", "rank", "tokens", "equal", "first difference"]))

# %% [markdown]
# All {glue:text}`live_cases` comparisons are equal, token for token (the chapter stops if one is not): the two
# ranks, started and finished in {glue:text}`live_s:.0f` s, decode what one process decodes, greedy or sampled,
# with drafts or without. `tests/test_distributed.py` checks the same for every `n_draft` from 1 to 5 and
# `"auto"`, on the bundled model and its 4-bit conversion, and each MoE layer bit for bit.
#
# ## The memory split, measured
#
# Each process of the check recorded the bytes of the weights it holds and its peak resident memory (RSS, what
# the operating system counts for it):

# %%
memory = beyond.memory_rows(live)

# %% tags=["remove-input"]
rank0 = memory[1]
glue("weights_share", rank0["weights / one"], display=False)
glue("rss_share", rank0["RSS / one"], display=False)
glue("weights_mib", memory[0]["weights"], display=False)
glue("rss_mib", memory[0]["peak RSS"], display=False)
as_loaded = sizes.sizes(  # float32 in memory, nothing quantized: as the ranks hold it
    model.config, sizes.UNQUANTIZED, mtp_bits=None, router_bits=sizes.UNQUANTIZED, dtype_bytes=4
)
share = beyond.layout_rows(as_loaded, model.config.num_experts, ranks=(1, 2))[1]
glue("predicted_share", share["of one process"], display=False)
glue("rss_verdict", "outweigh" if rank0["RSS / one"] > 1 else "do not outweigh", display=False)
Markdown(
    table(
        memory,
        ["process", "experts held", "weights", "peak RSS", "weights / one", "RSS / one"],
        {"weights": "{:.1f} MiB", "peak RSS": "{:.0f} MiB", "weights / one": "{:.2f}", "RSS / one": "{:.2f}"},
    )
)

# %% [markdown]
# Each rank holds {glue:text}`weights_share:.4f` of one process's weights, as the arithmetic of
# `per_rank_bytes` says for float32 weights ({glue:text}`predicted_share:.4f`). Its peak RSS is
# {glue:text}`rss_share:.2f` times one process's: the bundled model's weights are {glue:text}`weights_mib:.0f`
# MiB of a {glue:text}`rss_mib:.0f` MiB process, so Python, MLX and the ring backend's buffers, which every rank
# carries whole, {glue:text}`rss_verdict` what the split saves. The split pays in memory where the experts
# dominate the process, as they do at the real widths.
#
# The ranks also timed a chain of `all_sum`s of one token's [1, k, H] expert outputs, one per MoE layer as a
# decode step issues them: {glue:text}`loopback_us:.0f` µs per layer in the fastest chain on this host's
# loopback. That is two processes sharing two cores, not a link between machines, so it prices nothing below.

# %% tags=["remove-cell"]
glue("loopback_us", live["ranks"][0]["all_sum_per_layer"]["fastest"] * 1e6, display=False)

# %% [markdown]
# ## The links between machines
#
# A pass on N machines pays one `all_sum` per MoE layer, and a head draft one more. What that costs depends on
# the link, and on how the MLX backend that uses it sums: MLX's **ring** backend (TCP, on every platform, what
# `python -m qmtp ... --hostfile` starts) passes 1/N of the array around the ring in 2 (N - 1) steps; **JACCL**
# (RDMA over Thunderbolt 5, macOS 26.2 or later only) sends the whole array to every peer at once over each
# pair's own cable, in one step; MLX's **MPI** backend leaves it to an MPI library, which over RoCE is assumed
# here to take log2 N steps (`beyond.all_sum_steps`). Thunderbolt RDMA exists only between Macs; between Linux
# machines such as Strix Halo boxes the links are TCP over Ethernet, or RDMA over Converged Ethernet (RoCE v2)
# on a network card that offers it. Each link below is published between machines of one kind, with its source;
# the last column prices one `all_sum` of one token's expert outputs of the 35B-A3B (bf16) on 2 and on 4
# machines:

# %%
links = beyond.link_rows()
here = beyond.backends_here()

# %% tags=["remove-input"]
glue("backends_here", ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in here.items()), display=False)
Markdown(table(links, ["link", "between", "backend", "latency", "bandwidth", "all_sum, 2 / 4", "source"]))

# %% [markdown]
# The Mac figures are {cite:t}`geerling2025rdma`'s, between four M3 Ultra Mac Studios (the RDMA one an upper
# bound, so its rows are a worst case; the source gives no bandwidth, so Thunderbolt 5's rate bounds it); the
# Strix Halo figures are from {cite:t}`kyuz0rdma`'s comparison between two Framework Desktop boards, on their
# 1 GbE port and on Intel E810 100 GbE cards, by TCP and by RoCE v2. No figure measured between Strix Halo
# boxes over Thunderbolt networking, or between Macs over Ethernet, was found, so neither is priced. On this
# machine's MLX build the backends available are: {glue:text}`backends_here` (`mx.distributed.is_available`):
# the ring is in every wheel, JACCL in macOS builds only, and MPI needs an MPI library on the machine.
#
# ## What N machines would give: the calibrated cost model
#
# {doc}`findings` prices a step as its bytes over the memory's bandwidth plus the machine's own overhead, read
# off a published plain decoding figure, of which each extra draft position pays a share c fitted on the
# published MTP runs of other sources (`qmtp.book.cost_model`). Spread over N machines, a step's bytes are the
# busiest rank's (its share of the union of the pass's experts, and everything replicated), every rank pays
# the machine's overhead (each runs every layer's kernels), and the `all_sum`s come on top, priced as above.
# How far the model is to be trusted: {glue:text}`verdict`

# %% tags=["remove-cell"]
glue("verdict", cost_model.verdict(), display=False)

# %% [markdown]
# Two rules carry the model beyond the runs it was tested on. A member with no plain figure of its own on a
# machine gets the 35B-A3B's overhead scaled by its layers (a pass launches the same kernels per layer): on the
# one machine where both members' plain figures are published, the M3 Ultra, that rule predicts the
# 122B-A10B's {glue:text}`xfer_published:.1f` tokens/s as {glue:text}`xfer_scaled:.1f`
# ({glue:text}`xfer_scaled_err:+.0%`; the overhead unscaled would give {glue:text}`xfer_same_err:+.0%`). And
# the head's acceptance is the 35B-A3B's fitted one for every member, as no other member's is published with
# its width. **Nothing published measures MTP on several machines**, so the link terms, and the overhead each
# rank pays, are untested: the errors stated below are those of the one-machine model on the run that
# calibrates each kind.

# %% tags=["remove-cell"]
xfer = beyond.overhead_transfer_check()
glue("xfer_published", xfer["published"], display=False)
glue("xfer_scaled", xfer["scaled"], display=False)
glue("xfer_scaled_err", xfer["scaled error"], display=False)
glue("xfer_same_err", xfer["unscaled error"], display=False)

# %% [markdown]
# Each cell gives plain decoding's tokens/s, then the best `n_draft`'s and, in brackets, that `n_draft`, at
# the context of the run that calibrates the machine, one rank per machine, a 4-bit trunk with the head in
# bf16; a member appears at each N whose share fits (128 GB per Strix Halo box; 256 GB per Mac, an assumed
# configuration). The last column names the published run that calibrates the row (the 35B-A3B's, "35B", times
# the ratio of layers for a member with no run of its own) and the model's out-of-sample error on that run's MTP figure,
# with the fitted acceptance as here: the error to read beside the row's predictions; † marks a member sized
# from a third-party config. **Apple M3 Ultra**,
# calibrated by {glue:text}`mac_by` (error {glue:text}`mac_err:+.0%`):

# %%
mac, strix = beyond.KINDS
mac_rows = beyond.cluster_rows(mac)

# %% tags=["remove-input"]
glue("mac_by", mac_rows[0]["calibrated by"], display=False)
glue("mac_err", mac_rows[0]["error"], display=False)
mac_cells = beyond.cluster_table(mac_rows, mac)
Markdown(table(mac_cells, list(mac_cells[0])))

# %% [markdown]
# **AMD Strix Halo**, calibrated by {glue:text}`strix_by` (error {glue:text}`strix_err:+.0%`):

# %%
strix_rows = beyond.cluster_rows(strix)

# %% tags=["remove-input"]
glue("strix_by", strix_rows[0]["calibrated by"], display=False)
glue("strix_err", strix_rows[0]["error"], display=False)
strix_cells = beyond.cluster_table(strix_rows, strix)
Markdown(table(strix_cells, list(strix_cells[0])))

# %% mystnb={"figure": {"caption": "Predicted tokens/s of the 35B-A3B at 4 bits on 1 to 8 Strix Halo boxes, one rank each, for each published link between such boxes: plain decoding dashed, the best n_draft solid with that n_draft written beside each point. One box alone starts every line; from two on, each pass pays one all_sum per MoE layer over the link.", "name": "fig-machines-scaling"}}
fig = plots.machines_scaling(beyond.scaling_rows(strix, "35B-A3B"), strix.name)

# %% tags=["remove-cell"]
mac_says, strix_says = beyond.cluster_summary(mac_rows, mac), beyond.cluster_summary(strix_rows, strix)
names = {**beyond.SHORT}
for kind, says in (("mac", mac_says), ("strix", strix_says)):
    for member, s in says.items():
        tag = f"{kind}_{member.split('-')[0]}"
        glue(f"{tag}_best", s["best"], display=False)
        glue(f"{tag}_n", s["n_draft"], display=False)
        glue(f"{tag}_machines", s["machines"], display=False)
        glue(f"{tag}_link", names[s["link"]], display=False)
        glue(f"{tag}_gain", s["gain"], display=False)
        glue(f"{tag}_fewest", s["fewest"], display=False)
        one = s["one machine"]
        glue(f"{tag}_one", one["best"] if one else float("nan"), display=False)
slow = {r["N"]: r for r in strix_cells if r["member"] == "35B-A3B"}
glue("strix_35_two_1gbe", slow[2][beyond.SHORT["tcp_strix_halo_1gbe"]], display=False)
glue("strix_35_one", slow[1]["alone"], display=False)
says = beyond.verdicts([(mac, mac_rows), (strix, strix_rows)])
for key, value in says.items():
    glue(f"v_{key}", value, display=False)
mac35 = {r["N"]: r for r in mac_cells if r["member"] == "35B-A3B"}
glue("mac_35_two_tcp", mac35[2][beyond.SHORT["tcp_between_macs"]], display=False)
glue("mac_35_one", mac35[1]["alone"], display=False)

# %% [markdown]
# What the tables say, with the errors above in mind:
#
# - **Over TCP, a member that fits one machine {glue:text}`v_tcp`**{glue:text}`v_tcp_except`. The 35B-A3B on one Strix Halo box is
#   predicted at {glue:text}`strix_35_one` tokens/s (plain → best); on two boxes over 1 GbE at
#   {glue:text}`strix_35_two_1gbe`; on one Mac at {glue:text}`mac_35_one`, on two over TCP at
#   {glue:text}`mac_35_two_tcp`. Drafting gains more there, relative to plain decoding on the same machines,
#   because a verify pass shares its `all_sum`s among the tokens it yields, which is why the best `n_draft`
#   grows with a slow link.
# - **Over RDMA** every rank pays the machine's overhead, which calibrated is most of a pass, but reads fewer
#   bytes, and over RoCE v2 or Thunderbolt RDMA the `all_sum`s cost little, so the best case of the 35B-A3B on Strix Halo is {glue:text}`strix_35B_best:.0f` tokens/s on
#   {glue:text}`strix_35B_machines` boxes over {glue:text}`strix_35B_link` (`n_draft`
#   {glue:text}`strix_35B_n`), against {glue:text}`strix_35B_one:.0f` on one. Over RDMA several machines reach
#   at most {glue:text}`v_rdma_ratio:.2f` times one machine's best, {glue:text}`v_rdma_within` the model's
#   error on the runs that calibrate them; and RoCE from MLX goes through its MPI backend, which this book has
#   not run.
# - **For the members that need several machines, the link sets the speed.** The 397B-A17B needs at
#   least {glue:text}`strix_397B_fewest` Strix Halo boxes; its best there is {glue:text}`strix_397B_best:.0f` tokens/s on
#   {glue:text}`strix_397B_machines` boxes over {glue:text}`strix_397B_link` (`n_draft`
#   {glue:text}`strix_397B_n`, {glue:text}`strix_397B_gain:.2f`x plain decoding on the same boxes). On Macs of
#   256 GB one holds it ({glue:text}`mac_397B_one:.0f` tokens/s at its best width), and
#   {glue:text}`mac_397B_machines` over {glue:text}`mac_397B_link` reach {glue:text}`mac_397B_best:.0f`.
# - **The width to set** is `n_draft` {glue:text}`v_fast_widths` on one machine or over RDMA,
#   {glue:text}`v_tcp_widths` over TCP: every cell gives it. That is for the fitted acceptance; where your own
#   prompts accept less, `"auto"` chooses per step ({doc}`06_throughput`).
#
# ## On real machines: the hostfile, the backend, the commands
#
# Every rank needs the same checkpoint at the same path (each checks at load that its files agree with rank
# 0's, `qmtp.parallel.same_files`), the same Python environment with qmtp installed, and passwordless `ssh`
# from the machine you start on to every host. The **hostfile** is `mlx.launch`'s JSON: each host's `ssh`
# name and the IP the ranks listen on, on the interface of the link you mean to use (the Thunderbolt bridge's
# or the 100 GbE card's address, not the office LAN's):

# %%
two_boxes = beyond.hostfile([("strix-1", "192.168.100.1"), ("strix-2", "192.168.100.2")])
two_boxes

# %% [markdown]
# Written to a file, `python -m qmtp chat MODEL --hostfile FILE` starts one rank per host through MLX's ring
# backend; `qmtp.launch.command` is the `mlx.launch` line it runs, here with this machine's paths (each rank
# runs the same `python -m qmtp` command again, loads its experts, and rank 0 prints):

# %% tags=["remove-cell"]
import json
import os
import shlex
import tempfile

built_in = os.getcwd()
os.chdir(tempfile.mkdtemp())  # the hostfile beside the command, as a reader would have it
with open("strix.json", "w") as f:
    json.dump(two_boxes, f)

# %%
chat = ["-m", "qmtp", "chat", "/models/qwen3.6-35b-a3b-4bit", "--use-mtp", "--n-draft", "4", "--timeout", "600"]
print(shlex.join(launch.command(chat, hostfile="strix.json", timeout=600)))

# %% [markdown]
# The same hostfile works between Macs over IP over Thunderbolt (the ring; the 300 µs row above). For RDMA
# over Thunderbolt 5, enable it once per Mac in macOS Recovery (`rdma_ctl enable`), cable every pair of Macs,
# and give each host the RDMA device of the port that reaches each other host (`ibv_devices` lists them;
# `mlx.distributed_config --backend jaccl --over thunderbolt --hosts mac-1,mac-2,mac-3,mac-4
# --output-hostfile macs.json` writes such a hostfile). qmtp's own `--hostfile`
# starts the ring only, so JACCL's ranks are started by `mlx.launch` itself, with the variable by which a qmtp
# rank knows it is one, and the prompt in `--prompt` (stdin is relayed only by qmtp's launcher):

# %%
four_macs = beyond.hostfile(
    [(f"mac-{i}", f"10.0.0.{i}") for i in range(1, 5)],
    rdma=[[None if j == i else f"rdma_en{2 + (j - i) % 4}" for j in range(4)] for i in range(4)],
)
print(json.dumps(four_macs["hosts"][0]))
print(shlex.join(beyond.jaccl_command("/models/qwen3.6-35b-a3b-4bit", "macs.json", "--use-mtp",
                                      "--n-draft", "4", "--prompt", "Why is the sky blue?")))

# %% tags=["remove-cell"]
os.chdir(built_in)

# %% [markdown]
# This machine has no Thunderbolt RDMA, but the route itself, `mlx.launch` starting qmtp's ranks directly, runs
# here with the ring in its place (`-n 2` on this host instead of the hostfile): two ranks of the bundled
# model, greedy at `n_draft` 3, against the same `python -m qmtp chat` in one process.

# %%
direct = beyond.direct_launch_check(ranks=2, timeout=120)

# %% tags=["remove-cell"]
assert direct["ranks"] == direct["alone"], (direct["ranks"], direct["alone"])
glue("direct_s", direct["seconds"], display=False)
glue("direct_chars", len(direct["alone"]), display=False)

# %% [markdown]
# Rank 0 printed exactly what one process prints ({glue:text}`direct_chars` characters, the ranks done in
# {glue:text}`direct_s:.0f` s; the chapter stops if they differ).

# %% [markdown]
# The first host's entry is printed above, then the command (`macs.json` holds `four_macs`; the device names are
# placeholders, yours are what `ibv_devices` prints on each Mac). Between Strix
# Halo boxes with RoCE v2 cards, MLX has no RDMA backend of its own on Linux: its MPI backend, started by
# `mlx.launch --backend mpi` with an MPI library built for RoCE, is the route, not tried by this book; TCP
# over the same cards is the ring's, and runs as above.
#
# **What to check first**, cheapest first:
#
# 1. `python -m qmtp doctor MODEL` on every host: the same MLX backend, and a checkpoint that opens.
# 2. `python -m qmtp chat MODEL --ranks 2 --prompt hi --max-tokens 8` on one host: the ranks start, split
#    the experts and decode (what this chapter ran live above).
# 3. The link itself: `ping` over the interface the hostfile names (set its round trip beside the link
#    table's TCP latency), and for RDMA `ibv_devinfo` (ports `PORT_ACTIVE`) and perftest's `ib_send_lat` between two
#    hosts; a latency far above the rows of the link table moves every prediction here.
# 4. One generation across the hosts with `--timeout`, so that a rank that hangs ends every rank: a host that
#    cannot reach another's listening port shows as "could not join the ring".
# 5. The same files on every host: before the first token the ranks compare config.json, the tokenizer files,
#    the chat template, generation_config.json and the bytes of every tensor each one loads, and all refuse
#    with one line naming the file, or the tensor, expert and rank, that differs. Copy one folder to every host;
#    a qmtp conversion records its tensors' digests (`qmtp-digests.json`), against which each rank checks only the
#    experts it holds, while with the release's files rank 0 reads every expert once to be the reference.
# 6. Only then the model at full size, at the `n_draft` the table gives for your machines and link.
#
# ## Summary
#
# - Rank r of N holds experts r E/N to (r+1) E/N - 1 of every MoE layer and everything else whole; at 4 bits
#   two ranks hold {glue:text}`q4_two_share:.2f` of the 35B-A3B each. The 122B-A10B ({glue:text}`b122_one:.0f`
#   GB) and the 397B-A17B ({glue:text}`b397_one:.0f` GB), from third-party configs, are sized per rank and per
#   width above.
# - Two ranks on this host decoded exactly one process's tokens, greedy and sampled, at `n_draft` 1 and 3.
# - The links that exist: Thunderbolt RDMA (JACCL) and TCP between Macs; TCP over Ethernet and RoCE v2 between
#   Strix Halo boxes, each with its published latency and the MLX backend that uses it.
# - Calibrated, over TCP a member that fits one machine {glue:text}`v_tcp`; over RDMA several reach at most
#   {glue:text}`v_rdma_ratio:.2f` times one machine's best, {glue:text}`v_rdma_within` the model's error; the
#   members that need several machines run at the speeds of the tables, at `n_draft`
#   {glue:text}`v_fast_widths` over RDMA. Nothing published measures MTP across machines, so these are
#   predictions whose link terms are untested.
