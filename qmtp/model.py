"""Qwen3.6-35B-A3B assembled from its blocks: the trunk and the MTP head (`qmtp.loading` fills it from a checkpoint).

    x = embed_tokens(tokens)
    for each layer (3 gated-DeltaNet layers, then 1 gated-attention layer, repeated):
        h = x + mixer(input_layernorm(x))
        x = h + moe(post_attention_layernorm(h))
    h_t = norm(x);  logits = lm_head(h_t)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .errors import QmtpError
from .layer import DecoderLayer
from .mtp import MTPHead
from .norms import RMSNorm

# speculative compiles each decoding step (`qmtp.decoding.step`) with mx.compile; QMTP_COMPILE=0 runs it
# eagerly, with the same results. Kept here, where speculative reads it.
COMPILE = os.environ.get("QMTP_COMPILE", "1") != "0"


# ---- threads --------------------------------------------------------------------------------------------------
# MLX (0.32) keeps per thread: the streams (an array is bound to the streams of the thread that built it), and
# mx.compile's traces. A thread's traces hold Python objects, and the C++ runtime frees them in its thread-exit
# destructors, after Python has let go of the thread: freeing them takes the GIL, and if the main thread is
# already finalizing the interpreter by then, CPython ends the thread with a forced unwind through a noexcept
# destructor, and the process aborts ("terminate called without an active exception"), after a correct result.
# mx.clear_streams() frees them while the thread still holds the GIL, so every thread that decodes calls it as
# its last MLX work: from a thread-local object Python deletes as the thread ends (`release_at_thread_exit`).
_thread = threading.local()


class _ReleaseMlx:
    def __del__(self):
        import mlx.core as mx

        try:
            mx.synchronize()  # work still queued (mx.async_eval of a generation left early) ends first
        except Exception:
            pass
        mx.clear_streams()


def release_at_thread_exit() -> None:
    """Make this thread free its MLX streams and compiled traces when it ends (not the main thread, which
    the interpreter ends itself); idempotent and cheap, so every entry point that runs MLX work may call it."""
    if "release" not in _thread.__dict__ and threading.current_thread() is not threading.main_thread():
        _thread.release = _ReleaseMlx()


class Model(nn.Module):
    """Trunk and MTP head. Decoding runs it through `qmtp.decoding`; `trunk` and `head_states` run it over whole
    sequences from no past (what training and teacher-forced evaluation need)."""

    def __init__(self, config: ModelConfig, head: bool = True, head_routed_experts: bool = True):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = [DecoderLayer(config, kind) for kind in config.layer_types]
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        self.mtp = MTPHead(config, routed_experts=head_routed_experts) if head and config.has_mtp else None
        self.fixes_applied: tuple[str, ...] = ()
        self._lm_head_split = None  # qmtp.cores: lm_head in row blocks on several CPU streams, set by load()
        self.path: Path | None = None
        self.shard = None  # qmtp.parallel.ExpertShard: this rank holds a block of the routed experts only
        self.tokenizer = None
        # Calls on one model are serialised (`qmtp.generate` holds it): tracing a compiled step swaps the
        # weights for placeholders, which another thread would read ("an array without a primitive").
        self.lock = threading.RLock()

    # ---- trunk ------------------------------------------------------------------------------------------
    def trunk(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [B, T] from no past -> (state before the final norm, h after it), both [B, T, H]."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x, self.norm(x)

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings in the compute dtype (a model stored in bfloat16 for lack of memory computes in
        float32: see `load`)."""
        x = self.embed_tokens(tokens)
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def logits(self, h: mx.array) -> mx.array:
        """Score hidden states with lm_head (shared by trunk and head)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.as_linear(h)
        return self._lm_head_split(h) if self._lm_head_split else self.lm_head(h)

    def __call__(self, tokens: mx.array) -> mx.array:
        """The trunk's logits [B, T, vocab] for tokens [B, T] from no past (teacher-forced: what the book compares
        with other engines' models, which are called the same way); decoding runs `qmtp.decoding`'s step."""
        return self.logits(self.trunk(tokens)[1])

    # ---- head -------------------------------------------------------------------------------------------
    def require_head(self) -> MTPHead:
        if self.mtp is None:
            where = f" {self.path}" if self.path else ""
            raise QmtpError(f"model{where} has no MTP head (no mtp.* tensors); it cannot draft")
        return self.mtp

    def head_states(self, h: mx.array, tokens: mx.array) -> mx.array:
        """The head's output [B, T-1, H] from trunk states `h` [B, T, H] already computed for `tokens` [B, T]."""
        return self.require_head()(h[:, :-1], self.embed(tokens[:, 1:]))

    @property
    def dtype(self):
        """The compute dtype, that of the norms (quantized layers hold uint32 codes)."""
        return self.norm.weight.dtype

    def __repr__(self) -> str:
        c = self.config
        head = "none" if self.mtp is None else ("full" if self.mtp.has_routed_experts else "shared expert only")
        return (
            f"Model({c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_experts} experts top-"
            f"{c.num_experts_per_tok}, vocab {c.vocab_size}, MTP head: {head}, fixes {self.fixes_applied}, {self.dtype})"
        )
