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
# # What this book found
#
# Each finding in one line, with its number from this build and what it was measured on: the real model's
# config (arithmetic, exact for the release), the bundled tiny model (the same architecture at toy widths, with
# a head trained for this book), random weights at the real widths, or this machine. The last part says what
# only the real weights or an accelerator can settle. Every number is read from what the chapters saved when
# they ran in this build (`qmtp.book.results`); this page is shown first but runs after them.

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown
from myst_nb import glue
from qmtp.book import budget, cost_model, inventory, machine, peer, published, results, throughput

path = inventory.model_path()
print(inventory.describe(path))
config = qmtp.ModelConfig.from_file(path)
CHAPTERS = (
    "01_anatomy",
    "02_fixes",
    "03_converting",
    "04_quantizing",
    "05_mtp_decoding",
    "06_throughput",
    "07_engine",
)
saved = {chapter: results.load(chapter, path) for chapter in CHAPTERS}
on_tiny = not budget.active(config)
glue(
    "model_kind",
    "the bundled tiny model" if on_tiny else "the full-size checkpoint",
    display=False,
)
glue(
    "machine", Markdown(machine.line(saved["06_throughput"]["machine"])), display=False
)
glue("build_machine", machine.line(), display=False)  # this build's own machine


def shown(value, spec: str, missing: str = "not measured in this build") -> str:
    """A saved number as the prose shows it: a chapter that skipped it under a budget
    saved NaN or None."""
    if value is None or value != value:
        return missing
    return format(value, spec)


glue(
    "model_measured_on",
    Markdown(
        "the tiny model that ships with the package (8 layers, hidden size 64, 256 "
        "experts top-8 and an MTP head, trained on a generated corpus; its head was "
        "trained a second time on its own drafts). Its numbers show directions and "
        "mechanisms, not the real model's values."
        if on_tiny
        else "the full-size checkpoint, under the budget each chapter states "
        "({doc}`real_checkpoint`): chapters 2 to 4 on its first layers, decoding on one "
        "short prompt, so the numbers are indicative."
    ),
    display=False,
)

# %% tags=["remove-cell"]
glue("bl_verdict", cost_model.verdict(), display=False)
real_width = saved["06_throughput"].get("real_width_summary")
memory_gib = saved["06_throughput"]["machine"].get("memory_gib")

# %% [markdown]
# ## The bottom line, per kind of hardware
#
# *Published by others, and predicted by this book's cost model from each machine's published plain decoding
# figure; nothing in this table was measured on that hardware here, except the CPU row's measurement.*
#
# How far to trust the predictions: {glue:text}`bl_verdict`
#
# The model prices a step as its bytes over the memory's bandwidth plus the machine's own overhead, read off its
# published plain decoding speed, of which each extra draft position pays a fitted share
# (`qmtp.book.cost_model`). Widths are in this book's `n_draft` (tokens a trunk pass verifies, its own
# included), each engine's own option beside it; "fits" is which trunk widths (head in bf16) fit such a machine
# beside the runtime.

# %%
bottom = cost_model.bottom_line(real_width, memory_gib)

# %% tags=["hide-input"]
glue("bl_prose", cost_model.bottom_line_prose(bottom), display=False)
Markdown(
    inventory.markdown_table(
        [
            dict(r, hardware=f"{r['hardware']}; *{r['engines']}*",
                 published=r["published"] + " {cite:p}`%s`" % ",".join(r["sources"]))
            for r in bottom
        ],
        ["hardware", "published", "predicted", "n_draft", "fits", "sure"],
    )
    .replace("| hardware |", "| hardware; *engines* |", 1)
    .replace("| published |", "| published speedup |", 1)
    .replace("| predicted |", "| predicted (error) |", 1)
    .replace("| n_draft |", "| n_draft to set |", 1)
    .replace("| fits |", "| widths that fit |", 1)
    .replace("| sure |", "| how sure |", 1)
)

# %% [markdown]
# {glue:text}`bl_prose` The published runs, the model's prediction for each and every parameter it fits are
# under *Published elsewhere* below.
#
# The chapters ran on {glue:text}`model_kind`; the timings are from {glue:md}`machine`.
#
# ## The real model, from its config
#
# *Measured on: the release's `config.json`, by arithmetic (`qmtp.sizes`); exact, and the same on any machine.*

