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
# # 5. Decoding with the MTP head
#
# The head guesses the token after next; the trunk checks the guesses. One step: from the trunk's state
# after its last accepted token, the head drafts `k` = `n_draft` - 1 tokens; one trunk pass over the
# pending token and the drafts gives the trunk's own choice after each; the longest prefix of drafts the
# trunk agrees with is kept, plus the trunk's next token; every cache is cut back to what was kept.
# Greedy output is therefore exactly plain greedy output, only produced in fewer trunk passes
# {cite}`leviathan2023speculative`.
#
# The code follows the same four steps: `qmtp.decoding.step` calls `draft`, `verify`, each row's acceptance
# strategy's `accept` (`qmtp.acceptance`: `Greedy`, `Coupled` or `Rejection`) and `roll_back`, and
# `qmtp.continuous.ContinuousBatch` runs one such step per trunk pass over its rows: `qmtp.generate` is a batch of
# one row, `generate_batch` and the server a batch of many.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - one step of speculative decoding with the MTP head as drafter: draft, verify in one trunk pass, keep
#   the agreed prefix plus the trunk's token, cut every cache back;
# - why greedy output is exactly plain greedy output (checked live on held-out prompts);
# - how acceptance falls with each further draft position, by register, and without parts of the head;
# - what other engines' choices cost in acceptance (the head's cache reset every step, its input before the
#   trunk's final norm, chained drafts on its pre-norm output), which state the real head expects, and
#   acceptance under sampling at temperatures 0.6 and 1.0;
# - acceptance per draft position under the chat template, as users meet the model, with the model card's
#   samplers, thinking on and off, beside greedy.
#
# **What runs here.** The bundled model decodes held-out prompts plainly and with `n_draft` 2 to 5; every
# rate is counted in this run. The chapter's run time in this build, and the machine it ran on, are in the
# {doc}`execution table <../book/execution>`; the download button at the top of the page gives this
# notebook, to run it yourself.
#
# **At full size** ({doc}`the budget <real_checkpoint>`): {glue:md}`budget_note`
# :::

# %% tags=["hide-input"]
import math
import textwrap

import qmtp
from IPython.display import Markdown, display
from myst_nb import glue
from qmtp import mtp
from qmtp.book import budget, evaluate, inventory, machine, outside_build, plots
from qmtp.book import results
from qmtp.book import widgets

path = inventory.model_path()
print(inventory.describe(path))
config = qmtp.ModelConfig.from_file(path)
FULL = budget.active(config)  # the full-size release (qmtp.book.budget)
glue("budget_note", Markdown(budget.plan("05_mtp_decoding")), display=False)
model = qmtp.load(budget.decoding_model(path))
texts = evaluate.heldout_by_register(2)
ONLY = budget.DECODE["prompts"] if FULL else None  # prompts used: all, or the budget's
prompts = evaluate.heldout_prompts(model, 2)[:ONLY]
MAX_TOKENS = budget.DECODE["max_tokens"] if FULL else 40
N_DRAFTS = budget.DECODE["n_drafts"] if FULL else (2, 3, 4, 5)

