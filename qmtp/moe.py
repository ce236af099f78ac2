"""The sparse mixture of experts of every layer (trunk and head alike).

    p = softmax(router(x))                      # over all E experts, in float32
    top-k experts by p, weights renormalised to sum to 1
    routed = sum_e w_e * down_e(silu(gate_e x) * up_e x)
    shared = sigmoid(shared_expert_gate x) * shared_expert(x)
    out = routed + shared

The routed experts are stacked ([E, I, H] per projection) and applied with `mx.gather_mm`, which reads
only the selected experts' rows: that is what makes the model "A3B", 3B active of 35B. A converted
checkpoint stores them quantized; `QuantizedStackedLinear` applies those with `mx.gather_qmm`, the same
gather reading packed codes, scales and biases instead.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig


class StackedLinear(nn.Module):
    """E linear maps of the same shape in one [E, out, in] weight, applied per token to chosen experts."""

    def __init__(self, n_experts: int, in_dims: int, out_dims: int):
        super().__init__()
        self.weight = mx.zeros((n_experts, out_dims, in_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self.weight
        # The CPU backend's gather_mm computes in float32 only. A cast of the whole stack would make a float32
        # copy of all E experts at every call (3.2 GB for one of the real model's projections): when fewer
        # (token, expert) pairs are chosen than there are experts, only the chosen ones are taken and cast.
        if w.dtype != mx.float32 and mx.default_device() == mx.cpu:
            x = x.astype(mx.float32)
            if indices.size < w.shape[0]:
                w = mx.take(w, indices.reshape(-1), axis=0)
                indices, sorted_indices = mx.arange(indices.size, dtype=mx.uint32).reshape(indices.shape), True
            w = w.astype(mx.float32)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedStackedLinear":
        """The quantized layer of the same shape (what `nn.quantize` calls); its weights are to be loaded."""
        n_experts, out_dims, in_dims = self.weight.shape
        return QuantizedStackedLinear(n_experts, in_dims, out_dims, group_size, bits, mode)


class QuantizedStackedLinear(nn.Module):
    """StackedLinear with each expert's [out, in] matrix quantized along `in` (as `mx.quantize` does it).

    weight: uint32 codes [E, out, in * bits / 32]; scales and biases [E, out, in / group_size]. The weights are
    frozen, as in `nn.QuantizedLinear`.
    """

    def __init__(self, n_experts: int, in_dims: int, out_dims: int, group_size: int = 64, bits: int = 4,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight = mx.zeros((n_experts, out_dims, in_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((n_experts, out_dims, in_dims // group_size))
        self.biases = mx.zeros((n_experts, out_dims, in_dims // group_size))
        self.freeze()

    def _extra_repr(self) -> str:
        E, out_dims, words = self.weight.shape
        return (f"{E} experts, in {words * 32 // self.bits}, out {out_dims}, {self.bits}-bit, "
                f"group_size={self.group_size}")

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                             group_size=self.group_size, bits=self.bits, mode=self.mode,
                             sorted_indices=sorted_indices)


class StackedExperts(nn.Module):
    """All routed SwiGLU experts of a layer."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = StackedLinear(n_experts, hidden, intermediate)
        self.up_proj = StackedLinear(n_experts, hidden, intermediate)
        self.down_proj = StackedLinear(n_experts, intermediate, hidden)

    # Below this many (token, expert) pairs, sorting costs more than it saves.
    sort_threshold = 64

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [N, H], indices [N, k] -> [N, k, H]: each token through each of its k experts."""
        N, k = indices.shape
        if N * k < self.sort_threshold:
            x = x[:, None, None, :]  # [N, 1, 1, H]: one row, broadcast against the k chosen experts
            h = nn.silu(self.gate_proj(x, indices)) * self.up_proj(x, indices)  # [N, k, 1, I]
            return self.down_proj(h, indices)[:, :, 0, :]
        # Many tokens (prefill, verification, training): group the (token, expert) pairs by expert so
        # gather_mm multiplies each expert's rows together instead of one row at a time.
        flat = indices.reshape(-1)
        order = mx.argsort(flat)
        experts = flat[order]
        rows = x[order // k][:, None, :]  # [N * k, 1, H], sorted by expert
        h = nn.silu(self.gate_proj(rows, experts, True)) * self.up_proj(rows, experts, True)
        out = self.down_proj(h, experts, True)[:, 0, :]
        return out[mx.argsort(order)].reshape(N, k, -1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: mx.array, top_k: int, renormalise: bool = True) -> tuple[mx.array, mx.array]:
    """Router logits [N, E] -> (expert indices [N, k], weights [N, k]); softmax in float32."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    indices = mx.stop_gradient(mx.argpartition(-probs, kth=top_k - 1, axis=-1)[:, :top_k])
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if renormalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


