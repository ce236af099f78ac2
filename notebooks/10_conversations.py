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
# # 10. Conversations
#
# The chapters so far decoded prompts. People meet the model as a chat: a list of messages that the model's
# *chat template* (a small Jinja program shipped with the checkpoint) turns into one prompt, a reply that may
# first think inside a `<think>` block, the sampler settings the model card recommends, and further turns, each
# of which sends the whole history again. This chapter runs each of these on the model, and then measures what a
# conversation that keeps its decoding state between turns saves over running every turn afresh.
#
# :::{admonition} What you will learn, what runs here
# :class: tip
#
# **You will learn**
#
# - what prompt the chat template renders, and how it ends with thinking on and off;
# - how a reply is split into its thinking and its answer;
# - the card's samplers as `generation_config.json` gives them and `qmtp` reads them, and a sampled reply with
#   the MTP head drafting;
# - why a later turn of a `qmtp.Conversation` needs to prefill only part of its prompt, which part, and why its
#   reply is the reply a fresh run of the same history gives;
# - what that saves per turn, in tokens and in time, measured in this build.
#
# **What runs here.** The model named below: the template, one greedy and one sampled reply, then a conversation
# of {glue:text}`questions` questions in three template modes, each turn run with the kept state and afresh, a few times over,
# timed with `time.perf_counter` (`qmtp.book.conversations`). The chapter's run time in this build is in the
# {doc}`execution table <../book/execution>`.
# :::

# %% tags=["hide-input"]
import qmtp
from IPython.display import Markdown
from myst_nb import glue
from qmtp.book import budget, conversations, inventory

path = inventory.model_path()
print(inventory.describe(path))
FULL = budget.active(qmtp.ModelConfig.from_file(path))  # the full-size release: fewer turns and tokens
model = qmtp.load(budget.decoding_model(path))
MAX_TOKENS = 12 if FULL else 64
REPEATS = 1 if FULL else 3
QUESTIONS = conversations.QUESTIONS[:3] if FULL else conversations.QUESTIONS
glue("questions", len(QUESTIONS), display=False)

# %% [markdown]
# ## The chat template
#
# A conversation is a list of messages, each a role (`system`, `user`, `assistant`) and its text. The template
# renders them in the ChatML format of the Qwen family: every message between `<|im_start|>ROLE` and
# `<|im_end|>`, then, for a prompt to generate from, the opening of the assistant's turn. `enable_thinking`
# decides how that opening ends:

# %%
messages = [{"role": "system", "content": conversations.SYSTEM},
            {"role": "user", "content": QUESTIONS[0]}]
print(model.tokenizer.apply_chat_template(messages, enable_thinking=False))

# %%
Markdown(conversations.prompt_ends_table(conversations.prompt_ends(model, messages)))

# %% [markdown]
# With thinking on (Qwen's default, `enable_thinking` left out) the prompt ends with an open `<think>`: the reply
# begins with its reasoning, closes it with `</think>` and then answers. With thinking off the template writes an
# empty think block itself, so the reply is the answer alone. `qmtp.chat.opens_thinking` tells the two prompts
# apart; `qmtp.chat.split_thinking` cuts a reply the way the template cuts an assistant message, into the
# thinking before `</think>` and the answer after it. A greedy reply with thinking on, the head drafting two
# tokens per pass (`n_draft=3`):

# %%
prompt = model.tokenizer.apply_chat_template(messages)
reply = qmtp.generate(model, messages=messages, n_draft=3, max_tokens=MAX_TOKENS)
thinking, answer = qmtp.chat.split_thinking(reply.text, qmtp.chat.opens_thinking(prompt))
{"thinking": thinking, "answer": answer}

# %% [markdown]
# On the bundled model the words are not meant to be good: it is a model of the real one's architecture with a
# hidden size of 64, trained on a small corpus of simple sentences and chats in this format. What it shows is
# the mechanics: the reply thinks, closes the block and answers, and the split finds the two parts.
#
# ## The card's samplers
#
# Greedy decoding always takes the likeliest token. The model card recommends sampling instead, and the
# checkpoint's `generation_config.json` carries its settings: the temperature that flattens or sharpens the
# distribution, `top_k` and `top_p` that keep only the likeliest tokens, `min_p`, and a `presence_penalty`
# subtracted from the logit of every token the reply has already produced. `qmtp.Sampling.of_model` reads the
# file; `generate(..., sampling="model")` and `qmtp.Settings.of(sampling="model")` use what it reads.

# %%
print((model.path / "generation_config.json").read_text())

