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
# # 7. The claims, checked
#
# The seed's model card and the reports around it make claims about this model: that it needs two fixes,
# what its conversions weigh, how often its head's drafts are accepted, what a crippled or quantized head
# costs, what MTP buys on an A3B MoE. Each claim is set beside the chapter that tests it. Nothing is
# measured again here: every value below was saved by its chapter when it ran on the same model
# (`qmtp.book.results`), and the verdict is computed from it by the rule written next to the claim in
# `qmtp.book.claims`.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - which of the seed's claims about this model hold, which do not, and which cannot be tested here;
# - where each claim comes from and which chapter's measurement judges it.
#
# **What runs here.** Nothing is measured again: the chapter reads what chapters 1 to 6 saved (`qmtp.book.results`)
# for the same model and applies the rule written beside each claim in `qmtp.book.claims`. The chapter's run time
# in this build is in the {doc}`execution table <../book/execution>`; the download button at the top of the
# page gives this notebook, to run it yourself.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown
from myst_nb import glue
from qmtp.book import claims, inventory, results

path = inventory.model_path()
print(inventory.describe(path))
saved = {chapter: results.load(chapter, path) for chapter in claims.CHAPTERS}
real_model = claims.is_real_model(qmtp.ModelConfig.from_file(path))
rows = claims.check(saved, real_model)

# %% [markdown]
# ## The table
#
# "Chapter" is where the measurement is shown. Claims about the real model's numbers can be tested only
# on its weights; on the bundled model, the rows that the tiny model can still speak to (the size
# arithmetic, what the fixes do, how acceptance behaves) are tested, and the rest say why not.

# %%
Markdown(inventory.markdown_table(rows, ["claim", "chapter", "measured", "verdict", "why"]))

# %%
verdicts = [r["verdict"] for r in rows]
glue("n_claims", len(rows), display=False)
glue("n_hold", verdicts.count(claims.HOLDS), display=False)
glue("n_fail", verdicts.count(claims.FAILS), display=False)
glue("n_untested", verdicts.count(claims.UNTESTABLE), display=False)
glue("failed_claims", "; ".join(f'"{r["claim"]}"' for r in rows if r["verdict"] == claims.FAILS) or "none",
     display=False)

# %% [markdown]
# Of {glue:text}`n_claims` claims, {glue:text}`n_hold` hold, {glue:text}`n_fail` do not and
# {glue:text}`n_untested` cannot be tested on this machine and model. The ones that do not hold:
# {glue:text}`failed_claims`.
#
# ## Where each claim comes from

# %%
Markdown(inventory.markdown_table(rows, ["claim", "source"]))

# %% [markdown]
# ## Exercises
#
# Each runs in a minute or less on the bundled tiny model: add a cell below, or change the one named, and run
# the notebook (the download button at the top of the page gives it).
#
# 1. Run chapters 1 to 7 with `QMTP_MODEL` pointing at a converted folder (exercise 2 of {doc}`01_anatomy`).
#
#    *Where the answer shows:* the verdict column of *The table* is recomputed for that model; claims about
#    the real release stay *cannot be tested* on the tiny model.
#
# 2. Make a rule stricter: edit the threshold of one claim in `qmtp/book/claims.py` and rerun this chapter only.
#
#    *Where the answer shows:* the verdict of that claim in *The table* and the count of claims that hold in
#    the sentence under it.