def balance_term(logits: mx.array, indices: mx.array, n_experts: int) -> mx.array:
    """Switch-Transformer load balancing: E * sum_e f_e P_e, which is 1 when routing is uniform.

    f_e is the fraction of routing slots that went to expert e (no gradient), P_e the mean router
    probability of e; minimising the product spreads tokens over the experts.
    """
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    counts = mx.zeros((n_experts,)).at[indices.reshape(-1)].add(1.0)
    fraction = mx.stop_gradient(counts / indices.size)
    return n_experts * mx.sum(fraction * probs.mean(axis=0))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, routed_experts: bool = True):
        super().__init__()
        H = config.hidden_size
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(H, config.num_experts, bias=False)
        # A head converted without its routed experts (as some conversions ship it) runs on the shared
        # expert alone; the model says so loudly when it loads one.
        self.experts = StackedExperts(config.num_experts, H, config.moe_intermediate_size) if routed_experts else None
        self.shared_expert = SwiGLU(H, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.routing_log: list | None = None  # set to a list to collect the expert indices of every call
        self.balance_log: list | None = None  # set to a list (in training) to collect the load-balancing term
        self.shard = None  # a `qmtp.parallel.ExpertShard` when this rank holds a block of the experts only

    def __setattr__(self, key, value):
        # The logs are plain attributes, outside the parameter tree: what they collect is not a parameter, and
        # a compiled step that reads the layer's parameters must not see them grow.
        if key in ("routing_log", "balance_log", "shard"):
            object.__setattr__(self, key, value)
        else:
            super().__setattr__(key, value)

    def forward(self, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """x [..., H] -> (output [..., H], chosen experts [N, k], router logits [N, E]); no logging.

        The experts and logits are None for a layer without routed experts. Pure, so that the decoding step,
        which is compiled, can call it (`qmtp.layer.DecoderLayer.step`); the layer's eager call logs them.
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = mx.sigmoid(self.shared_expert_gate(flat).astype(mx.float32)) * self.shared_expert(flat).astype(mx.float32)
        indices = logits = None
        if self.experts is not None:
            logits = self.gate(flat)
            indices, weights = route(logits, self.top_k, self.renormalise)
            if self.shard is None:
                routed = self.experts(flat, indices)  # [N, k, H]
            else:  # every expert's output gathered from the rank that holds it: the same [N, k, H], bit for bit
                routed = self.shard.routed(self.experts, flat, indices)
            out = out + (routed.astype(mx.float32) * weights[..., None]).sum(axis=-2)
        return out.astype(x.dtype).reshape(shape), indices, logits

    def log(self, indices: mx.array | None, logits: mx.array | None = None) -> None:
        """Append to whichever logs are switched on (`routing_log`, `balance_log`)."""
        if indices is None:
            return
        if self.routing_log is not None:
            self.routing_log.append(indices)
        if self.balance_log is not None and logits is not None:
            self.balance_log.append(balance_term(logits, indices, self.gate.weight.shape[0]))

    def __call__(self, x: mx.array) -> mx.array:
        out, indices, logits = self.forward(x)
        self.log(indices, logits)
        return out
