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
# # 8. The claims, checked
#
# lemon-mlx-engine {cite:p}`lemonmlx`, the MLX engine this project began from, has a model card for this
# model; that card and the reports around it make claims about the model: that it needs two fixes, what its
# conversions weigh, how often its head's drafts are accepted, what a crippled or quantized head costs, what
# MTP buys on an A3B MoE. Each claim is set beside the chapter that tests it. Nothing is
# measured again here: every value below was saved by its chapter when it ran on the same model
# (`qmtp.book.results`), and the verdict is computed from it by the rule written next to the claim in
# `qmtp.book.claims`. The chapter ends with the field: what others have published about MTP on this model,
# beside what the cost model of {doc}`06_throughput` predicts for their machines.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - which of lemon-mlx-engine's claims about this model hold, which do not, and which are not testable here;
# - where each claim comes from and which chapter's measurement judges it;
# - what others measured with MTP on Qwen3.5/3.6-35B-A3B, and where the cost model agrees with them.
#
# **What runs here.** Nothing is measured again: the chapter reads what chapters 1 to 7 saved (`qmtp.book.results`)
# for the same model and applies the rule written beside each claim in `qmtp.book.claims`; the published
# figures come from `qmtp.book.published`, each with its source. The chapter's run time
# in this build is in the {doc}`execution table <../book/execution>`; the download button at the top of the
# page gives this notebook, to run it yourself.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown
from myst_nb import glue
from qmtp.book import claims, cost_model, inventory, outside_build, published, results, throughput

path = inventory.model_path()
print(inventory.describe(path))
saved = {chapter: results.load(chapter, path) for chapter in claims.CHAPTERS}
real_model = claims.is_real_model(qmtp.ModelConfig.from_file(path))
rows = claims.check(saved, real_model)


def cites(keys):
    return ", ".join(f"{{cite:t}}`{k}`" for k in keys)


def chapter(name):
    return f"{{doc}}`{int(name[:2])} <{name}>`"


# %% [markdown]
# ## One rule for the verdicts
#
# A claim about the real model's numbers (how often its head's drafts are accepted, its {term}`acceptance`;
# what quantizing the head costs; what MTP buys) is judged only on the real model. On any other model its
# verdict is *not testable here*, and what that model shows is written in its own column, "indicates": a
# direction, never a verdict. The bundled tiny model has the real architecture but not the real weights, so
# it can judge claims about the architecture's behaviour (what each fix does, what dropping the head's
# experts does) and the real config's arithmetic (what a conversion weighs), and nothing about the real
# weights' numbers. A claim *holds in part* when it joins two statements and only one holds.

# %% tags=["hide-input"]
glue(
    "model_kind",
    "the real Qwen3.6-35B-A3B" if real_model else "the bundled tiny model",
    display=False,
)
Markdown(
    inventory.markdown_table(
        [
            dict(
                r,
                chapter=chapter(r["chapter"]),
                indicates=r["indicates"] or "(judged directly)",
            )
            for r in rows
        ],
        ["claim", "chapter", "verdict", "measured", "indicates"],
    ).replace("| indicates |", "| indicates (a direction, not a verdict) |", 1)
)

# %% tags=["hide-input"]
verdicts = [r["verdict"] for r in rows]
glue("n_claims", len(rows), display=False)
glue("n_hold", verdicts.count(claims.HOLDS), display=False)
glue("n_partly", verdicts.count(claims.PARTLY), display=False)
glue("n_fail", verdicts.count(claims.FAILS), display=False)
glue("n_untested", verdicts.count(claims.UNTESTABLE), display=False)
glue(
    "failed_claims",
    "; ".join(f'"{r["claim"]}"' for r in rows if r["verdict"] == claims.FAILS)
    or "none",
    display=False,
)
glue(
    "partly_claims",
    "; ".join(f'"{r["claim"]}"' for r in rows if r["verdict"] == claims.PARTLY)
    or "none",
    display=False,
)

# %% [markdown]
# Measured on {glue:text}`model_kind`, {glue:text}`n_claims` claims. Holds: {glue:text}`n_hold`. Holds in
# part: {glue:text}`n_partly` ({glue:text}`partly_claims`). Does not hold: {glue:text}`n_fail`
# ({glue:text}`failed_claims`). Not testable here: {glue:text}`n_untested`.
#
# ## Why each verdict, and where each claim comes from

# %% tags=["hide-input"]
Markdown(
    inventory.markdown_table(
        [dict(r, cite=cites(r["cite"])) for r in rows], ["claim", "why", "cite"]
    ).replace("| cite |", "| sources |", 1)
)

