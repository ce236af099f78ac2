"""Gated DeltaNet: the linear-attention mixer of three layers in four.

Per token t and value head j (which reads key head j // (Hv / Hk)):

    qkv_t = silu(causal depthwise conv over the last K projected inputs)
    q_t, k_t = l2norm(q_t) / sqrt(Dk), l2norm(k_t)
    beta_t = sigmoid(b_t),  g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S <- exp(g_t) S                                  # decay the memory
    S <- S + k_t (beta_t (v_t - S^T k_t))^T          # delta rule: write the correction for key k_t
    o_t = S^T q_t

then a gated RMSNorm with z and out_proj. The state S [B, Hv, Dk, Dv] and the last K-1 conv inputs are all
that decoding carries, whatever the context length.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig
from .norms import GatedRMSNorm


def l2_normalise(x: mx.array, eps: float = 1e-6) -> mx.array:
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_recurrence(q, k, v, g, beta, state, record: bool = False):
    """Run the recurrence over the time axis.

    q, k: [B, T, Hv, Dk] (already normalised and repeated to value heads); v: [B, T, Hv, Dv];
    g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv]. Returns outputs [B, T, Hv, Dv], the final state, and (if
    `record`) the state after every position.

    Every position's vectors are cut out before the loop, already shaped for their products with S (rows
    [B, Hv, 1, D]; the key also as a column [B, Hv, Dk, 1]; decay and beta as [B, Hv, 1, 1]), so that a
    step is two matrix products and three elementwise updates: at small widths a decode step costs what
    it dispatches, not what it computes.
    """
    T = q.shape[1]

    def per_position(x, axis):  # T pieces along `axis`
        return mx.split(x, T, axis=axis) if T > 1 else [x]

    q_rows, k_rows, v_rows = (per_position(x.transpose(0, 2, 1, 3), 2) for x in (q, k, v))
    k_cols = per_position(k.transpose(0, 2, 3, 1), 3)
    decays, betas = (per_position(x.transpose(0, 2, 1)[..., None], 2) for x in (mx.exp(g), beta))
    outputs, states = [], []
    for t in range(T):
        state = state * decays[t]  # S <- exp(g) S
        delta = (v_rows[t] - k_rows[t] @ state) * betas[t]  # beta (v - S^T k): [B, Hv, 1, Dv]
        state = state + k_cols[t] * delta  # S <- S + k delta^T
        outputs.append(q_rows[t] @ state)  # o = S^T q: [B, Hv, 1, Dv]
        if record:
            states.append(state)
    out = mx.concatenate(outputs, axis=2) if T > 1 else outputs[0]
    return out.transpose(0, 2, 1, 3), state, states


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        H = config.hidden_size
        self.n_k_heads, self.n_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = config.linear_conv_dim
        key_total = self.n_k_heads * self.k_dim
        self.split_points = [key_total, 2 * key_total]
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, config.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.n_v_heads, bias=False)
        # MLX layout [C_out, K, C_in / groups]; the checkpoint's [C, 1, K] is moved here by the "conv" fix.
        self.conv1d = {"weight": mx.zeros((self.conv_dim, self.kernel, 1))}
        self.A_log = mx.zeros((self.n_v_heads,))
        self.dt_bias = mx.zeros((self.n_v_heads,))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(config.linear_value_dim, H, bias=False)

    def empty_state(self, batch: int, dtype) -> tuple[mx.array, mx.array]:
        """No past: zero conv inputs [B, K-1, C] (in the activations' dtype) and S [B, Hv, Dk, Dv] (float32)."""
        return (mx.zeros((batch, self.kernel - 1, self.conv_dim), dtype),
                mx.zeros((batch, self.n_v_heads, self.k_dim, self.v_dim), mx.float32))

    def step(self, x: mx.array, state, record: bool = False):
        """The mixer as a function of its state: (x [B, T, H], (the last K-1 conv inputs, S)) -> (output, the
        new state). With `record` the new state is the state after every position, stacked on a new first axis
        ([T, B, K-1, C], [T, B, Hv, Dk, Dv]), so that a verify pass can keep any prefix."""
        past, recurrent = state
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, T, self.n_v_heads, self.v_dim)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            self.in_proj_a(x).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        )

        conv_in = mx.concatenate([past if past.dtype == qkv.dtype else past.astype(qkv.dtype), qkv], axis=1)
        conv_out = nn.silu(mx.conv1d(conv_in, self.conv1d["weight"], groups=self.conv_dim))

        q, k, v = mx.split(conv_out.astype(mx.float32), self.split_points, axis=-1)
        q = l2_normalise(q.reshape(B, T, self.n_k_heads, self.k_dim)) * self.k_dim**-0.5
        k = l2_normalise(k.reshape(B, T, self.n_k_heads, self.k_dim))
        v = v.reshape(B, T, self.n_v_heads, self.v_dim)
        repeat = self.n_v_heads // self.n_k_heads
        if repeat > 1:
            q, k = mx.repeat(q, repeat, axis=2), mx.repeat(k, repeat, axis=2)

        out, recurrent, states = gated_delta_recurrence(q, k, v, g, beta, recurrent, record)
        keep = self.kernel - 1
        if record:
            new_state = (mx.stack([conv_in[:, t + 1: t + 1 + keep] for t in range(T)]), mx.stack(states))
        else:
            new_state = (conv_in[:, -keep:], recurrent)
        out = self.norm(out.astype(x.dtype), z)
        return self.out_proj(out.reshape(B, T, -1)), new_state
