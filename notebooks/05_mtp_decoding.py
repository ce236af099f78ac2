# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
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

# %%
import qmtp
from myst_nb import glue
from qmtp import evaluate, inventory, mtp, plots, results, widgets

path = inventory.model_path()
print(inventory.describe(path))
model = qmtp.load(path)
texts = evaluate.heldout_by_register(2)
prompts = evaluate.heldout_prompts(model, 2)
MAX_TOKENS = 40

# %% [markdown]
# ## A worked example
#
# Each row is one trunk pass at `n_draft=3`: the head's drafts that the trunk accepted, the first one it
# rejected, and the token the trunk adds itself.

# %%
example = qmtp.generate(model, "Once upon a time, a little fox named", max_tokens=36, n_draft=3)
fig = plots.speculative_steps(example, model.tokenizer)

# %% [markdown]
# ## Lossless, checked live
#
# For every prompt and every `n_draft` from 2 to 5, the speculative output is compared token by token
# with plain greedy decoding.

# %%
mismatches = 0
for prompt in prompts:
    plain = qmtp.generate(model, prompt, max_tokens=MAX_TOKENS).tokens
    mismatches += sum(qmtp.generate(model, prompt, max_tokens=MAX_TOKENS, n_draft=n).tokens != plain for n in range(2, 6))
glue("lossless_checks", 4 * len(prompts), display=False)
glue("lossless_mismatches", mismatches, display=False)
assert mismatches == 0

# %% [markdown]
# {glue:text}`lossless_checks` speculative runs, {glue:text}`lossless_mismatches` different from plain
# greedy decoding.
#
# ## Acceptance as the drafts grow longer
#
# A draft at position `i` is proposed only when the drafts before it were accepted; its acceptance is
# counted over those occasions.

# %%
by_n = {n: evaluate.acceptance(model, prompts, n_draft=n, max_tokens=MAX_TOKENS) for n in range(2, 6)}
fig = plots.acceptance_by_position(by_n)
glue("acc_n2", by_n[2]["rate"], display=False)
glue("acc_n3_second", by_n[3]["per_position"][1], display=False)
glue("tpp_n2", by_n[2]["tokens_per_trunk_pass"], display=False)
glue("tpp_n5", by_n[5]["tokens_per_trunk_pass"], display=False)

# %% [markdown]
# At `n_draft=2` the trunk accepts {glue:text}`acc_n2:.2f` of the head's drafts, so each trunk pass
# yields {glue:text}`tpp_n2:.2f` tokens; a second draft is accepted {glue:text}`acc_n3_second:.2f` of the
# times it is proposed: the head, fed its own output, drifts from the trunk's states. At `n_draft=5` a
# pass yields {glue:text}`tpp_n5:.2f` tokens.
#
# ## By register
#
# The corpus mixes registers that differ in predictability.

# %%
per_register = {}
for register, docs in texts.items():
    per_register[register] = evaluate.acceptance(model, evaluate.prompts_from(docs, model), n_draft=2, max_tokens=MAX_TOKENS)["rate"]
fig = plots.bars(list(per_register), list(per_register.values()), "acceptance at n_draft=2")

# %% [markdown]
# ## Ablations: what the head needs
#
# The same prompts, `n_draft=2`, with the head as crippled conversions ship it (no routed experts,
# shared expert only), with its weights rounded to fewer bits, and fed the trunk's state before the
# final norm instead of after it.

# %%
variants = {
    "complete head, bf16": dict(),
    "no routed experts": dict(head=mtp.without_routed_experts(model.mtp)),
    "head weights 8-bit": dict(head=mtp.with_weight_bits(model.mtp, 8)),
    "head weights 4-bit": dict(head=mtp.with_weight_bits(model.mtp, 4)),
    "head weights 3-bit": dict(head=mtp.with_weight_bits(model.mtp, 3)),
    "pre-norm hidden state": dict(hidden="pre"),
}
ablation = {label: evaluate.acceptance(model, prompts, n_draft=2, max_tokens=MAX_TOKENS, **options)["rate"]
            for label, options in variants.items()}
glue("acc_no_experts", ablation["no routed experts"], display=False)
glue("acc_prenorm", ablation["pre-norm hidden state"], display=False)
fig = plots.bars(list(ablation), list(ablation.values()), "acceptance at n_draft=2")

# %% [markdown]
# Without its routed experts the head's drafts are accepted {glue:text}`acc_no_experts:.2f` of the time,
# against {glue:text}`acc_n2:.2f` for the complete head; fed the pre-norm state,
# {glue:text}`acc_prenorm:.2f`.
#
# ## Explorer
#
# Move the slider to replay the worked example pass by pass. (The explorer needs JavaScript and the
# ipywidgets library, which the page loads from the web; offline, the worked example's figure above shows
# the same passes.)

# %%
widgets.step_explorer(example, model.tokenizer)

# %%
saved = results.save("05_mtp_decoding", path, {
    "acceptance": {str(n): r["rate"] for n, r in by_n.items()},
    "per_position": {str(n): list(r["per_position"]) for n, r in by_n.items()},
    "tokens_per_trunk_pass": {str(n): r["tokens_per_trunk_pass"] for n, r in by_n.items()},
    "ablation": ablation,
    "per_register": per_register,
    "lossless_mismatches": mismatches,
})
