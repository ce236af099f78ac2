"""Gated full attention: one layer in four of the trunk, and the MTP head's only layer.

q_proj produces, per head, a query and an output gate side by side ([.., H_q, 2 * D]: first D query, last D
gate). Queries and keys get their own RMSNorm per head, then rotary position embedding on the first
`rotary_dims` of each head (rotate-half style). Attention is causal softmax with grouped KV heads (query head
h reads KV head h // (H_q / H_kv)); the result is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .norms import RMSNorm


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.rotary_dims, self.rope_theta = config.rotary_dims, config.rope_theta
        self.scale = D**-0.5
        self.q_proj = nn.Linear(H, self.n_heads * D * 2, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def rope(self, x: mx.array, offset) -> mx.array:
        return mx.fast.rope(
            x, self.rotary_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset
        )

    def step(self, x: mx.array, buffers, offsets: mx.array):
        """The mixer as a function of its state: x [B, T, H], row b at positions offsets[b].. ([B] int32, or one
        offset [] for every row), and KV buffers [B, H_kv, capacity, D] holding the positions before ->
        (output [B, T, H], the buffers with x's keys and values written at each row's offset). Each row's
        queries are rotated from its own position and its mask lets it read its own valid entries only, so
        the buffers' shape never depends on how many positions a row holds."""
        keys, values = buffers
        B, T, capacity = x.shape[0], x.shape[1], keys.shape[2]
        if offsets.ndim == 0 or B == 1:  # every row at one offset: a slice, cheaper than a scatter
            offset = offsets.reshape(())
            q, k, v, gate = self.project(x, offset)
            keys = mx.slice_update(keys, k.astype(keys.dtype), offset.reshape(1), axes=(2,))
            values = mx.slice_update(values, v.astype(values.dtype), offset.reshape(1), axes=(2,))
            visible = mx.arange(capacity)[None, :] <= (offset + mx.arange(T))[:, None]
        else:
            q, k, v, gate = self.project(x, offsets)
            positions = offsets[:, None] + mx.arange(T)[None]  # [B, T]
            where = mx.broadcast_to(positions[:, None, :, None], k.shape)
            keys = mx.put_along_axis(keys, where, k.astype(keys.dtype), axis=2)
            values = mx.put_along_axis(values, where, v.astype(values.dtype), axis=2)
            visible = mx.arange(capacity)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, capacity]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=visible)
        return self.output(out, gate), (keys, values)

    def empty_state(self, batch: int, capacity: int, dtype) -> tuple[mx.array, mx.array]:
        shape = (batch, self.n_kv_heads, capacity, self.head_dim)
        return mx.zeros(shape, dtype), mx.zeros(shape, dtype)

    def project(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x [B, L, H] at positions offset.. -> queries [B, H_q, L, D], keys and values [B, H_kv, L, D]
        (normalised and rotated), and the output gate [B, L, H_q, D]. `offset` may be an int or an mx.array."""
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v, gate

    def output(self, out: mx.array, gate: mx.array) -> mx.array:
        """Attention output [B, H_q, L, D] gated by sigmoid(gate), then o_proj: [B, L, H]."""
        B, _, L, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))
