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
# # 2. Why the output is incoherent without the fixes
#
# {term}`Qwen3-Next`-family checkpoints need two changes on their way into MLX. The zero-centred RMSNorm
# weights are stored as `w` and applied as `1 + w`; the depthwise convolution of the linear-attention
# layers is stored in PyTorch's layout `[C, 1, K]` while MLX's `conv1d` wants `[C, K, 1]`.
# `qmtp.load(path, fixes=...)` applies either, both or neither; this chapter loads the model each way.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - the two fixes a Qwen3-Next checkpoint needs on MLX: zero-centred norms applied as `1 + w`, and the
#   depthwise conv kernel moved from `[C, 1, K]` to `[C, K, 1]`;
# - what each mistake does to held-out accuracy and perplexity, and which mistakes fail loudly and which
#   silently;
# - why the `+1` must never be applied twice.
#
# **What runs here.** The bundled model is loaded several times, with each fix on or off, and generates a
# short continuation each time; every number is measured in this run. The chapter's run time in this build is
# in the {doc}`execution table <../book/execution>`; the download button at the top of the page gives this
# notebook, to run it yourself.
#
# **At full size** ({doc}`the budget <real_checkpoint>`): {glue:md}`budget_note`
# :::

# %% tags=["hide-input"]
import statistics
import warnings

# qmtp first: it chooses the BLAS that MLX loads when first imported (qmtp.blas)
import qmtp
import mlx.core as mx
from IPython.display import Markdown
from myst_nb import glue
from qmtp.book import budget, evaluate, inventory, mistakes, plots, results

# the loader warns about every fix left out: the point here
warnings.simplefilter("ignore", UserWarning)
path = inventory.model_path()
print(inventory.describe(path))
config = qmtp.ModelConfig.from_file(path)
FULL = budget.active(config)  # the full-size release: see qmtp.book.budget
load_options = dict(layers=budget.LAYERS, head=False) if FULL else {}
texts = (
    evaluate.heldout_texts(1)[: budget.FIXES_TEXTS]
    if FULL
    else evaluate.heldout_texts(8)
)
measure = {}
if FULL:
    measure = dict(max_tokens=budget.FIXES_TOKENS, length=budget.TEXT_TOKENS)
glue("budget_note", Markdown(budget.plan("02_fixes")), display=False)
prompt = "Once upon a time, a little fox named"

# %% [markdown]
# ## The two fixes, in the code
#
# Both fixes are small functions of one tensor, applied once as the checkpoint is read (`qmtp.load`) or
# converted (`qmtp.convert`); the loader decides which to apply from the fixes the file records as already
# carried. `apply` picks a fix by the tensor's name:
#
# ```{literalinclude} ../qmtp/fixes.py
# :pyobject: apply
# :language: python
# ```
#
# The norm fix adds one in float32, so that a bfloat16 weight near zero is not rounded before the shift:
#
# ```{literalinclude} ../qmtp/fixes.py
# :pyobject: shift_norm
# :language: python
# ```
#
# and the model's norm then multiplies by the stored weight as it is, which is why the weight must already be
# `1 + w` when it arrives:
#
# ```{literalinclude} ../qmtp/norms.py
# :pyobject: RMSNorm
# :language: python
# ```
#
# The conv fix moves one axis. The kernel's middle axis has length one in PyTorch's layout, so the move is
# also a reshape, and the taps keep their order:
#
# ```{literalinclude} ../qmtp/conventions.py
# :pyobject: conv_to_mlx
# :language: python
# ```

# %% [markdown]
# ## Each fix alone, both, neither
#
# Held-out accuracy and perplexity are measured on documents of the generated corpus that the model
# never saw in training. The column *what happens* is either MLX's error, where a load fails, or the greedy
# continuation of the prompt "Once upon a time, a little fox named". {glue:md}`demo_text_note`

# %%
variants = {
    "neither fix": (),
    "conv fix only": ("conv",),
    "norm fix only": ("norm",),
    "both fixes": ("norm", "conv"),
}
runs = {}
for label, fixes in variants.items():
    load = lambda f=fixes: qmtp.load(path, fixes=f, **load_options)
    runs[label] = mistakes.outcome(load, texts, prompt, **measure)
Markdown(mistakes.outcome_table(runs, "load"))