# %% tags=["hide-input"]
anatomy, throughput_saved = saved["01_anatomy"], saved["06_throughput"]
glue("f_params", anatomy["real_parameters_b"], display=False)
glue("f_active", anatomy["real_active_b"], display=False)
glue("f_total4", anatomy["trunk_gb"]["4"] + anatomy["head_gb"]["bf16"], display=False)
glue("f_head_bf16", anatomy["head_gb"]["bf16"], display=False)
glue("f_head_4", anatomy["head_gb"]["4"], display=False)
glue("f_gb_token", throughput_saved["real_gb_per_token"], display=False)
glue("f_expert_share", throughput_saved["real_expert_share"], display=False)
glue("f_bandwidth", throughput_saved["bandwidth_gb_s"], display=False)
predicted = throughput_saved["predicted_moe_4bit"]
best_n = max((n for n in predicted if n != "1"), key=predicted.get)
glue("f_moe2", predicted["2"], display=False)
glue(
    "f_moe_best_clause",
    (
        "its best width on such a machine"
        if best_n == "2"
        else f"and at best {predicted[best_n]:.2f}x (n_draft = {best_n})"
    ),
    display=False,
)
glue("f_acceptance", throughput.reported_acceptance(), display=False)
shares = [
    cost_model.calibrate(r).bytes_seconds / cost_model.calibrate(r).plain_seconds
    for r in cost_model.rows()
    if cost_model.comparable(r)[0]
]
glue("f_share_low", min(shares), display=False)
glue("f_share_high", max(shares), display=False)
calibrated_widths = sorted({n for r in bottom for n in r["best n_draft"]})
glue(
    "f_cal_best",
    "-".join(str(n) for n in dict.fromkeys((calibrated_widths[0], calibrated_widths[-1]))),
    display=False,
)
gains = [r["predicted gain"] for r in bottom if r["predicted gain"]]
glue("f_cal_low", min(g[0] for g in gains), display=False)
glue("f_cal_high", max(g[1] for g in gains), display=False)
glue(
    "f_dense_best",
    max(throughput_saved["predicted_dense_4bit"].values()),
    display=False,
)

# %% [markdown]
# 1. **Size.** {glue:text}`f_params:.1f` B parameters, {glue:text}`f_active:.2f` B of them used per token; with a
#    4-bit trunk and the head in bf16 the model weighs {glue:text}`f_total4:.1f` GB, of which the head
#    {glue:text}`f_head_bf16:.2f` GB (the "about 0.5 GB" on the card of lemon-mlx-engine, the engine this project
#    began from, is a 4-bit head: {glue:text}`f_head_4:.2f` GB).
#    {doc}`01_anatomy`
# 2. **What a token reads.** One decoded token of the 4-bit model reads {glue:text}`f_gb_token:.2f` GB,
#    {glue:text}`f_expert_share:.0%` of it routed experts. {doc}`06_throughput`
# 3. **Predicted speedup.** Were a pass to cost only its bytes ({glue:text}`f_bandwidth:.0f` GB/s, a 4-bit
#    trunk and the head in bf16), MTP would speed the MoE up {glue:text}`f_moe2:.2f`x at `n_draft=2`,
#    {glue:text}`f_moe_best_clause`, because a verify pass reads the union of its tokens' experts (a dense model
#    of the same active size: up to {glue:text}`f_dense_best:.2f`x), with {glue:text}`f_acceptance`. No
#    published engine runs like that: plain decoding reached {glue:text}`f_share_low:.0%` to
#    {glue:text}`f_share_high:.0%` of that bound. Calibrated by those plain figures (the bottom line above,
#    validated out of sample), the best width is `n_draft` {glue:text}`f_cal_best`, for
#    {glue:text}`f_cal_low:.2f`x to {glue:text}`f_cal_high:.2f`x. {doc}`06_throughput`
#
# ## The model the chapters ran on
#
# *Measured on: {glue:md}`model_measured_on`*