# %% [markdown]
# ## One step, in the code
#
# A step is a function of arrays: the caches, the offset, the trunk states of the last pass and the number of its
# positions kept are inputs, the same things after the step are outputs. It is compiled once per draft length and
# replayed; the host reads only the step's report (the tokens and how many were kept), once per trunk pass. It
# calls four functions, one per named step.
#
# **Draft.** The head first reads the positions the last pass kept (each trunk state with the token after
# it); from its state at the last one it drafts, then feeds itself its own output and its own draft:
#
# ```{literalinclude} ../qmtp/decoding.py
# :pyobject: draft
# :language: python
# ```
#
# **Verify.** One trunk pass scores the pending token and every draft, recording each linear-attention layer's
# state after every position (for the roll back):
#
# ```{literalinclude} ../qmtp/decoding.py
# :pyobject: verify
# :language: python
# ```
#
# **Accept.** Under greedy decoding a draft is kept while it equals the trunk's own choice, and the trunk's choice
# after the last kept token is the next pending token. The count is computed on the device, so nothing waits for
# the host:
#
# ```{literalinclude} ../qmtp/acceptance.py
# :pyobject: Greedy.accept
# :language: python
# :dedent: 4
# ```
#
# Sampling replaces these argmaxes by argmaxes of the log-probabilities plus Gumbel noise made from the
# {term}`random seed` (the random generator's starting value, so that a sampled run can be repeated) and the
# position (`Coupled.accept`; Leviathan et al.'s rejection sampling, `Rejection.accept`, is the other choice),
# whose tokens have the distribution of sampling the trunk alone (*Acceptance under sampling*, below).
#
# **Roll back.** Attention needs nothing: the offset advances by the kept tokens, and the entries past it
# are masked and later overwritten. A linear-attention layer has one state, not one entry per position, so
# the step keeps the state the verify pass recorded after the last kept token:
#
# ```{literalinclude} ../qmtp/decoding.py
# :pyobject: roll_back
# :language: python
# ```
#
# ```{literalinclude} ../qmtp/decoding.py
# :pyobject: keep_prefix
# :language: python
# ```
#
# **The step.** `step` calls the four in that order (`draft`, `verify`, `strategy.accept`, `roll_back`), and
# builds the next step's inputs and the report:
#
# ```{literalinclude} ../qmtp/decoding.py
# :pyobject: step
# :language: python
# ```
#
# Two things in it serve cases met later, and do nothing in plain greedy decoding:
#
# - **penalty counts** (`history`, `counts`): the model card's chat samplers add a presence penalty, which lowers
#   the score of every token already generated. Each draft and each verified position must then be scored with
#   the counts of the tokens before it (the pending token and the drafts before it included), so the step carries
#   the counts in its state and keeps those of the kept prefix, as it keeps the caches (*Acceptance under the chat
#   template*, below);
# - **finite flags** (`finite`, and the `finite` list of `draft`): the number of leading verified positions whose
#   logits are all finite, and for each draft whether the head's logits were. A kept token chosen from NaN or
#   Inf means damaged weights, such as {doc}`04_quantizing`'s faulty 6-bit kernel; the host learns it in the same
#   read as the tokens, so the check costs no extra wait.

# %% [markdown]
# ## A worked example
#
# Each row is one trunk pass at `n_draft=3`: the head's drafts that the trunk accepted, the first one it
# rejected, and the token the trunk adds itself. {glue:md}`demo_text_note` Here the story matters less than
# the colours: how many drafts each pass keeps; the text itself is plain greedy decoding's, token for token
# (checked next).

# %% mystnb={"figure": {"caption": "The worked example, one row per trunk pass at n_draft 3: {glue:text}`ex_tokens` tokens in {glue:text}`ex_passes` passes after the prefill, {glue:text}`ex_accepted` of the head's {glue:text}`ex_proposed` drafts accepted (green), the first draft rejected in a pass struck out (red), and the trunk's own token ending each pass (blue).", "name": "fig-worked-example"}}
example = qmtp.generate(
    model,
    "Once upon a time, a little fox named",
    max_tokens=MAX_TOKENS if FULL else 36,
    n_draft=3,
)
fig = plots.speculative_steps(example, model.tokenizer)

# %% tags=["remove-cell"]
example_passes = plots.shown_passes(example)
glue("ex_tokens", len(example.tokens), display=False)
glue("demo_text_note", Markdown(evaluate.generated_text_note(config, FULL)), display=False)
glue("ex_passes", len(example_passes), display=False)
glue("ex_accepted", sum(len(a) for a, _, _ in example_passes), display=False)
proposed = sum(len(a) + (r is not None) for a, r, _ in example_passes)
glue("ex_proposed", proposed, display=False)

# %% [markdown]
# ## Lossless, checked live
#
# For every prompt and every `n_draft` from 2 to 5, the speculative output is compared token by token
# with plain greedy decoding.

# %%
mismatches = 0
for prompt in prompts:
    plain = qmtp.generate(model, prompt, max_tokens=MAX_TOKENS).tokens
    for n in N_DRAFTS:
        mismatches += qmtp.generate(model, prompt, max_tokens=MAX_TOKENS, n_draft=n).tokens != plain
assert mismatches == 0

# %% tags=["remove-cell"]
glue("lossless_checks", len(N_DRAFTS) * len(prompts), display=False)
glue("lossless_mismatches", mismatches, display=False)

