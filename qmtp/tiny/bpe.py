"""The tiny model's tokenizer: a byte-level BPE trained on its synthetic corpus (`qmtp.tiny.corpus`), saved with
`qmtp.tokenizer.save` and loaded, like any ``tokenizer.json``, by `qmtp.tokenizer.Tokenizer.from_dir`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import UsageError
from ..tokenizer import EOS_TOKEN

__all__ = ["train_bpe"]


def train_bpe(
    texts: Iterable[str],
    vocab_size: int = 1024,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE on ``texts`` and return the ``tokenizers.Tokenizer``.

    ``vocab_size`` counts everything: the special tokens (ids 0, 1, ... in the order given), the
    256 byte symbols, then the merges. Words are split with the GPT-2 regex of the ByteLevel
    pre-tokenizer, without a prefix space, so ``"Tom"`` at the start of a document and ``" Tom"``
    after a space are different tokens, as in Qwen's tokenizer.

    Training is deterministic: the same texts in the same order give a byte-identical
    ``tokenizer.json`` (checked by the tests across separate processes).
    """
    if isinstance(texts, str):
        raise UsageError("texts must be an iterable of strings, not a single string; wrap it in a list")
    if isinstance(special_tokens, str):
        raise UsageError(f"special_tokens must be a sequence of strings, not the string {special_tokens!r}")
    specials = list(special_tokens)
    if len(set(specials)) != len(specials) or not all(isinstance(t, str) and t for t in specials):
        raise UsageError(f"special_tokens must be distinct non-empty strings, got {specials!r}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(specials)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise UsageError(
            f"vocab_size must be an integer >= {minimum} (256 bytes + {len(specials)} special "
            f"tokens), got {vocab_size!r}"
        )

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=sorted(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