# %%
qmtp.Settings.of(sampling="model").sampler(model) == qmtp.Sampling.of_model(model)

# %%
Markdown(conversations.card_samplers_table(conversations.card_samplers(model)))

# %% tags=["remove-cell"]
card_rows = conversations.card_samplers(model)
agrees = all(r["read"] == r["card"] for r in card_rows if r["card"] is not None)
glue("card_agrees", "agree with" if agrees else "differ from", display=False)

# %% [markdown]
# The settings qmtp reads {glue:text}`card_agrees` the card's thinking-mode recommendation on every field the card
# names ("-": the file or the card leaves the field out, and the field keeps its neutral default). A sampled
# reply with the head drafting, seeded so the build gives the same text each time:

# %%
sampled = qmtp.generate(model, messages=messages, sampling="model", seed=0, n_draft=3, max_tokens=MAX_TOKENS)
print(sampled.text)
sampled.stats.acceptance

# %% tags=["remove-cell"]
glue("sampled_acceptance", sampled.stats.acceptance_rate, display=False)
glue("sampled_tokens", sampled.stats.generated, display=False)

# %% [markdown]
# Drafting does not change what sampling draws from: each draft is accepted with the probability that keeps
# the output distributed as plain sampling's ({doc}`05_mtp_decoding`). Here {glue:text}`sampled_acceptance:.0%`
# of the drafts were accepted over the {glue:text}`sampled_tokens` tokens.
#
# ## A conversation, turn by turn
#
# A chat sends the whole history at every turn: the system message, every question and every reply so far,
# rendered again by the template. Run afresh, turn n prefills all of it, every earlier turn included.
# `qmtp.Conversation` keeps the decoding state the last turn left and prefills only what the new prompt does not
# share with it:

# %%
conversation = qmtp.Conversation(model, conversations.SYSTEM, n_draft=3, max_tokens=MAX_TOKENS)
first = conversation.send(QUESTIONS[0])
second = conversation.send(QUESTIONS[1])
conversation.messages[2]

# %% [markdown]
# The first reply enters the history as the template expects an assistant message: its answer as `content`, its
# thinking as `reasoning_content`. Rendering the history for the second turn, Qwen's template writes the thinking
# only of replies after the last user question, so the first reply comes back *without* its think block. The
# tokens the model ran at the first turn (its prompt and its reply) and the second turn's prompt therefore agree
# only up to the opening of the first reply:

# %%
ran = first.prompt_tokens + first.tokens
shared = qmtp.prefix_cache.common_prefix(ran, second.prompt_tokens)
print(repr(model.tokenizer.decode(ran[shared - 6:shared + 6])))
print(repr(model.tokenizer.decode(second.prompt_tokens[shared - 6:shared + 6])))
{"shared": shared, "prompt tokens": second.stats.prompt_tokens, "prefilled": second.stats.prefilled_tokens}

# %% tags=["remove-cell"]
glue("shared", shared, display=False)
resumed = second.stats.prompt_tokens - second.stats.prefilled_tokens
# the prose names the token the snapshot was taken before: keep it true of this build
assert model.tokenizer.decode(first.prompt_tokens[resumed:resumed + 1]) == "<|im_start|>", resumed
glue("resumed", resumed, display=False)
glue("first_prompt", first.stats.prompt_tokens, display=False)
linear_layers = sum(kind == "linear_attention" for kind in model.config.layer_types)
glue("linear_layers", linear_layers, display=False)
glue("layers", model.config.num_hidden_layers, display=False)
glue("real_layers", qmtp.QWEN36_35B_A3B.num_hidden_layers, display=False)

# %% [markdown]
# The two share {glue:text}`shared` tokens, and the second turn resumed after {glue:text}`resumed` of them. The
# attention layers' caches could be cut back to any position (they hold one key and value per
# position, read up to an offset), but {glue:text}`linear_layers` of the model's {glue:text}`layers` layers are
# gated DeltaNet (linear-attention) layers, whose state is one
# running summary of every position so far: it cannot be rewound. So the conversation snapshots that state where
# each turn's generation prompt starts (the `<|im_start|>` that opens the assistant's turn, position
# {glue:text}`resumed` of the first turn's {glue:text}`first_prompt`-token prompt), since that is where the next
# rendering of the history usually departs from what was run; the next turn resumes from the latest snapshot at
# or before the shared prefix (`qmtp.prefix_cache`). A later turn therefore prefills the previous reply as the
# history renders it, then the new question. The template's variable `preserve_thinking=True` keeps the earlier
# replies' thinking in the history, so the rendering follows what was run to the end of the reply, and the cache
# can resume from a snapshot taken near its end (where the last decoding step started).
#
# Resuming is exact: the positions kept are a common prefix of the ids already run and of the new prompt, which
# is the prompt a fresh run builds from the same history (the same template renders it, the same tokenizer
# encodes it), and every position depends only on the tokens up to it, so they hold what a fresh prefill
# computes for them. The arithmetic may still differ in rounding (a position computed
# in another pass, in a chunk of another size), so the measurement below checks the replies, not the claim:
# greedy, each turn's reply must be the fresh run's token for token.
#
# ## Measured: prefilled tokens and time per turn
#
# The conversation's {glue:text}`questions` questions, in three template modes; at every turn a fresh `qmtp.generate` of the same
# history runs beside the conversation's turn, the two in alternating order, {glue:text}`repeats` times after an
# untimed run; medians (`qmtp.book.conversations.measure_turns`).