# %% [markdown]
# {glue:text}`lossless_checks` speculative runs, {glue:text}`lossless_mismatches` different from plain
# greedy decoding.
#
# ## Acceptance as the drafts grow longer
#
# A draft at position `i` is proposed only when the drafts before it were accepted; its acceptance is
# counted over those occasions. The book counts {term}`acceptance` one way, drafts kept over drafts proposed,
# and says at each figure and table which reading it shows: per draft position, or all drafts together
# (overall). The tokens a pass yields are a different quantity, {term}`tokens per pass`.

# %% mystnb={"figure": {"caption": "Left: acceptance at each draft position, one line per n_draft, nudged sideways so that none hides another: the first draft is accepted {glue:text}`acc_n2:.2f` of the time at n_draft 2, the second {glue:text}`acc_n3_second:.2f` of the times it is proposed at n_draft 3. Right: tokens per trunk pass, from {glue:text}`tpp_n2:.2f` at n_draft 2 to {glue:text}`tpp_n5:.2f` at {glue:text}`n_wide`.", "name": "fig-acceptance-position"}}
by_n = {
    n: evaluate.acceptance(model, prompts, n_draft=n, max_tokens=MAX_TOKENS)
    for n in N_DRAFTS
}
fig = plots.acceptance_by_position(by_n)

# %% tags=["remove-cell"]
glue("acc_n2", by_n[2]["rate"], display=False)
glue("acc_n3_second", by_n[3]["per_position"][1], display=False)
glue("tpp_n2", by_n[2]["tokens_per_trunk_pass"], display=False)
glue("tpp_n5", by_n[N_DRAFTS[-1]]["tokens_per_trunk_pass"], display=False)
glue("n_wide", N_DRAFTS[-1], display=False)

# %% [markdown]
# At `n_draft=2` the trunk accepts {glue:text}`acc_n2:.2f` of the head's drafts, so each trunk pass
# yields {glue:text}`tpp_n2:.2f` tokens; a second draft, made from the head's own output rather than a
# trunk state, is accepted {glue:text}`acc_n3_second:.2f` of the times it is proposed. At `n_draft` =
# {glue:text}`n_wide` a pass yields {glue:text}`tpp_n5:.2f` tokens.
#
# ## A head trained on its own drafts
#
# A head trained only on the trunk's true states has never seen its own output as input, yet from the
# second draft on that is all it gets. The bundled head was trained a second time, alone, with the trunk
# frozen: unrolled four steps, step 1 on the trunk's states and steps 2 to 4 on its own outputs, each step's
# attention reading the keys its cache holds when it drafts, every step scored against the trunk's own
# next-token distribution (`python -m qmtp.tiny.train --head-only`; the model card gives the command and the
# loss). The head it started from is kept beside the model (`evaluate.previous_head`). Both heads run on
# the same prompts, interleaved prompt by prompt, so that the shared machine's slow spells hit them alike.

# %%
previous = evaluate.previous_head(model)
compared = None
if previous is not None:  # kept beside the bundled model only
    heads = {"previous head": previous, "chained-trained head": None}
    compared = evaluate.compare_heads(model, heads, prompts, max_tokens=MAX_TOKENS)
    display(Markdown(evaluate.head_comparison_table(compared)))

# %% tags=["remove-cell"]
head_glue = dict.fromkeys(["old_n3_first", "new_n3_first", "old_n3_second", "new_n3_second", "old_tpp_n4",
                           "new_tpp_n4", "speed_ratio_n4", "speed_ratio_n5"], float("nan"))
if compared is not None:
    old, new = compared["previous head"], compared["chained-trained head"]
    head_glue = {
        "old_n3_first": old[3]["per_position"][0], "new_n3_first": new[3]["per_position"][0],
        "old_n3_second": old[3]["per_position"][1], "new_n3_second": new[3]["per_position"][1],
        "old_tpp_n4": old[4]["tokens_per_trunk_pass"], "new_tpp_n4": new[4]["tokens_per_trunk_pass"],
        "speed_ratio_n4": new[4]["speed_ratio_to_first"], "speed_ratio_n5": new[5]["speed_ratio_to_first"],
    }
else:
    print(f"{path} keeps no previous head: the comparison needs the bundled model")
for name, value in head_glue.items():
    glue(name, value, display=False)