# %% tags=["hide-input"]
fixes, converting, quantizing, decoding = (saved[c] for c in CHAPTERS[1:5])
glue("f_acc_both", fixes["accuracy"]["both fixes"], display=False)
glue("f_acc_no_norm", fixes["accuracy"]["conv fix only"], display=False)
glue("f_acc_twice", fixes["double_shift_accuracy"], display=False)
conv = fixes["conv_mistake_accuracy"]
right = fixes["accuracy"]["both fixes"]
silent = [a for a in conv.values() if a is not None and a != right]
glue("f_conv_loud", sum(a is None for a in conv.values()), display=False)
glue("f_conv_right", sum(a == right for a in conv.values()), display=False)
glue("f_conv_silent", len(silent), display=False)
silent_range = f"{min(silent):.3f} to {max(silent):.3f}" if silent else "none"
glue("f_conv_silent_acc", silent_range, display=False)
glue("f_conv_all", len(conv), display=False)
glue("f_conv_bits", converting["bits"], display=False)
glue("f_conv_top1", converting["top1_agreement"], display=False)
equal = converting["unquantized_equal"]
glue("f_conv_equal", "identical" if equal else "NOT identical", display=False)
heads = quantizing["head_width_acceptance"]
glue("f_head_acc_bf16", heads["bf16"], display=False)
glue("f_head_acc_4", heads["4"], display=False)
glue("f_head_acc_3", heads["3"], display=False)
trunk_acceptance = quantizing["trunk_width_acceptance"]
glue("f_trunk_acc_4", shown(trunk_acceptance["4"], ".3f"), display=False)
glue("f_trunk_acc_2", shown(trunk_acceptance["2"], ".3f"), display=False)
glue("f_acc2", decoding["acceptance"]["2"], display=False)
glue("f_tpp2", decoding["tokens_per_trunk_pass"]["2"], display=False)
glue("f_pos2", decoding["per_position"]["3"][1], display=False)
previous = decoding["previous_head"]
before = previous["previous head"]["3"]["per_position"][1] if previous else None
glue(
    "f_pos2_before",
    f" (before: {before:.2f})" if before is not None else "",
    display=False,
)
glue("f_lossless", decoding["lossless_checks"], display=False)
glue("f_mismatches", decoding["lossless_mismatches"], display=False)
glue("f_no_experts", decoding["ablation"]["no routed experts"], display=False)

# %% [markdown]
# 4. **The norm fix fails silently.** Without it next-token accuracy falls from {glue:text}`f_acc_both:.3f` to
#    {glue:text}`f_acc_no_norm:.3f` with no error; the +1 applied twice gives {glue:text}`f_acc_twice:.3f`.
#    {doc}`02_fixes`
# 5. **A wrong conv layout fails loudly or silently.** Of {glue:text}`f_conv_all` ways to move the conv kernel,
#    {glue:text}`f_conv_right` give the right kernel, {glue:text}`f_conv_loud` are refused by MLX and
#    {glue:text}`f_conv_silent` run without a word at an accuracy of {glue:text}`f_conv_silent_acc`.
#    {doc}`02_fixes`
# 6. **Conversion loses nothing it should keep.** The {glue:text}`f_conv_bits`-bit file picks the source's next
#    token at {glue:text}`f_conv_top1:.3f` of the positions, and every tensor left unquantized is
#    {glue:text}`f_conv_equal`. {doc}`03_converting`
# 7. **Quantization: the trunk's width matters, the tiny head's hardly.** Acceptance at `n_draft=2` is
#    {glue:text}`f_trunk_acc_4` with a 4-bit trunk and {glue:text}`f_trunk_acc_2` with a 2-bit one; the
#    head at 4 bits keeps {glue:text}`f_head_acc_4:.3f` against {glue:text}`f_head_acc_bf16:.3f` in bf16
#    ({glue:text}`f_head_acc_3:.3f` at 3 bits), each with the trunk at 8 bits on chapter 4's prompts, so these
#    rates differ from finding 8's, measured on chapter 5's model and prompts. {doc}`04_quantizing`
# 8. **Acceptance.** The {term}`trunk` accepts {glue:text}`f_acc2:.2f` of the {term}`head`'s drafts at
#    {term}`n_draft` = 2, {glue:text}`f_tpp2:.2f` {term}`tokens per pass`, on chapter 5's model and prompts
#    (chapters 6 and 7 time other prompts and lengths, so their tokens per pass differ); at `n_draft=3` the second draft is
#    accepted {glue:text}`f_pos2:.2f` of the times it is proposed, a property of this book's head, retrained on
#    its own drafts{glue:text}`f_pos2_before`.
#    Without its routed experts the head's acceptance is {glue:text}`f_no_experts:.2f`. {doc}`05_mtp_decoding`
# 9. **Lossless.** {glue:text}`f_lossless` speculative runs, {glue:text}`f_mismatches` different from plain greedy
#    decoding. {doc}`05_mtp_decoding`
#
# ## This machine
#
# *Measured on: the machine named above. On the tiny model a pass costs what it dispatches; at the real widths
# (random weights, the first layers of the real model with all 256 experts and the full vocabulary) it costs what
# MLX's CPU kernels take.*

