"""The state `Model(tokens, cache)` carries between calls: per layer, its mixer's state and how many positions
it holds.

The mixers' steps are pure (MLX arrays are values: a new state is a new array, never written in place), so a
snapshot is a list of references and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerCache:
    """A layer's state: KV buffers [B, H_kv, capacity, D] for attention, (conv inputs [B, K-1, C], S
    [B, Hv, Dk, Dv]) for gated DeltaNet; None before the first call. `offset`: the positions it holds."""

    state: tuple | None = None
    offset: int = 0

    def update(self, state: tuple, n_new: int) -> None:
        self.state, self.offset = state, self.offset + n_new


@dataclass
class ModelCache:
    """Caches of every trunk layer, and of the MTP head's attention."""

    layers: list
    head: LayerCache | None = None

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    def all(self) -> list[LayerCache]:
        return self.layers + ([self.head] if self.head is not None else [])

    def snapshot(self) -> list[tuple]:
        return [(c.state, c.offset) for c in self.all()]

    def restore(self, snapshot: list[tuple]) -> None:
        for cache, (state, offset) in zip(self.all(), snapshot):
            cache.state, cache.offset = state, offset