# %% [markdown]
# At `n_draft=3` the first draft is accepted {glue:text}`old_n3_first:.2f` of the time with the previous
# head and {glue:text}`new_n3_first:.2f` with the retrained one; the second, {glue:text}`old_n3_second:.2f`
# and {glue:text}`new_n3_second:.2f`. At `n_draft=4` a trunk pass yields {glue:text}`old_tpp_n4:.2f`
# tokens with the previous head and {glue:text}`new_tpp_n4:.2f` with the new one. Decode speed with the
# new head, over the previous one's (median of the interleaved pairs): {glue:text}`speed_ratio_n4:.2f` at
# `n_draft=4`, {glue:text}`speed_ratio_n5:.2f` at 5. Each trunk pass costs about the same whichever head
# drafted for it, so the speed follows the tokens per pass, less the head's own extra drafting work; single
# timings on a shared CPU are noisy, and the measurement of speed proper is the benchmark,
# `python -m qmtp bench mtp`.
#
# ## By register
#
# A register is a kind of text, with its own vocabulary and habits: the generated corpus mixes
# {glue:text}`registers` (`qmtp.tiny.corpus`), which differ in how predictable the next token is, from
# counting and the alphabet to open-ended stories. Each held-out document's first tokens are a prompt; the
# head drafts for the continuation ({numref}`fig-by-register`).

# %% mystnb={"figure": {"caption": "Acceptance at n_draft 2 by register of the held-out prompts: highest for {glue:text}`best_register` ({glue:text}`best_register_acc:.2f`), lowest for {glue:text}`worst_register` ({glue:text}`worst_register_acc:.2f`).", "name": "fig-by-register"}}
per_register = {}
for register, docs in texts.items():
    register_prompts = evaluate.prompts_from(docs, model)[:ONLY]
    per_register[register] = evaluate.acceptance(
        model, register_prompts, n_draft=2, max_tokens=MAX_TOKENS
    )["rate"]
fig = plots.bars(
    list(per_register),
    list(per_register.values()),
    "acceptance at n_draft=2",
    xlabel="register of the prompt",
)

# %% tags=["remove-cell"]
best_register = max(per_register, key=per_register.get)
worst_register = min(per_register, key=per_register.get)
glue("registers", ", ".join(texts), display=False)
glue("best_register", best_register, display=False)
glue("best_register_acc", per_register[best_register], display=False)
glue("worst_register", worst_register, display=False)
glue("worst_register_acc", per_register[worst_register], display=False)

# %% [markdown]
# ## Ablations: what the head needs
#
# The same prompts, `n_draft=2`, with the head as crippled conversions ship it (no routed experts,
# shared expert only), with its weights rounded to fewer bits, and fed the trunk's state before the
# final norm instead of after it.

# %% mystnb={"figure": {"caption": "Acceptance at n_draft 2 with parts of the head taken away: {glue:text}`acc_n2:.2f` for the complete head, {glue:text}`acc_no_experts:.2f` without its routed experts, {glue:text}`acc_head8:.2f` with its weights rounded to 8 bits, {glue:text}`acc_head4:.2f` to 4 bits and {glue:text}`acc_head3:.2f` to 3 bits, {glue:text}`acc_prenorm:.2f` fed the pre-norm state.", "name": "fig-ablation"}}
variants = {
    "complete head, bf16": dict(),
    "no routed experts": dict(head=mtp.without_routed_experts(model.mtp)),
    "head weights 8-bit": dict(head=mtp.with_weight_bits(model.mtp, 8)),
    "head weights 4-bit": dict(head=mtp.with_weight_bits(model.mtp, 4)),
    "head weights 3-bit": dict(head=mtp.with_weight_bits(model.mtp, 3)),
    "pre-norm hidden state": dict(hidden="pre"),
}
if FULL:
    variants = {
        label: options
        for label, options in variants.items()
        if label in budget.DECODE["ablations"]
    }
ablation = {
    label: evaluate.acceptance(
        model, prompts, n_draft=2, max_tokens=MAX_TOKENS, **options
    )["rate"]
    for label, options in variants.items()
}
fig = plots.bars(list(ablation), list(ablation.values()), "acceptance at n_draft=2", xlabel="head as run")

# %% tags=["remove-cell"]
glue("acc_no_experts", ablation["no routed experts"], display=False)
glue("acc_prenorm", ablation["pre-norm hidden state"], display=False)
glue("acc_head8", ablation["head weights 8-bit"], display=False)
glue("acc_head4", ablation["head weights 4-bit"], display=False)
glue("acc_head3", ablation["head weights 3-bit"], display=False)

