"""Measuring a model on held-out text, for the chapters: `qmtp.tiny.evaluate` under the name the chapters use.

The functions live in `qmtp.tiny` because the bundled model's card needs them to build, and `book` may import
`tiny`, never the reverse.
"""

from ..tiny.evaluate import (  # noqa: F401  (re-exported)
    TextMetrics,
    heldout_by_register,
    heldout_texts,
    heldout_prompts,
    _windows,
    text_metrics,
    prompts_from,
    acceptance,
    chat_prompts,
    chat_acceptance,
    head_input_agreement,
    predicted_acceptance,
    logit_agreement,
    load_head,
    previous_head,
    compare_heads,
    PREVIOUS_HEAD_FILE,
    CHAT_SAMPLERS,
    ENGINE_CHOICES,
)


# ---- the measurements above as Markdown tables (one table per function) ------------------------------------------
def _markdown_table(rows, columns, formats=None) -> str:
    from .inventory import markdown_table

    return markdown_table(rows, columns, formats)


def head_comparison_table(compared: dict) -> str:
    """`compare_heads`'s result as a Markdown table: per n_draft and head, acceptance per draft position, tokens per
    trunk pass and decode speed over the first head's."""
    rows = []
    for n in sorted(next(iter(compared.values()))):
        for label, by_n in compared.items():
            r = by_n[n]
            rows.append({"n_draft": n, "head": label,
                         "acceptance per position": ", ".join(f"{a:.2f}" for a in r["per_position"]),
                         "tokens/pass": r["tokens_per_trunk_pass"], "speed vs first": r["speed_ratio_to_first"]})
    return _markdown_table(rows, list(rows[0]), {"tokens/pass": "{:.2f}", "speed vs first": "{:.2f}"})


def sampling_table(sampled: dict) -> str:
    """{temperature: {2: acceptance at n_draft 2, 3: at n_draft 3}} as a Markdown table (temperature 0 is greedy)."""
    rows = [{"temperature": "greedy" if t == 0 else t, "acceptance, first draft (n_draft=2)": r[2]["rate"],
             "acceptance, second draft (n_draft=3)": r[3]["per_position"][1],
             "tokens/pass at n_draft=3": r[3]["tokens_per_trunk_pass"]} for t, r in sampled.items()]
    return _markdown_table(rows, list(rows[0]), dict.fromkeys(list(rows[0])[1:], "{:.2f}"))


def chat_table(chat_rows: list[dict]) -> str:
    """`chat_acceptance`'s rows as a Markdown table."""
    rows = [{"sampler": r["sampler"], "thinking": "on" if r["thinking"] else "off",
             "acceptance per draft position": ", ".join(f"{a:.2f}" for a in r["per_position"]),
             "acceptance overall": r["rate"], "tokens/pass": r["tokens_per_trunk_pass"]} for r in chat_rows]
    return _markdown_table(rows, list(rows[0]), {"acceptance overall": "{:.2f}", "tokens/pass": "{:.2f}"})


def generated_text_note(config, full: bool) -> str:
    """What a reader is looking at in a chapter's generated text: on the bundled model, a tiny model's text (its
    size computed from `config`), so what to check in it is named; on the real weights, the real model's."""
    if full:
        return "The text is the real model's own, greedy."
    from ..config import QWEN36_35B_A3B
    from ..sizes import parameter_counts

    total = parameter_counts(config)["total"]
    fewer = parameter_counts(QWEN36_35B_A3B)["total"] / total
    return (f"The text is the bundled tiny model's: {total / 1e6:.1f} million parameters ({fewer:,.0f} times "
            f"fewer than the real model's), trained on a small generated corpus of short stories, dialogues, lists, "
            f"arithmetic and facts. It continues a prompt in that corpus's style and need not make sense; what "
            f"to check in it is whether it reads as the corpus does (words, punctuation, a short sentence) or "
            f"falls apart into repeated or unrelated tokens.")