# %% tags=["hide-input"]
measured = throughput_saved["measured_speedup"]
best_measured = max(measured, key=measured.get)
glue("f_meas2", measured["2"], display=False)
glue(
    "f_meas_best_clause",
    (
        "its best width"
        if best_measured == "2"
        else "and no width beats plain decoding"
        if best_measured == "1"
        else f"at best {measured[best_measured]:.2f}x (n_draft = {best_measured})"
    ),
    display=False,
)
engine = saved["07_engine"]
vs_mlx_lm = engine["qmtp_over_mlx_lm"]
glue(
    "f_vs_mlx_lm",
    f"qmtp decodes at {vs_mlx_lm:.2f}x mlx-lm's speed, with the same tokens"
    if vs_mlx_lm == vs_mlx_lm
    else "qmtp and mlx-lm were not compared in this build",
    display=False,
)
glue("f_auto", engine["auto_over_best_fixed"], display=False)
glue("f_auto_plain", engine["auto_over_plain"], display=False)
glue("f_rw_mlx_lm", engine["real_width_qmtp_over_mlx_lm"], display=False)
wide_tps, wide_lm_head = engine["real_width_tokens_per_second"], engine["real_width_lm_head_ms"]
glue("f_rw_gap", peer.real_width_gap(wide_tps["qmtp"], wide_tps["mlx-lm"], wide_lm_head["whole"],
                                     wide_lm_head["split"], wide_lm_head["blocks"]), display=False)
rows = {r["pass"]: r for r in throughput_saved["real_width"]["rows"]}
glue("f_rw_layers", throughput_saved["real_width"]["layers"], display=False)
glue("f_rw_plain_ms", rows["plain, 1 token"]["seconds"] * 1e3, display=False)
glue("f_rw_v2_time", rows["verify, 2 tokens"]["time_over_plain"], display=False)
glue("f_rw_v2_bytes", rows["verify, 2 tokens"]["bytes_over_plain"], display=False)
glue("f_rw_break_even", throughput_saved["real_width_break_even"], display=False)
cannot = throughput_saved["real_width_break_even"] >= 2
bound = throughput_saved["real_width_summary"]["compute_bound"]
glue(
    "f_rw_bound",
    "compute-bound" if bound else "close to memory-bound",
    display=False,
)
glue(
    "f_rw_disagree",
    (
        "findings 3 and 11 disagree because this CPU is compute-bound where the cost "
        "model assumes memory-bound"
        if cannot and predicted["2"] > 1
        else "on this machine findings 3 and 11 point the same way, but at four layers "
        "of random weights, not the real model"
    ),
    display=False,
)
glue(
    "f_rw_verdict",
    (
        "so drafting cannot pay here at the real widths, however good the head"
        if cannot
        else "so drafting can pay here at the real widths"
    ),
    display=False,
)

# %% [markdown]
# 10. **The chapters' model, measured.** Drafting runs at {glue:text}`f_meas2:.2f`x plain decoding at `n_draft=2`,
#     {glue:text}`f_meas_best_clause`. In chapter 7's own rounds (another run, so its speeds differ from
#     chapter 6's), `n_draft="auto"` decodes at {glue:text}`f_auto_plain:.2f`x plain decoding and
#     {glue:text}`f_auto:.2f`x the best fixed width of the same rounds; {glue:text}`f_vs_mlx_lm`.
#     {doc}`06_throughput`, {doc}`07_engine`
# 11. **Real widths, measured.** A plain pass through {glue:text}`f_rw_layers` real-width layers takes
#     {glue:text}`f_rw_plain_ms:.0f` ms; a verify pass over two tokens {glue:text}`f_rw_v2_time:.2f`x as long
#     while reading {glue:text}`f_rw_v2_bytes:.2f`x the bytes: this CPU's quantized kernels are
#     {glue:text}`f_rw_bound`, a step at `n_draft=2` costs {glue:text}`f_rw_break_even:.2f` plain passes, {glue:text}`f_rw_verdict`. At
#     these widths qmtp decodes at {glue:text}`f_rw_mlx_lm:.2f`x mlx-lm's speed, both spending most of a token
#     in MLX's CPU quantized product: {glue:text}`f_rw_gap`. {doc}`06_throughput`, {doc}`07_engine`
#
# ## Published elsewhere
#
# *Measured by others, on real hardware and the real model (or its Qwen3.5 sibling), with their own engines; read
# at their sources and never re-measured here ({doc}`08_claims` sets each beside the cost model).*