# %% [markdown]
# Without its routed experts the head's drafts are accepted {glue:text}`acc_no_experts:.2f` of the time,
# against {glue:text}`acc_n2:.2f` for the complete head; fed the pre-norm state,
# {glue:text}`acc_prenorm:.2f`.
#
# ## Engines' choices, as ablations
#
# The engines that run this head made different choices, and each is an option of qmtp's own decoding, so
# what it costs in acceptance is measured here on the same model and prompts:
#
# - the head's KV cache kept from step to step (vLLM {cite:p}`vllmmtp`, qmtp) or emptied at every step, as
#   lemon-mlx-engine does {cite:p}`lemonmlx` (`generate(..., engine=qmtp.Engine(head_cache="reset"))`: the head then attends only to
#   the position it drafts from and its own chained drafts);
# - the trunk's state fed to the head after its final norm or before it (`hidden="pre"`, as lemon-mlx-engine
#   feeds it);
# - a chained draft fed the head's own output after its final norm or before it (`chain="pre"`, as
#   ik_llama.cpp did until {cite:p}`ikllama1815`).
#
# Each runs at `n_draft=2` (the first draft) and `n_draft=3` (the second draft, proposed when the first was
# accepted); the last option touches only the second.

# %% mystnb={"figure": {"caption": "Acceptance of the first draft (n_draft 2) and of the second (n_draft 3) with each engine's choice, on the same prompts: {glue:text}`ch_default_first:.2f` and {glue:text}`ch_default_second:.2f` with the head's cache kept and post-norm inputs, {glue:text}`ch_reset_first:.2f` and {glue:text}`ch_reset_second:.2f` with its cache reset every step, {glue:text}`ch_pre_first:.2f` and {glue:text}`ch_pre_second:.2f` fed the pre-norm trunk state, {glue:text}`ch_lemon_first:.2f` and {glue:text}`ch_lemon_second:.2f` with both (cache reset and pre-norm state, as lemon-mlx-engine runs), {glue:text}`ch_chain_first:.2f` and {glue:text}`ch_chain_second:.2f` with the second draft chained on the head's pre-norm output (the first draft is not chained, so only the second can differ).", "name": "fig-engine-choices"}}
WIDTHS = (2, 3)
choices = {
    label: {
        n: evaluate.acceptance(
            model, prompts, n_draft=n, max_tokens=MAX_TOKENS, **options
        )
        for n in WIDTHS
    }
    for label, options in evaluate.ENGINE_CHOICES.items()
}
first = {label: c[2]["rate"] for label, c in choices.items()}
second = {label: c[3]["per_position"][1] for label, c in choices.items()}
fig = plots.grouped_bars(
    [textwrap.fill(label, 13, break_on_hyphens=False) for label in choices],
    {
        "first draft (n_draft=2)": list(first.values()),
        "second draft (n_draft=3)": list(second.values()),
    },
    "acceptance",
    xlabel="drafting as run",
)

# %% tags=["remove-cell"]
names = dict(zip(["default", "reset", "pre", "lemon", "chain"], choices))
for short, label in names.items():
    glue(f"ch_{short}_first", first[label], display=False)
    glue(f"ch_{short}_second", second[label], display=False)

