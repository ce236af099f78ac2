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