# %% [markdown]
# ## MTP's speedup: a prediction, a measurement and a rule
#
# Two chapters speak to the claim "{glue:text}`speedup_claim`", and they seem to disagree.

# %% tags=["hide-input"]
ch6 = saved["06_throughput"]
width = ch6.get("real_width_summary", {})
predicted = ch6["predicted_moe_4bit"]
best_n = max(predicted, key=predicted.get)
pays = width.get("break_even_n_draft_2", 0) < 2
bound = width.get("compute_bound", True)
glue("speedup_claim", claims.CLAIMS["speedup_moe"].text, display=False)
glue("cm_best", predicted[best_n], display=False)
glue("cm_best_n", int(best_n), display=False)
glue(
    "rw_where",
    (
        "the real model"
        if width.get("measured_on") == "real model"
        else f"{width.get('layers', 0)} layers built at the real widths"
    ),
    display=False,
)
glue("rw_v2_time", width.get("verify2_time_over_plain", float("nan")), display=False)
glue("rw_v2_bytes", width.get("verify2_bytes_over_plain", float("nan")), display=False)
glue("rw_break_even", width.get("break_even_n_draft_2", float("nan")), display=False)
glue(
    "rw_verdict",
    f"so drafting {'can' if pays else 'cannot'} pay on this machine at the real widths",
    display=False,
)
glue(
    "rw_machine",
    (
        "this machine is not one (a quantized product here costs time per row, not "
        "per byte)"
        if bound
        else "this machine comes close to one"
    ),
    display=False,
)
glue(
    "ran_on",
    (
        "On the real model, on this machine"
        if real_model
        else "On the bundled model, where a pass costs what it dispatches,"
    ),
    display=False,
)
glue("tiny_best", max(ch6["measured_speedup"].values()), display=False)
glue(
    "speedup_rule",
    (
        "the verdict above follows this machine's measurement of the real model, and "
        "the field below says what other machines do"
        if real_model
        else "by the rule the claim is not testable here, and what exists to test it "
        "is what others published, next"
    ),
    display=False,
)

# %% [markdown]
# {doc}`06_throughput` predicts, from the bytes each pass of the real config reads, that on a machine where a
# pass costs its bytes MTP gains {glue:text}`cm_best:.2f`x at best (`n_draft` = {glue:text}`cm_best_n`, a 4-bit
# trunk and the head in bf16).
# The same chapter timed passes at the real widths on this machine ({glue:text}`rw_where`): a verify pass over
# two tokens took {glue:text}`rw_v2_time:.2f`x a plain pass's time for {glue:text}`rw_v2_bytes:.2f`x its
# bytes, and a step at `n_draft=2` costs {glue:text}`rw_break_even:.2f` plain passes,
# {glue:text}`rw_verdict`. {glue:text}`ran_on` drafting gains {glue:text}`tiny_best:.2f`x at best. These do
# not contradict each other, and the prediction is no verdict: it is arithmetic for a memory-bound machine,
# and the real-width measurement shows that {glue:text}`rw_machine`. So {glue:text}`speedup_rule`.
#
# ## The field beside the cost model
#
# Published measurements of MTP on Qwen3.5/3.6-35B-A3B, one request at a time, from `qmtp.book.published`.
# Every row is a figure someone else measured, not this book; a row known only from a second-hand account,
# not checked at its original source, is marked "as reported in" (unverified). The engines count draft length differently; this book counts the
# tokens one trunk pass verifies, the trunk's own included. Each engine's option, and the value of it that
# gives `n_draft` 1 to 4 ("→ 2" is `n_draft=2`):

# %% tags=["hide-input"]
conversions = published.conversion_table(range(1, 5))
Markdown(
    inventory.markdown_table(
        [
            dict(
                {k.replace("n_draft=", "→ "): v for k, v in r.items()},
                option=f"`{r['option']}`",
            )
            for r in conversions
        ],
        ["engine", "option"]
        + [
            k.replace("n_draft=", "→ ")
            for k in conversions[0]
            if k.startswith("n_draft")
        ],
    )
)