# %% [markdown]
# Emptying the head's cache every step takes its first draft from {glue:text}`ch_default_first:.2f` to
# {glue:text}`ch_reset_first:.2f`: {glue:text}`reset_verdict`. Chaining the second draft on the head's output
# before its final norm gives {glue:text}`ch_chain_second:.2f` against {glue:text}`ch_default_second:.2f`,
# {glue:text}`chain_verdict`; on the real Qwen3.6-35B-A3B the same mistake made every draft beyond the first
# lose speed in ik_llama.cpp {cite:p}`ikllama1815`.
#
# **Which state the real head expects.** The reference implementations feed the head the trunk's state after
# its final norm, the tensor lm_head scores (vLLM {cite:p}`vllmmtp`; mlx-vlm {cite:p}`mlxvlm`), and the two
# published measurements this book found that compare the two states on one engine and model of this family both
# favour it: llama.cpp's acceptance on Qwen3.6, prompt by prompt, rose when it switched to the post-norm state
# {cite:p}`llamacpp24025`, and LightLLM's "accept length" on Qwen3.5-0.8B went from 1.80 to 2.74
# {cite:p}`lightllm1402` (tokens per step, this book's {term}`tokens per pass`, not an acceptance rate). Those
# two comparisons are all this book found; they do not show what the choice costs on every engine. Others feed
# the pre-norm state (lemon-mlx-engine; vllm-mlx since {cite:p}`vllmmlx660`,
# which argues from the head's own input norm and reports no measurement). This book feeds the post-norm state.
# The tiny model cannot settle it: {glue:text}`prepost_verdict`. The head normalises what it is fed, and the
# final norm is an RMSNorm, so pre- and post-norm inputs differ only through the final norm's weight of each
# channel: on the tiny model those weights spread by {glue:text}`norm_spread:.2f` (standard deviation over
# mean magnitude) and the head's two inputs have a cosine of {glue:text}`prepost_cosine:.3f` on average
# (lowest {glue:text}`prepost_cosine_min:.3f`). How far apart they are on the real model, and what that costs,
# needs its weights.
#
# **lemon-mlx-engine on this model: unverified.** lemon-mlx-engine, which resets the head's cache and feeds it
# the pre-norm state, was run on this book's bundled model by this project's authors, outside this build
# {cite:p}`qmtplemon2026`. No published record or script a reader can run backs the figures below, so they are
# unverified, a lead to check and no evidence for a verdict ({doc}`08_claims` says the same). It ran the bundled model's 8-bit
# conversion with its own code, so quantization differs from the float model measured above, where the same
# two choices together give {glue:text}`ch_lemon_first:.2f`.

# %%
Markdown(outside_build.on_bundled_table())

# %% [markdown]
# The head's two possible inputs, compared on the same prompts (`evaluate.head_input_agreement`):

# %%
agreement = evaluate.head_input_agreement(model, prompts[:4])
agreement

# %% tags=["remove-cell"]
label_pre = names["pre"]
gap = abs(first[label_pre] - first[names["default"]])
drafted = choices[names["default"]][2]["drafted"][0]
p = first[names["default"]]
noise = 2 * math.sqrt(p * (1 - p) / drafted) if drafted else float("nan")
glue("prepost_cosine", agreement["cosine"], display=False)
glue("prepost_cosine_min", agreement["cosine_min"], display=False)
glue("norm_spread", agreement["norm_weight_spread"], display=False)
glue(
    "prepost_verdict",
    (
        f"fed either state, its first draft is accepted within {gap:.2f} of the other, "
        f"inside twice the sampling error of a rate over {drafted} drafts "
        f"({noise:.2f})"
        if gap <= noise
        else f"its first draft is accepted {first[names['default']]:.2f} with the "
        f"post-norm state and {first[label_pre]:.2f} with the pre-norm one, a gap "
        f"beyond twice the sampling error ({noise:.2f}), but this head was trained on "
        f"one of the two, so the gap measures its training, not the release's"
    ),
    display=False,
)
drafted2 = choices[names["default"]][3]["drafted"][1]
p2 = second[names["default"]]
noise2 = 2 * math.sqrt(p2 * (1 - p2) / drafted2) if drafted2 else float("nan")
chain_gap = abs(second[names["chain"]] - p2)
glue(
    "chain_verdict",
    (
        f"within twice the sampling error of the second draft's rate ({noise2:.2f}): "
        "the tiny model cannot tell the two apart"
        if chain_gap <= noise2
        else f"a gap beyond twice the sampling error ({noise2:.2f})"
    ),
    display=False,
)
reset_gap = first[names["default"]] - first[names["reset"]]
glue(
    "reset_verdict",
    (
        f"a loss of {reset_gap:.2f}, beyond twice the sampling error ({noise:.2f}): "
        "the head's attention over the text before is worth that much here"
        if reset_gap > noise
        else f"within twice the sampling error ({noise:.2f}): the tiny head draws "
        "little from its attention over the text before"
    ),
    display=False,
)

