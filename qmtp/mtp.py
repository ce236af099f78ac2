"""The Multi-Token-Prediction head: one extra decoder layer that guesses the token after next.

At position t it combines what the trunk knows (h_t, the trunk's output after its final norm: the tensor
lm_head scores) with the token the trunk is about to emit (x_{t+1}):

    z = fc([pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])      # embedding first
    z = decoder_layer(z)              # full attention with its own KV cache, its own router, 256 experts
    logits(x_{t+2}) = lm_head(mtp.norm(z))                                          # the trunk's lm_head

For a second draft the same layer runs again on its own post-norm output and the token it drafted.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import FULL, ModelConfig
from .conventions import is_router
from .layer import DecoderLayer
from .norms import RMSNorm


class MTPHead(nn.Module):
    def __init__(self, config: ModelConfig, routed_experts: bool = True):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.pre_fc_norm_embedding = RMSNorm(H, eps)
        self.pre_fc_norm_hidden = RMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [DecoderLayer(config, FULL, routed_experts=routed_experts)]
        self.norm = RMSNorm(H, eps)

    @property
    def has_routed_experts(self) -> bool:
        return self.layers[0].mlp.experts is not None

    def combine(self, hidden: mx.array, next_embedding: mx.array) -> mx.array:
        """The input of the head's layer: fc over [normed embed(x_{t+1}), normed h_t], both [B, T, H]."""
        return self.fc(mx.concatenate([self.pre_fc_norm_embedding(next_embedding), self.pre_fc_norm_hidden(hidden)], axis=-1))

    def __call__(self, hidden: mx.array, next_embedding: mx.array) -> mx.array:
        """hidden h_t and embed(x_{t+1}), both [B, T, H], from no past -> the head's post-norm state [B, T, H]
        (teacher-forced; drafting runs its layer's `step` over the head's KV buffers: `qmtp.decoding`)."""
        return self.norm(self.layers[0](self.combine(hidden, next_embedding)))


# ---- ablations (the book measures what each costs in acceptance) ------------------------------------------
def _copy_into(head: MTPHead, new: MTPHead, transform=None) -> MTPHead:
    from mlx.utils import tree_flatten, tree_unflatten

    wanted = {name for name, _ in tree_flatten(new.parameters())}
    weights = [(n, transform(n, w) if transform else w) for n, w in tree_flatten(head.parameters()) if n in wanted]
    new.update(tree_unflatten(weights))
    new.eval()
    return new


def without_routed_experts(head: MTPHead) -> MTPHead:
    """The head as crippled conversions ship it: router and routed experts dropped, shared expert kept."""
    return _copy_into(head, MTPHead(head.config, routed_experts=False))


def with_weight_bits(head: MTPHead, bits: int, group_size: int = 64, router_bits: int = 8) -> MTPHead:
    """The head with every matrix rounded to `bits` (router gates to `router_bits`) by MLX's affine
    quantization: mx.quantize then mx.dequantize, the values a quantized kernel multiplies by."""

    def rounded(name: str, w: mx.array) -> mx.array:
        if w.ndim < 2 or w.shape[-1] % group_size:
            return w
        width = router_bits if is_router(name) else bits
        return mx.dequantize(*mx.quantize(w, group_size=group_size, bits=width), group_size=group_size, bits=width).astype(w.dtype)

    return _copy_into(head, MTPHead(head.config, routed_experts=head.has_routed_experts), rounded)