# %% [markdown]
# so {term}`n_draft` = 2 is one {term}`draft` of the {term}`head` per step. This section sets each row beside
# the bytes-only model, the bound that chapter 6 draws; the calibrated model that the findings' bottom line rests
# on, which reads each machine's plain figure, is tested on the same rows in {doc}`findings`:
# {glue:text}`calibrated_verdict` For each row, the bytes-only model
# (`published.predict`) prices a step from the bytes it reads at the row's memory bandwidth (the peak of the
# memory that holds the weights, from its bus width and transfer rate), its width and context. It is the one
# prediction that {doc}`06_throughput` and {doc}`findings` use (`throughput.machine_prediction`): the head
# in bf16, no fixed cost per pass, and {glue:text}`acceptance_rule`. With a row's own acceptance $a$, a step
# yields $1 + (n_\text{draft} - 1)\,a$ {term}`tokens per pass`, since these engines propose every draft of a
# step. A source that gives no draft length is priced at `n_draft=2`, and the row says so. A row whose
# weights sit partly in system memory is not priced: {glue:text}`offload_reason`.

# %% tags=["hide-input"]
field = published.field_table()
glue("acceptance_rule", throughput.acceptance_rule(), display=False)
glue("offload_reason", published.CONDITIONS["partial_offload"], display=False)
glue("calibrated_verdict", cost_model.verdict(), display=False)
glue("calibrated_c", cost_model.fitted_without(None)[0], display=False)


def run(r):
    return f"{r['engine']}, {r['hardware']} ({r['GB/s']:.0f} GB/s)"


def source(r):
    return ("" if r["checked"] else "as reported in ") + "{cite:p}`%s`" % r["source"]


Markdown(
    inventory.markdown_table(
        [
            dict(
                r,
                run=run(r),
                tps=f"{r['plain tok/s']:.1f} → {r['MTP tok/s']:.1f}",
                src=source(r),
                published=r["published speedup"],
                model=(
                    f"{r['predicted speedup']:.2f}x"
                    if r["comparable"]
                    else "not comparable"
                ),
            )
            for r in field
        ],
        ["run", "n_draft", "acceptance", "context", "tps", "published", "model", "src"],
        {"published": "{:.2f}x"},
    )
    .replace("| tps |", "| tok/s, plain → MTP |", 1)
    .replace("| src |", "| source |", 1)
    .replace("| model |", "| bytes-only model |", 1)
)

# %% tags=["hide-input"]
priced = [r for r in field if r["comparable"]]
agree = [r for r in priced if published.agrees(r["prediction"])]
shares = [r["plain share"] for r in priced]
by_key = {r["key"]: r for r in field}
short, long = by_key["rocm_vllm_strix_halo_128"], by_key["rocm_vllm_strix_halo_4096"]
glue("field_n", len(field), display=False)
glue("field_priced", len(priced), display=False)
glue("field_agree", len(agree), display=False)
glue("field_share_low", min(shares), display=False)
glue("field_share_high", max(shares), display=False)
glue("field_tol", published.AGREES, display=False)
glue("field_low", min(r["published speedup"] for r in field), display=False)
glue("field_high", max(r["published speedup"] for r in field), display=False)
glue("short_context", short["context"], display=False)
glue("long_context", long["context"], display=False)
glue("short_published", short["published speedup"], display=False)
glue("long_published", long["published speedup"], display=False)
glue("short_predicted", short["predicted speedup"], display=False)
glue("long_predicted", long["predicted speedup"], display=False)
real = qmtp.config.QWEN36_35B_A3B
glue(
    "kv_every",
    real.num_hidden_layers // real.layer_types.count(qmtp.config.FULL),
    display=False,
)
glue("kv_heads", real.num_key_value_heads, display=False)
glue("ch6_context", throughput.DEFAULT_CONTEXT, display=False)

# %% [markdown]
# "published" is the source's speedup, MTP over plain tokens/s; "bytes-only model" is its prediction for the row;
# "context" the tokens in the cache while decoding, as the row is priced (prompt and half the output), which
# is why a row at the same bandwidth as {doc}`06_throughput`'s {glue:text}`ch6_context`-token example need
# not give the same number. The published speedups run from {glue:text}`field_low:.2f`x to
# {glue:text}`field_high:.2f`x. Of the {glue:text}`field_n` rows, the bytes-only model prices
# {glue:text}`field_priced`, and in {glue:text}`field_agree` of those its speedup is within
# {glue:text}`field_tol:.0%` of the published one. Where they agree, it is in the ratio, not in speed: on the
# rows it prices, the engines' plain decoding reached {glue:text}`field_share_low:.0%` to
# {glue:text}`field_share_high:.0%` of what the bandwidth allows ("plain bound" below), so their passes take
# longer than bytes over bandwidth. That the ratio still agrees on some rows is not because a verify pass
# costs what its bytes say: the calibrated model of {doc}`findings` finds that each extra draft position pays
# about {glue:text}`calibrated_c:.0%` of a plain pass's time beyond its bytes again, the rest being paid once
# per pass. Where the two part, the row says why:

# %% tags=["hide-input"]
Markdown(
    inventory.markdown_table(
        [dict(r, row=f"{run(r)}, n_draft {r['n_draft']}") for r in field],
        ["row", "plain bound tok/s", "why"],
        {"plain bound tok/s": "{:.0f}"},
    )
)

# %% [markdown]
# One disagreement isolates a cause: one engine on one machine with two prompt lengths. About
# {glue:text}`short_context` tokens in context it gains {glue:text}`short_published:.2f`x, about
# {glue:text}`long_context` it runs at {glue:text}`long_published:.2f`x, where the bytes-only model predicts
# {glue:text}`short_predicted:.2f`x and {glue:text}`long_predicted:.2f`x. In bytes the longer context hardly
# matters to this model (one layer in {glue:text}`kv_every` keeps a KV cache, with {glue:text}`kv_heads` KV
# heads), so what the longer
# prompt adds is attention's arithmetic over the context, once for every token a verify pass holds: a cost
# the memory-bound model does not count. With several requests batched, vllm-mlx switches MTP off altogether
# {cite:p}`vllmmlx245`: a batch already gives every pass several tokens, which is all that drafting would add.
# The speedup claim is therefore a claim about GPUs and APUs, where a wider pass adds its bytes and about
# {glue:text}`calibrated_c:.0%` of a plain pass's overhead per extra position, so a step shares the rest among
# its tokens; this CPU, at the real widths, is not such a machine: there a wider pass costs far more than its
# bytes add.
#
# ## Unverified, measured outside this build: acceptance on the bundled model
#
# One more figure concerns this book's own bundled model, and it is neither published nor reproducible from this
# book: its authors ran lemon-mlx-engine and qmtp on the same 8-bit conversion of the bundled model, on the same
# prompts, outside this build {cite:p}`qmtplemon2026`. No published record or script backs it, so it is
# unverified and is no evidence for any verdict above; it is shown as a lead to check. lemon-mlx-engine resets its head's KV
# cache every step and feeds the head the trunk's state before the final norm; qmtp keeps the cache and feeds
# the state after it ({doc}`05_mtp_decoding`). The last row is this build's own measurement, from chapter 5,
# on the model as that chapter decodes it (not the 8-bit file).

# %% tags=["hide-input"]
outside = [
    dict(
        r,
        acceptance=f"{r['acceptance'][0]:.2f}-{r['acceptance'][1]:.2f}",
        by=f"{outside_build.MEASURED_BY}, unverified, {{cite:p}}`{r['source']}`",
    )
    for r in outside_build.ON_BUNDLED
]
here = {
    "engine": "qmtp (head's cache kept, post-norm state)",
    "n_draft": 2,
    "acceptance": f"{saved['05_mtp_decoding']['acceptance']['2']:.2f}",
    "by": f"measured here, {chapter('05_mtp_decoding')}",
}
Markdown(
    inventory.markdown_table(
        outside + [here], ["engine", "n_draft", "acceptance", "by"]
    ).replace("| by |", "| measured by |", 1)
)

# %% tags=["hide-input"]
_ = results.save(  # the path it returns is not for the reader
    "08_claims",
    path,
    {
        "verdicts": {r["key"]: r["verdict"] for r in rows},
        "counts": {v: verdicts.count(v) for v in claims.VERDICTS},
        "field": {
            "rows": len(field),
            "agree_within": published.AGREES,
            "agree": len(agree),
            "published_speedup": [
                min(r["published speedup"] for r in field),
                max(r["published speedup"] for r in field),
            ],
            "plain_share": [min(shares), max(shares)],
        },
    },
)

# %% [markdown]
# ## Exercises
#
# Each runs on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Run chapters 1 to 8 with `QMTP_MODEL` pointing at a converted folder (exercise 2 of {doc}`01_anatomy`).
#
#    *Where the answer shows:* the verdict column under *One rule for the verdicts* is recomputed for that
#    model; claims about the real model's numbers stay *not testable here* on any model but the real one.
#
# 2. Make a rule stricter: edit the threshold of one claim in `qmtp/book/claims.py` and rerun this chapter only.
#
#    *Where the answer shows:* the verdict of that claim under *One rule for the verdicts* and the count of
#    claims that hold in the sentence under it.
#
# 3. Add a published run to `qmtp/book/published.py` (`FIELD`), with its source in `book/references.bib`, and
#    rerun this chapter.
#
#    *Where the answer shows:* a new row in *The field beside the cost model*, with the cost model's
#    prediction for its bandwidth and acceptance beside it.