# %% [markdown]
# ## Acceptance under sampling
#
# % No $...$ on this page: MathJax beside the explorer's widget manager throws (MathJax.Hub is v2's API).
#
# With `temperature` above 0 the trunk's token at a position is a sample of its distribution p, drawn as the
# argmax of log p plus Gumbel noise made from the seed and the position alone; the head's draft there is the
# argmax of its own log q plus the same noise, and is kept when the two agree (`qmtp.Engine(acceptance=
# "coupled")`, the default). The tokens keep exactly the trunk's distribution, a draft can be kept without being
# the trunk's top choice, and a seed gives the same tokens at every n_draft. Rejection sampling (a draft kept
# with probability min(1, p/q), `acceptance="rejection"`) keeps about 1% more first drafts on this model, but
# its tokens depend on the widths. The same prompts at the
# temperatures the model card recommends, 0.6 (precise coding) and 1.0 (thinking) {cite:p}`qwen2026qwen36`,
# beside greedy decoding (`generate(..., temperature=T, seed=0)`):

# %%
TEMPERATURES = (0.6, 1.0)
sampled = {0.0: {2: by_n[2], 3: by_n[3]}}
for T in TEMPERATURES:
    sampled[T] = {
        n: evaluate.acceptance(
            model, prompts, n_draft=n, max_tokens=MAX_TOKENS, temperature=T, seed=0
        )
        for n in WIDTHS
    }
Markdown(evaluate.sampling_table(sampled))

# %% tags=["remove-cell"]
for T in TEMPERATURES:
    glue(f"sample_{T:.1f}_first", sampled[T][2]["rate"], display=False)
glue(
    "sampling_verdict",
    (
        "falls as the temperature rises"
        if sampled[0.0][2]["rate"] > sampled[0.6][2]["rate"] > sampled[1.0][2]["rate"]
        else "does not fall steadily with the temperature on these prompts"
    ),
    display=False,
)

# %% [markdown]
# The first draft is accepted {glue:text}`acc_n2:.2f` of the time greedily, {glue:text}`sample_0.6_first:.2f`
# at temperature 0.6 and {glue:text}`sample_1.0_first:.2f` at 1.0: acceptance {glue:text}`sampling_verdict`.
# Sampled rates depend on the draws: each is a single run from one random seed.
#
# ## Acceptance under the chat template
#
# Users meet the model through its chat template: a system message, `<|im_start|>` turns, and a reply that starts
# inside `<think>` (thinking on, the default) or after an empty think block (`enable_thinking=False`); and they
# sample with the settings of the model card {cite:p}`qwen2026qwen36`, not greedily: thinking mode temperature 1.0,
# top-p 0.95, top-k 20, presence penalty 1.5; its precise-coding variant 0.6, 0.95, 20, no penalty; non-thinking
# mode 0.7, 0.8, 20, presence 1.5. The bundled
# model speaks the same format (its card says how it learned it); here are replies to held-out conversations
# (`evaluate.chat_prompts`, requests of the corpus's kinds), drafted at a fixed width, each sampler with
# thinking on and off (`evaluate.chat_acceptance`; each sampled conversation is one run, from a random seed of
# its own: 0, 1, 2, ...). *Per draft position* is the acceptance of the i-th draft over the times it was
# proposed; *overall* is all kept drafts over all proposed. On the bundled model, read the rows with thinking
# off: those with thinking on measure a canned opening thought, greedy ones most of all (greedy decoding writes
# the same fixed thought for every request of a kind, so its drafts are the same few tokens each time), as the
# paragraphs after the table explain.

# %%
CHAT_WIDTH = budget.CHAT["n_draft"] if FULL else 4
CHAT_SAMPLERS = (
    {k: evaluate.CHAT_SAMPLERS[k] for k in budget.CHAT["samplers"]}
    if FULL
    else evaluate.CHAT_SAMPLERS
)
chat_rows = None
if model.tokenizer.chat_template is not None:  # a model without one has no chat to measure
    chat_rows = evaluate.chat_acceptance(
        model,
        evaluate.chat_prompts(budget.CHAT["conversations"] if FULL else 4),
        n_draft=CHAT_WIDTH,
        max_tokens=MAX_TOKENS if FULL else 32,
        samplers=CHAT_SAMPLERS,
    )
    display(Markdown(evaluate.chat_table(chat_rows)))

# %% tags=["remove-cell"]
glue("chat_width", CHAT_WIDTH, display=False)
if chat_rows is None:
    print(f"{path}: no chat template, so no chat to measure (see the bundled model)")