# %% tags=["hide-input"]
speedups = [row.speedup for row in published.FIELD]
glue("f_pub_runs", len(published.FIELD), display=False)
glue("f_pub_low", min(speedups), display=False)
glue("f_pub_high", max(speedups), display=False)
machines = sorted({row.hardware.split(",")[0] for row in published.FIELD})
glue("f_pub_hardware", ", ".join(machines), display=False)
glue("f_pub_slower", sum(s < 1 for s in speedups), display=False)

# %% [markdown]
# 12. **Published speedups.** {glue:text}`f_pub_runs` published runs of MTP on this model family, one request at
#     a time, went from {glue:text}`f_pub_low:.2f`x to {glue:text}`f_pub_high:.2f`x plain decoding
#     ({glue:text}`f_pub_slower` of them slower than plain), on {glue:text}`f_pub_hardware`. {doc}`08_claims`
# 13. **The cost model, out of sample.** {glue:text}`bl_verdict` Each row below is predicted by a model fitted
#     without any row of its own source; its plain figure calibrates its machine and nothing else. "strict" uses
#     no acceptance of the run itself either; "bytes only" is the speedup of the model that prices a pass by its
#     bytes alone, the one chapters 6 and 8 draw.

# %%
runs = cost_model.table()

# %% tags=["hide-input"]
def percent(value):
    return "-" if value is None else f"{value:+.0%}"


def tokens(value):
    return "not priced" if value is None else f"{value:.1f}"


Markdown(
    inventory.markdown_table(
        [
            dict(
                r,
                width=(
                    "-"
                    if r["n_draft"] is None
                    else f"{r['n_draft']}{' (assumed)' if r['assumed'] else ''}; {r['engine option']}"
                ),
                tps=f"{r['plain tok/s']:.1f} → {r['published tok/s']:.1f}",
                pred=tokens(r["predicted tok/s"]) if r["comparable"] else r["why not"],
                err=f"{percent(r['error'])} ({percent(r['strict error'])})",
                bytes=(
                    "-"
                    if r["bytes-only speedup"] is None
                    else f"{r['bytes-only speedup']:.2f}x vs {r['published speedup']:.2f}x"
                ),
                src=("" if r["checked"] else "as reported in ") + "{cite:p}`%s`" % r["source"],
            )
            for r in runs
        ],
        ["run", "width", "tps", "pred", "err", "bytes", "src"],
    )
    .replace("| width |", "| n_draft; engine's option |", 1)
    .replace("| tps |", "| published tok/s, plain → MTP |", 1)
    .replace("| pred |", "| predicted MTP tok/s |", 1)
    .replace("| err |", "| error (strict) |", 1)
    .replace("| bytes |", "| bytes only, speedup |", 1)
    .replace("| src |", "| source |", 1)
)

# %% tags=["remove-cell"]
glue(
    "bl_sweeps",
    "; ".join(
        f"{s['run']} peaks at n_draft {s['published best']} of {s['widths']}, the model (out of sample) at "
        f"{s['model best']}, and at {t['model best']} with no acceptance of the run itself"
        for s, t in zip(cost_model.sweeps(), cost_model.sweeps(strict=True))
    ),
    display=False,
)

# %% [markdown]
# The sweeps: {glue:text}`bl_sweeps`.
#
# Every number the model fits, and the published figures it was fitted on (the rows of a source are never among
# the data that predicts them):

# %% tags=["hide-input"]
Markdown(
    inventory.markdown_table(
        [
            dict(
                p,
                shown=f"{p['value']:.3g}",
                spread=(
                    "-"
                    if p["range out of sample"] is None
                    else "{:.3g} to {:.3g}".format(*p["range out of sample"])
                ),
            )
            for p in cost_model.fitted_parameters()
        ],
        ["parameter", "shown", "spread", "fitted on"],
    )
    .replace("| shown |", "| value |", 1)
    .replace("| spread |", "| range out of sample |", 1)
)

# %% [markdown]
# ## What only the real weights or an accelerator can settle
#
# - **The real head's acceptance**, at each `n_draft`, and how it falls with the draft position: finding 8 is
#   this book's head's. Needs the real weights ({doc}`real_checkpoint`).
# - **Whether the real head keeps its acceptance at 4 bits**: the tiny head is too small and its task too easy to
#   show it (finding 7). Needs the real weights.
# - **How much the norm mistakes cost the real model**: findings 4 and 5 show which mistakes are silent on the
#   same architecture; their size on the release needs its weights.
# - **Whether MTP pays at the real widths**: {glue:text}`f_rw_disagree`. Settling it needs the real weights on a machine whose passes follow their
#   bytes (an accelerator, or Apple silicon's unified memory); chapter 6's cells time the real model there when
#   `QMTP_MODEL` points at it.