# %% tags=["remove-cell"]
glue("acc_both", runs["both fixes"]["accuracy"], display=False)
glue("demo_text_note", Markdown(evaluate.generated_text_note(config, FULL)), display=False)
glue("acc_no_norm", runs["conv fix only"]["accuracy"], display=False)
glue("ppl_both", runs["both fixes"]["perplexity"], display=False)
glue("ppl_no_norm", runs["conv fix only"]["perplexity"], display=False)

# %% [markdown]
# Without the norm fix the model still runs, and that is the dangerous case: next-token accuracy falls
# from {glue:text}`acc_both:.3f` to {glue:text}`acc_no_norm:.3f` and perplexity rises from
# {glue:text}`ppl_both:.1f` to {glue:text}`ppl_no_norm:.1f`, with no error anywhere. Without the conv
# fix MLX refuses the kernel outright: the stored `[C, 1, K]` reads as a kernel of width 1 over `K`
# input channels per group.
#
# ## The norm weights, stored and effective
#
# Not every norm is zero-centred. The fix shifts the RMSNorms before each mixer and each MoE, the query and
# key norms of the attention layers, the final norm and the head's norms; it leaves alone the gated norm at the
# output of each delta-net layer (`linear_attn.norm`), whose weight is stored as it is applied. The list is
# read from the model's own modules, with the fix's test (`fixes.is_zero_centred_norm`) for each:

# %%
kinds = mistakes.norm_kinds(config)
Markdown(mistakes.norm_kinds_table(kinds))

# %% tags=["remove-cell"]
unshifted = [k["norm weight"] for k in kinds if not k["shifted"]]
glue("unshifted_norms", ", ".join(unshifted) or "none", display=False)

# %% [markdown]
# The norms not shifted: {glue:text}`unshifted_norms`. The stored weights of the others sit around zero;
# what the model multiplies by sits around one ({numref}`fig-norm-weights`). Applied as stored, a norm
# multiplies most of its activations by a number well below one, and flips the sign of those whose w is
# negative ({glue:text}`norm_negative_share:.0%` of the weights here).

# %% mystnb={"figure": {"caption": "The {glue:text}`n_norm_weights` weights of the zero-centred norms of this model: as stored (left) their median is {glue:text}`norm_stored_median:.3f`, {glue:text}`norm_small_share:.0%` of them lie within 0.5 of zero and {glue:text}`norm_negative_share:.0%` are negative; as the model applies them, 1 + w (right), their median is {glue:text}`norm_effective_median:.3f`. Used as stored, a norm would multiply each activation by its w: it would shrink most of them and flip the sign of every one whose w is negative.", "name": "fig-norm-weights"}}
weights = mistakes.norm_weights(path, **load_options)
fig = plots.norm_weight_histograms(weights)

# %% tags=["remove-cell"]
stored = weights["stored"]
glue("n_norm_weights", len(stored), display=False)
glue("norm_stored_median", statistics.median(stored), display=False)
glue("norm_effective_median", statistics.median(weights["effective"]), display=False)
glue("norm_small_share", sum(abs(w) < 0.5 for w in stored) / len(stored), display=False)
glue("norm_negative_share", sum(w < 0 for w in stored) / len(stored), display=False)

# %% [markdown]
# ## The +1 applied twice
#
# A converter that cannot tell whether the shift was already applied, run on an MLX checkpoint, adds
# it again. qmtp records the fixes it applied in the file it writes and never applies one twice; here
# is what a second shift would do.
#
# Left as stored (w) is the load without the norm fix, the *conv fix only* row above: its row here is that
# measurement, not a second one. (Subtracting one again from the fixed weights would not give w back: the fix
# returns 1 + w in the checkpoint's bfloat16, whose step near one is {glue:text}`bf16_step_at_one:.4f`, so w
# would come back rounded, and its perplexity would differ slightly.) Two more columns say how
# sure each model is: the mean probability it gives its own top choice, and its mean loss, in nats, at the
# positions where that choice is wrong.

# %%
one, above_one = mx.array(1.0, mx.bfloat16), mx.array(1.0 + 2**-7, mx.bfloat16)
bf16_step_at_one = float(above_one - one)

# %%
shifts = {}
for label, delta in mistakes.NORM_SHIFTS.items():
    if delta == -1.0:  # the load without the norm fix, measured above
        shifts[label] = runs["conv fix only"]
    else:
        shifted = lambda s=label: mistakes.with_norm_shift(path, s, **load_options)
        shifts[label] = mistakes.outcome(shifted, texts, prompt, **measure)
Markdown(mistakes.outcome_table(shifts, "norm weights", confidence=True))