else:
    chat_rate = {(r["sampler"], r["thinking"]): r["rate"] for r in chat_rows}
    for (label, thinking), rate in chat_rate.items():
        key = label.replace(" ", "_").replace("-", "_")
        glue(f"chat_{key}_{'on' if thinking else 'off'}", rate, display=False)
    off_rates = {label: r for (label, thinking), r in chat_rate.items() if not thinking}
    sampled_off = [r for label, r in off_rates.items() if label != "greedy"]
    glue(
        "chat_verdict",
        (
            "with thinking off, every recommended sampler keeps fewer drafts than greedy decoding"
            if max(sampled_off) < off_rates["greedy"]
            else "with thinking off, the recommended samplers do not all keep fewer drafts than greedy decoding"
        ),
        display=False,
    )

# %% [markdown]
# What the table shows on the bundled model is what the samplers cost, read in the rows with thinking off: at
# n_draft {glue:text}`chat_width` greedy drafts are kept {glue:text}`chat_greedy_off:.2f` of the time, with the
# card's thinking-mode sampler {glue:text}`chat_thinking_off:.2f`; {glue:text}`chat_verdict` on these
# conversations. Under sampling a draft is kept with probability min(1, p/q), so the share kept is the overlap of
# the two processed distributions (the sum over tokens of the smaller of p and q), which is 1 only where both put
# all their mass on one token; greedy drafting asks only that their top choices agree. A higher temperature spreads
# both, and the mass they then place differently is drafts turned down.
#
# It does not show what thinking does to acceptance. With thinking on, the bundled model's reply starts with a
# canned thought, one of a few fixed sentences (one per kind of request in the conversations it was fine-tuned on,
# `qmtp.tiny.chat_corpus`), which the head drafts almost without fault: the rows with thinking on
# ({glue:text}`chat_greedy_on:.2f` greedy, {glue:text}`chat_thinking_on:.2f` with the thinking sampler) measure
# that fixed text, not thinking. The real model's thoughts are free text, and what they do to acceptance needs its
# weights. The rows are single runs on a few conversations, each sampled from its own random seed; the bundled
# model's card measures the same table on more of them and longer replies.
#
# ## Explorer
#
# Move the slider to replay the worked example pass by pass: every pass's text is saved in the page, so
# the slider works without a kernel and without network (the widget manager is vendored with the book).

# %%
widgets.step_explorer(example, model.tokenizer)

# %% tags=["remove-cell"]
saved = results.save(
    "05_mtp_decoding",
    path,
    {
        "acceptance": {str(n): r["rate"] for n, r in by_n.items()},
        "per_position": {str(n): list(r["per_position"]) for n, r in by_n.items()},
        "tokens_per_trunk_pass": {
            str(n): r["tokens_per_trunk_pass"] for n, r in by_n.items()
        },
        "ablation": ablation,
        "per_register": per_register,
        "lossless_mismatches": mismatches,
        "lossless_checks": len(N_DRAFTS) * len(prompts),
        "machine": machine.describe(),
        "engine_choices": {
            label: {"first": first[label], "second": second[label]} for label in choices
        },
        "head_input_agreement": agreement,
        "sampling": {
            str(T): {"first": r[2]["rate"], "second": r[3]["per_position"][1]}
            for T, r in sampled.items()
        },
        "chat_acceptance": chat_rows,
        "previous_head": (
            None
            if compared is None
            else {
                label: {str(n): r for n, r in by_head.items()}
                for label, by_head in compared.items()
            }
        ),
    },
)

# %% [markdown]
# ## Exercises
#
# Each runs on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Change `n_draft` in the worked example (`qmtp.generate(..., n_draft=3)`) to 2 and to 5.
#
#    *Where the answer shows:* the figure of the worked example and the explorer: fewer trunk passes with
#    longer drafts while most are accepted, and the same text every time.
#
# 2. Draft with a head rounded to 4 bits: `qmtp.generate(model, prompt, n_draft=2,
#    head=qmtp.mtp.with_weight_bits(model.mtp, 4, group_size=32))`, and compare `.stats.acceptance`.
#
#    *Where the answer shows:* beside the complete head's rate in this chapter; {doc}`04_quantizing` has the
#    same measurement for every width.
#
# 3. Check losslessness yourself: `qmtp.generate(model, p, max_tokens=40, n_draft=4).tokens` against
#    `n_draft=1` for a prompt of your own.
#
#    *Where the answer shows:* the two token lists are equal, as in this chapter's live check.
