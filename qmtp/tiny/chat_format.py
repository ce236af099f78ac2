"""The chat format of the bundled model: the tokens, template and end ids Qwen3.6's chat needs, added to a model
trained on plain text.

Qwen3.6's tokenizer knows `<|im_start|>` and `<|im_end|>` (ChatML turns; `<|im_end|>` ends a reply) as special
tokens and `<think>`, `</think>` as added ones (single ids, kept when special tokens are skipped); its
generation_config.json ends a reply at `<|im_end|>` or `<|endoftext|>` and carries the card's sampling defaults.
`extend_tokenizer` gives the bundled tokenizer the same four tokens at new ids after its last one, writes the
template (`chat_template.jinja`, this family's format) and the two configs; `grow_vocabulary` gives the
embedding and lm_head a row for each new id. The head has no embedding or output of its own
(`mtp_use_dedicated_embeddings: false`): it reads and scores through the trunk's, so the same rows serve it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import AddedToken

from .. import tokenizer as tok
from ..chat import GENERATION_CONFIG, TEMPLATE_FILE

__all__ = ["CHAT_TOKENS", "TEMPLATE_SOURCE", "THINKING_SAMPLING", "extend_tokenizer", "grow_vocabulary"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# (text, special): special ones are control tokens; the think tags are plain added tokens, as in Qwen's tokenizer
CHAT_TOKENS = ((IM_START, True), (IM_END, True), ("<think>", False), ("</think>", False))
TEMPLATE_SOURCE = Path(__file__).with_name(TEMPLATE_FILE)
# The Qwen3.5/3.6 card's thinking-mode recommendation, the checkpoint's default sampler as in the release
THINKING_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5}


def extend_tokenizer(source: str | Path, dest: str | Path) -> tok.Tokenizer:
    """`source`'s tokenizer with the chat tokens added (ids after its last), written to `dest` with the chat
    template, a tokenizer_config.json whose eos_token is `<|im_end|>` (as Qwen3.6's) and a generation_config.json
    that ends at `<|im_end|>` or `<|endoftext|>` and samples as the card recommends. Tokens already present keep
    their ids, so extending twice changes nothing."""
    source, dest = Path(source), Path(dest)
    base = tok.Tokenizer.from_dir(source)
    backend = base.backend
    for text, special in CHAT_TOKENS:
        if backend.token_to_id(text) is None:
            added = AddedToken(text, special=special, normalized=False)
            (backend.add_special_tokens if special else backend.add_tokens)([added])
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(backend, dest)
    config = json.loads((dest / tok.CONFIG_FILE).read_text())
    config.update(eos_token=IM_END, pad_token=tok.EOS_TOKEN)
    (dest / tok.CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    shutil.copyfile(TEMPLATE_SOURCE, dest / TEMPLATE_FILE)
    endoftext = backend.token_to_id(tok.EOS_TOKEN)
    generation = {"bos_token_id": endoftext, "pad_token_id": endoftext,
                  "eos_token_id": [backend.token_to_id(IM_END), endoftext], "do_sample": True, **THINKING_SAMPLING}
    (dest / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return tok.Tokenizer.from_dir(dest)


def grow_vocabulary(model, vocab_size: int, seed: int = 0) -> None:
    """Give `model`'s embedding and lm_head `vocab_size` rows, the existing ones unchanged. A new row starts as
    the mean of the existing rows plus noise of a tenth of their spread: a new input then looks like an average
    token rather than a large random one, and a new output starts with about the average logit, neither
    certain nor impossible, and the rows differ so that training can tell the new tokens apart."""
    rng = np.random.default_rng(seed)

    def grown(weight: mx.array) -> mx.array:
        old = np.array(weight.astype(mx.float32))
        extra = vocab_size - old.shape[0]
        if extra < 0:
            raise ValueError(f"cannot shrink a vocabulary of {old.shape[0]} to {vocab_size}")
        new = old.mean(0) + 0.1 * old.std(0) * rng.standard_normal((extra, old.shape[1]))
        return mx.array(np.concatenate([old, new]).astype(np.float32)).astype(weight.dtype)

    embedding = nn.Embedding(vocab_size, model.config.hidden_size)
    embedding.weight = grown(model.embed_tokens.weight)
    model.embed_tokens = embedding
    if getattr(model, "lm_head", None) is not None:
        head = nn.Linear(model.config.hidden_size, vocab_size, bias=False)
        head.weight = grown(model.lm_head.weight)
        model.lm_head = head
    model._lm_head_split = None  # `load` may have split the old lm_head into row blocks; the grown one is whole
    model.config.vocab_size = vocab_size