# %% tags=["remove-cell"]
glue("bf16_step_at_one", bf16_step_at_one, display=False)
unshifted_run = shifts["not shifted (w)"]
twice = shifts["shifted twice (2 + w), a re-conversion"]
once = shifts["shifted once (1 + w), correct"]
glue("w_top", unshifted_run["top_probability"], display=False)
glue("w_wrong_loss", unshifted_run["loss_when_wrong"], display=False)
glue("w_acc", unshifted_run["accuracy"], display=False)
glue("w_ppl", unshifted_run["perplexity"], display=False)
glue("twice_top", twice["top_probability"], display=False)
glue("twice_wrong_loss", twice["loss_when_wrong"], display=False)
glue("twice_acc", twice["accuracy"], display=False)
glue("twice_ppl", twice["perplexity"], display=False)
glue("once_top", once["top_probability"], display=False)
glue("vocab", config.vocab_size, display=False)
glue("uniform", 1 / config.vocab_size, display=False)

# %% [markdown]
# Shifted twice, the model is right more often than left as stored ({glue:text}`twice_acc:.3f` against
# {glue:text}`w_acc:.3f`) and yet has the worse perplexity ({glue:text}`twice_ppl:.1f` against
# {glue:text}`w_ppl:.1f`). The two are wrong in different ways. Left as stored, every norm shrinks most of its
# output (and flips the sign of part of it), the logits come out nearly flat, and the model gives its top choice only
# {glue:text}`w_top:.3f` on average (an even spread over its {glue:text}`vocab` tokens would give each
# {glue:text}`uniform:.4f`): it is unsure of everything, so
# where it is wrong the true token still gets its small share, a loss of {glue:text}`w_wrong_loss:.2f` nats.
# Shifted twice, every norm multiplies by 2 + w, about twice the right amount: the model is nearly as sure of itself as the correct
# one (its top choice gets {glue:text}`twice_top:.3f`, against {glue:text}`once_top:.3f`), right
# {glue:text}`twice_acc:.3f` of the time and sure of the wrong token the rest, where the true one costs
# {glue:text}`twice_wrong_loss:.2f` nats. Perplexity is the exponential of the mean
# loss, so those confident errors outweigh the extra right answers.

# %% [markdown]
# ## Which conv mistakes fail loudly, and which silently
#
# Realistic ways to move the kernel into MLX's layout, each run the same way. A shape MLX cannot use is
# refused at the first forward pass; a shape it accepts with the taps in the wrong places runs and
# writes nonsense.

# %%
conv_runs = {}
for label in mistakes.CONV_MISTAKES:
    load = lambda m=label: mistakes.with_conv_mistake(path, m, **load_options)
    conv_runs[label] = mistakes.outcome(load, texts, prompt, **measure)
Markdown(mistakes.outcome_table(conv_runs, "conversion"))

# %% [markdown]
# The reshape gives exactly the correct kernel, because the axis it moves has length one; the two
# layouts that MLX cannot use are refused; reversing the taps, or reading channels and taps in the wrong
# order, runs without complaint and degrades the text: those are the mistakes to test for.

# %% tags=["remove-cell"]
saved = results.save(
    "02_fixes",
    path,
    {
        "accuracy": {k: r["accuracy"] if r["runs"] else None for k, r in runs.items()},
        "perplexity": {k: r["perplexity"] if r["runs"] else None for k, r in runs.items()},
        "double_shift_accuracy": twice["accuracy"],
        "conv_mistake_accuracy": {k: r["accuracy"] if r["runs"] else None for k, r in conv_runs.items()},
        "layers": budget.LAYERS if FULL else config.num_hidden_layers,
    },
)

# %% [markdown]
# ## Exercises
#
# Each runs on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Leave one norm kind unfixed: copy `mistakes.with_norm_shift` into a cell, make its test
#    `n.endswith(".self_attn.q_norm.weight")` and its delta `-1.0` (undoing the fix on the query norms only), and
#    pass the result to `mistakes.outcome` as the chapter does.
#
#    *Where the answer shows:* set your accuracy and perplexity beside the *both fixes* and *conv fix only*
#    rows of the table in *Each fix alone, both, neither*.
#
# 2. Load without the norm fix (`qmtp.load(path, fixes=("conv",))`) and read the warning it gives.
#
#    *Where the answer shows:* the warning names the fix left out; its effect is the *conv fix only* row of
#    the same table.
