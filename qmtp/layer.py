"""The decoder layer of the trunk and of the MTP head: a mixer and a mixture of experts, each with its residual.

    h = x + mixer(input_layernorm(x))          # gated DeltaNet or gated attention
    out = h + moe(post_attention_layernorm(h))
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .attention import GatedAttention
from .config import LINEAR, ModelConfig
from .deltanet import GatedDeltaNet
from .moe import SparseMoE
from .norms import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, routed_experts: bool = True):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config, routed_experts=routed_experts)

    @property
    def mixer(self) -> GatedDeltaNet | GatedAttention:
        return self.linear_attn if self.kind == LINEAR else self.self_attn

    def __call__(self, x: mx.array) -> mx.array:
        """x [B, T, H] from no past -> [B, T, H] (`Model.trunk`, the head's teacher-forced states); the experts
        chosen go to the MoE's logs."""
        B, T, _ = x.shape
        y, _, indices, logits = self.step(x, self.empty_state(B, T, x.dtype), mx.array(0, mx.int32))
        self.mlp.log(indices, logits)
        return y

    def step(self, x: mx.array, state, offsets: mx.array, record: bool = False):
        """The layer as a function of its mixer's state, x [B, T, H], row b at positions offsets[b].. ([B]
        int32): (output, the mixer's new state, the experts chosen [B * T, k] and the router logits, both None
        without routed experts). Attention reads and writes each row at its own offset; DeltaNet's state is
        per row already. `record`: a DeltaNet layer's new state is its state after every position
        (`GatedDeltaNet.step`). Pure, so the decoding step can compile it."""
        normed = self.input_layernorm(x)
        if self.kind == LINEAR:
            mixed, state = self.linear_attn.step(normed, state, record)
        else:
            mixed, state = self.self_attn.step(normed, state, offsets)
        h = x + mixed
        out, indices, logits = self.mlp.forward(self.post_attention_layernorm(h))
        return h + out, state, indices, logits

    def empty_state(self, batch: int, capacity: int, dtype):
        """The mixer's state with no past (KV buffers of `capacity` positions for attention)."""
        if self.kind == LINEAR:
            return self.linear_attn.empty_state(batch, dtype)
        return self.self_attn.empty_state(batch, capacity, dtype)