# %% tags=["remove-cell"]
glue("repeats", REPEATS, display=False)

# %%
MODES = {"thinking on": {}, "thinking off": {"enable_thinking": False},
         "thinking kept": {"chat_template_kwargs": {"preserve_thinking": True}}}
by_mode = {mode: conversations.measure_turns(model, QUESTIONS, n_draft=3, max_tokens=MAX_TOKENS, repeats=REPEATS,
                                             **options)
           for mode, options in MODES.items()}
Markdown(conversations.turns_table(by_mode))

# %% tags=["remove-cell"]
summary = conversations.reuse_summary(by_mode)
glue("all_same", "gave the fresh run's reply token for token" if summary["all_same"]
     else "did not always give the fresh run's reply (the table says which)", display=False)
glue("prefilled_share", summary["prefilled_share"], display=False)
glue("share_on", summary["prefilled_share_by_mode"]["thinking on"], display=False)
glue("share_off", summary["prefilled_share_by_mode"]["thinking off"], display=False)
glue("share_kept", summary["prefilled_share_by_mode"]["thinking kept"], display=False)
glue("first_token_on", summary["first_token_ratio"]["thinking on"], display=False)
glue("first_token_off", summary["first_token_ratio"]["thinking off"], display=False)
glue("first_token_kept", summary["first_token_ratio"]["thinking kept"], display=False)
glue("wall_min", min(summary["wall_ratio"].values()), display=False)
glue("wall_max", max(summary["wall_ratio"].values()), display=False)
glue("last_turn", len(QUESTIONS), display=False)
glue("max_tokens", MAX_TOKENS, display=False)

# %% [markdown]
# "tokens prefilled", "first token" (from the call to the first new token) and "whole turn": the conversation /
# the fresh run. "thinking kept": `preserve_thinking=True`.
#
# Every turn of every mode {glue:text}`all_same`. Over the turns after the first, the conversation prefilled
# {glue:text}`prefilled_share:.0%` of the prompt tokens a fresh run prefills: {glue:text}`share_on:.0%` with
# thinking on, {glue:text}`share_off:.0%` with it off (the previous answer is prefilled again, since the
# history drops the empty think block it followed) and {glue:text}`share_kept:.0%` with the thinking kept. At turn {glue:text}`last_turn`, a
# fresh run took {glue:text}`first_token_on:.1f`x the conversation's time to its first token with thinking on,
# {glue:text}`first_token_off:.1f`x with it off and {glue:text}`first_token_kept:.1f`x with the thinking kept.
# The whole turn, which also decodes up to {glue:text}`max_tokens` new tokens the same way in both runs, took
# {glue:text}`wall_min:.2f`x to {glue:text}`wall_max:.2f`x as long afresh.

# %% mystnb={"figure": {"caption": "Per turn of the conversation, the prompt tokens each run prefilled (left) and its median time to the first new token (right): the conversation that keeps its state (solid) and a fresh run of the same history (dashed), in each template mode. A fresh run prefills the whole history, which grows every turn; the conversation prefills the new question and what the template rendered differently.", "name": "fig-conversation-turns"}}
fig = conversations.turns_figure(by_mode)

# %% [markdown]
# On the bundled model a prefill of a few hundred tokens takes milliseconds, so the time saved is small beside
# decoding. On the real model every prompt token is a position of a full pass through
# {glue:text}`real_layers` layers, and a long
# conversation's history is thousands of tokens: the tokens the conversation does not prefill are the part of
# each turn's wait that grows with the conversation. The server of {doc}`11_under_load` (`python -m qmtp serve`)
# can resume a chat's next request from the state held where its last turn's generation prompt started, the same
# way.
