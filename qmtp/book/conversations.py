"""Chapter 10's measurements, tables and figure: the chat template's prompt ends, the card's samplers, and a
conversation's turns timed against fresh runs of the same history (only notebooks and tests import this)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .inventory import markdown_table

SYSTEM = "You are a helpful assistant."
QUESTIONS = ("Tell me about the sea.", "Why is it salty?", "And the rivers?", "Thank you.")
SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")


def prompt_ends(model, messages: list[dict], chars: int = 48) -> list[dict]:
    """The last `chars` characters of the prompt the template renders for `messages`, thinking on (the template's
    default) and off, and whether each prompt leaves the reply inside a `<think>` block."""
    from .. import chat

    rows = []
    for enable_thinking in (None, False):
        text = model.tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)
        rows.append({"enable_thinking": enable_thinking, "ends": text[-chars:],
                     "opens_thinking": chat.opens_thinking(text)})
    return rows


def prompt_ends_table(rows: list[dict]) -> str:
    """`prompt_ends` as Markdown, each ending shown with its newlines as `\\n`."""
    columns = ["enable_thinking", "the prompt ends with", "the reply starts inside `<think>`"]
    shown = [dict(zip(columns, (f"`{r['enable_thinking']}`", "`" + r["ends"].replace("\n", "\\n") + "`",
                                "yes" if r["opens_thinking"] else "no"))) for r in rows]
    return markdown_table(shown, columns)


def card_samplers(model, recommended: dict | None = None) -> list[dict]:
    """Per sampler field: what the checkpoint's generation_config.json says (None: not there), what
    `qmtp.Sampling.of_model` reads from it, and the model card's thinking-mode recommendation
    (`qmtp.tiny.evaluate.CHAT_SAMPLERS["thinking"]`, the card's figures)."""
    from ..sampling import GENERATION_CONFIG, Sampling
    from ..tiny.evaluate import CHAT_SAMPLERS

    recommended = CHAT_SAMPLERS["thinking"] if recommended is None else recommended
    path = Path(model.path) / GENERATION_CONFIG
    declared = json.loads(path.read_text()) if path.exists() else {}
    read = Sampling.of_model(model)
    return [{"field": name, "declared": declared.get(name), "read": getattr(read, name),
             "card": recommended.get(name)} for name in SAMPLER_FIELDS]


def card_samplers_table(rows: list[dict]) -> str:
    """`card_samplers` as Markdown ("-": the file or the card leaves the field out)."""
    columns = ["field", "generation_config.json", "`Sampling.of_model`", "card, thinking mode"]
    shown = [dict(zip(columns, (f"`{r['field']}`", *("-" if r[k] is None else r[k] for k in ("declared", "read", "card")))))
             for r in rows]
    return markdown_table(shown, columns)


def measure_turns(model, questions=QUESTIONS, *, system: str | None = SYSTEM, enable_thinking: bool | None = None,
                  chat_template_kwargs: dict | None = None, n_draft: int = 3, max_tokens: int = 32, repeats: int = 3,
                  warmup: bool = True) -> list[dict]:
    """One conversation of `questions`, greedy, run `repeats` times (after an untimed one when `warmup`); at every
    turn, a fresh `qmtp.generate(model, messages=...)` of the same history runs beside it (first or second, by
    turns), both with the template's variables given (`enable_thinking`, `chat_template_kwargs`), and both are
    timed with `time.perf_counter` around the call.

    One row per turn: the prompt's tokens, those each run prefilled, the medians over the repeats of each run's
    wall time and time to its first token (`Stats.first_token_seconds`), and whether the conversation's reply and
    prompt were the fresh run's token for token in every repeat."""
    from .. import Conversation, generate

    timed = {}  # turn -> lists over repeats
    for repeat in range(-1 if warmup else 0, repeats):
        conversation = Conversation(model, system, enable_thinking=enable_thinking,
                                    chat_template_kwargs=chat_template_kwargs, n_draft=n_draft, max_tokens=max_tokens)
        for turn, question in enumerate(questions):
            history = conversation.messages + [{"role": "user", "content": question}]

            def turn_call():
                started = time.perf_counter()
                g = conversation.send(question)
                return g, time.perf_counter() - started

            def fresh_call():
                started = time.perf_counter()
                g = generate(model, messages=history, enable_thinking=enable_thinking,
                             chat_template_kwargs=chat_template_kwargs, n_draft=n_draft, max_tokens=max_tokens)
                return g, time.perf_counter() - started

            if (turn + max(repeat, 0)) % 2 == 0:
                (kept, kept_s), (fresh, fresh_s) = turn_call(), fresh_call()
            else:
                (fresh, fresh_s), (kept, kept_s) = fresh_call(), turn_call()
            if repeat < 0:
                continue
            row = timed.setdefault(turn, {"turn": turn + 1, "prompt_tokens": kept.stats.prompt_tokens,
                                          "conversation_prefilled": kept.stats.prefilled_tokens,
                                          "fresh_prefilled": fresh.stats.prefilled_tokens, "same": True,
                                          "conversation_s": [], "fresh_s": [], "conversation_first_s": [],
                                          "fresh_first_s": [], "generated": kept.stats.generated})
            row["same"] &= kept.tokens == fresh.tokens and kept.prompt_tokens == fresh.prompt_tokens
            row["conversation_s"].append(kept_s)
            row["fresh_s"].append(fresh_s)
            row["conversation_first_s"].append(kept.stats.first_token_seconds)
            row["fresh_first_s"].append(fresh.stats.first_token_seconds)
    rows = []
    for turn in sorted(timed):
        row = dict(timed[turn])
        for key in ("conversation_s", "fresh_s", "conversation_first_s", "fresh_first_s"):
            row[key] = statistics.median(row[key])
        row["repeats"] = repeats
        rows.append(row)
    return rows


def turns_table(by_mode: dict[str, list[dict]]) -> str:
    """`measure_turns` of each mode as one Markdown table: tokens prefilled, time to the first token and wall time
    of the turn (medians, ms), each as conversation / fresh run, and whether the replies were equal."""
    columns = ["mode", "turn", "prompt tokens", "tokens prefilled", "first token (ms)", "whole turn (ms)",
               "same reply"]
    shown = [dict(zip(columns, (mode, r["turn"], r["prompt_tokens"],
                                f"{r['conversation_prefilled']} / {r['fresh_prefilled']}",
                                f"{r['conversation_first_s'] * 1e3:.1f} / {r['fresh_first_s'] * 1e3:.1f}",
                                f"{r['conversation_s'] * 1e3:.0f} / {r['fresh_s'] * 1e3:.0f}",
                                "yes" if r["same"] else "no")))
             for mode, rows in by_mode.items() for r in rows]
    return markdown_table(shown, columns)


def reuse_summary(by_mode: dict[str, list[dict]]) -> dict:
    """What the chapter's prose states: whether every reply equalled the fresh run's; over the turns after the
    first, the share of their prompt tokens the conversation prefilled (all modes, and per mode); at the last
    turn, per mode, the fresh run's time to the first token and wall time over the conversation's."""
    def share(rows):
        later = [r for r in rows if r["turn"] > 1]
        return sum(r["conversation_prefilled"] for r in later) / sum(r["prompt_tokens"] for r in later)

    out = {"all_same": all(r["same"] for rows in by_mode.values() for r in rows),
           "prefilled_share": share([r for rows in by_mode.values() for r in rows]),
           "prefilled_share_by_mode": {mode: share(rows) for mode, rows in by_mode.items()},
           "first_token_ratio": {mode: rows[-1]["fresh_first_s"] / rows[-1]["conversation_first_s"]
                                 for mode, rows in by_mode.items()},
           "wall_ratio": {mode: rows[-1]["fresh_s"] / rows[-1]["conversation_s"] for mode, rows in by_mode.items()}}
    out["min_first_token_ratio"] = min(out["first_token_ratio"].values())
    out["max_first_token_ratio"] = max(out["first_token_ratio"].values())
    return out


def turns_figure(by_mode: dict[str, list[dict]]):
    """Per turn, for each mode (e.g. thinking on, off): the prompt tokens each run prefilled (left) and the median
    time to its first token (right), the conversation solid, the fresh run dashed."""
    import matplotlib.pyplot as plt

    fig, (tokens_ax, time_ax) = plt.subplots(1, 2, layout="constrained", figsize=(8.0, 3.4))
    colours = ("#4C78A8", "#F58518", "#54A24B")
    for (mode, rows), colour in zip(by_mode.items(), colours):
        turns = [r["turn"] for r in rows]
        tokens_ax.plot(turns, [r["conversation_prefilled"] for r in rows], "o-", color=colour,
                       label=f"{mode}: conversation")
        tokens_ax.plot(turns, [r["fresh_prefilled"] for r in rows], "s--", color=colour, label=f"{mode}: fresh")
        time_ax.plot(turns, [r["conversation_first_s"] * 1e3 for r in rows], "o-", color=colour)
        time_ax.plot(turns, [r["fresh_first_s"] * 1e3 for r in rows], "s--", color=colour)
    for ax in (tokens_ax, time_ax):
        ax.set_xlabel("turn")
        ax.set_xticks(sorted({r["turn"] for rows in by_mode.values() for r in rows}))
        ax.set_ylim(bottom=0)
    tokens_ax.set_ylabel("prompt tokens prefilled")
    time_ax.set_ylabel("time to first token (ms, median)")
    tokens_ax.legend(frameon=False, fontsize=8, loc="upper left")
    return fig
