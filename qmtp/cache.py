"""Decoding state: a KV cache for full attention, conv and recurrent state for linear attention.

Speculative decoding verifies several tokens at once and may keep only some of them, so every cache can be
rolled back exactly. MLX arrays are values: the linear-attention state is replaced, never written in place,
so a snapshot is a pair of references and costs nothing. The KV cache writes into a growing buffer, so its
snapshot is its length, and rolling back is moving the length.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


class KVCache:
    """Keys and values [B, H_kv, T, D] in a buffer grown in steps; `offset` is the number of valid positions."""

    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        end = self.offset + n
        if self.keys is None or end > self.keys.shape[2]:
            grow = ((end + self.step - 1) // self.step) * self.step
            B, H, _, D = keys.shape
            new_k = mx.zeros((B, H, grow, D), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is not None and self.offset:
                new_k[:, :, : self.offset] = self.keys[:, :, : self.offset]
                new_v[:, :, : self.offset] = self.values[:, :, : self.offset]
            self.keys, self.values = new_k, new_v
        self.keys[:, :, self.offset:end] = keys
        self.values[:, :, self.offset:end] = values
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def snapshot(self) -> int:
        return self.offset

    def restore(self, snapshot: int) -> None:
        self.offset = snapshot

    def trim_to(self, length: int) -> None:
        """Forget every position from `length` on."""
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot trim a KV cache of length {self.offset} to {length}")
        self.offset = length


class LinearCache:
    """Gated DeltaNet state: the last K-1 conv inputs [B, K-1, C] and the recurrent matrix S [B, Hv, Dk, Dv].

    With `record=True` the layer also keeps the state after every position of its last call, so a verify
    pass can be cut back to any accepted prefix without recomputing (`rewind`).
    """

    def __init__(self):
        self.conv = None
        self.recurrent = None
        self.offset = 0
        self.record = False
        self.history: list[tuple[mx.array, mx.array]] = []

    def snapshot(self):
        return (self.conv, self.recurrent, self.offset)

    def restore(self, snapshot) -> None:
        self.conv, self.recurrent, self.offset = snapshot
        self.history = []

    def rewind(self, keep: int) -> None:
        """Keep only the first `keep` positions of the last call (needs `record=True` during that call)."""
        n = len(self.history)
        if not 0 < keep <= n:
            raise ValueError(f"cannot keep {keep} of the {n} recorded positions")
        self.conv, self.recurrent = self.history[keep - 1]
        self.offset -= n - keep
        self.history = []


@dataclass
class ModelCache:
    """Caches of every trunk layer, and of the MTP head's attention."""

    layers: list
    head: KVCache | None = None

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    def snapshot(self):
        return ([c.snapshot() for c in self.layers], self.head.snapshot() if self.head else None)

    def restore(self, snapshot) -> None:
        layer_snaps, head_snap = snapshot
        for cache, snap in zip(self.layers, layer_snaps):
            cache.restore(snap)
        if self.head is not None and head_snap is not None:
            self.head.restore(head_snap)

    def set_record(self, record: bool) -> None:
        for c in self.layers:
            if isinstance(c, LinearCache):
                c.record = record
                c.history = []

    def rewind(self, keep: int, n_last: int) -> None:
        """Keep the first `keep` of the `n_last` positions the last call added to every trunk layer (the
        linear-attention layers must have recorded that call: `set_record(True)`)."""
        for c in self.layers:
            if isinstance(c, LinearCache):
                c.rewind(keep)
            else:
                c.trim_to(c.offset - (n_last - keep))
