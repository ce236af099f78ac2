"""Expert parallelism: the routed experts of every MoE layer spread over the ranks of an MLX distributed group.

With N ranks (`mx.distributed.init()`, started by `mlx.launch`), rank r holds experts r*E/N .. (r+1)*E/N - 1 of
every MoE layer, trunk and head alike, and everything else (embeddings, attention, DeltaNet, routers, shared
experts, norms, lm_head) whole. Every rank runs the same decoding loop on the same tokens:

    indices, weights = route(router(x))               # replicated router: the same choice on every rank
    own[t, j] = expert_{indices[t, j]}(x_t)            # on the rank that holds that expert, else exactly 0
    routed[t, j] = all_sum(own)[t, j]                  # one collective per MoE layer, [T, k, H]
    out = shared(x) + sum_j weights[t, j] * routed[t, j]   # the single process's order of additions

Summing each chosen expert's output, not each rank's partial weighted sum, is what keeps the tokens those of
one process: a value plus zeros is that value exactly, so after the collective every rank holds, bit for bit,
the [T, k, H] outputs the single process computes, and weights and adds them in its order. Partial sums added
in a new order would round differently, and a greedy argmax that is a near tie would flip.

A chosen expert a rank does not hold is computed there with the block's first expert and the result thrown away
(`mx.where`), so the shapes stay fixed and the step stays one compiled graph; a rank reads its own share of the
pass's experts, plus that first expert at most.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

import mlx.core as mx

from .errors import QmtpError

# Internal names of the routed experts' stacked weights (and their quantization scales and biases), trunk and head
ROUTED_EXPERTS = ".mlp.experts."


class DistributedError(QmtpError):
    """The ranks of a group cannot run one model together (another checkpoint on one of them, experts that do not
    split evenly): raised on every rank, with the same message."""


def is_routed_expert(name: str) -> bool:
    return ROUTED_EXPERTS in name


def world(group) -> tuple[int, int]:
    """(rank, size) of `group`; a UsageError-like DistributedError for anything that is not a group."""
    if not isinstance(group, mx.distributed.Group):
        raise DistributedError(f"group={group!r:.60}: give an mlx.core.distributed.Group (mx.distributed.init())")
    return group.rank(), group.size()


@dataclass(frozen=True)
class ExpertShard:
    """Which contiguous block of experts this rank holds, and the group that holds the rest."""

    group: object  # mx.distributed.Group
    rank: int
    size: int
    n_experts: int

    @classmethod
    def of(cls, group, n_experts: int) -> ExpertShard:
        rank, size = world(group)
        if n_experts % size:
            raise DistributedError(
                f"the model has {n_experts} routed experts per layer, which do not split evenly over {size} ranks: "
                f"run on a number of ranks that divides {n_experts}")
        return cls(group, rank, size, n_experts)

    @property
    def held(self) -> int:
        return self.n_experts // self.size

    @property
    def rows(self) -> tuple[int, int]:
        """(first, stop) of this rank's block of experts, as rows of every stacked expert tensor."""
        return self.rank * self.held, (self.rank + 1) * self.held

    def routed(self, experts, x: mx.array, indices: mx.array) -> mx.array:
        """x [T, H] through each token's k chosen experts (global ids [T, k]) -> [T, k, H], every entry the output
        of the expert that holds it, gathered from whichever rank that is.

        The chosen experts outside the block are all computed with the block's first expert, and what they
        give is replaced by zeros: the step keeps fixed shapes (one compiled graph), and besides its own share of
        the pass's experts a rank reads at most that one more. `all_sum` then adds, at each entry, one expert's
        output and N - 1 zeros."""
        first, stop = self.rows
        mine = (indices >= first) & (indices < stop)
        local = mx.where(mine, indices.astype(mx.int32) - first, 0).astype(indices.dtype)
        own = experts(x, local)
        own = mx.where(mine[..., None], own, mx.zeros((), own.dtype))
        return mx.distributed.all_sum(own, group=self.group)


def hold_experts(model, shard: ExpertShard) -> None:
    """Give every MoE layer with routed experts (trunk and head) a stack of this rank's block only, and the shard
    that routes through it. Before the weights are loaded: the new stacks are placeholders of the block's size,
    so the memory check counts what this rank will hold."""
    from .moe import SparseMoE, StackedExperts

    for _, module in model.named_modules():
        if isinstance(module, SparseMoE) and module.experts is not None:
            gate = module.experts.gate_proj.weight
            _, intermediate, hidden = gate.shape
            module.experts = StackedExperts(shard.held, hidden, intermediate)
            module.shard = shard


# ---- every rank must have opened the same checkpoint -----------------------------------------------------------
SAMPLE_BYTES = 4096  # of each file's tensor data: two conversions with the same shapes differ there


def fingerprint(source, settings: tuple) -> bytes:
    """sha256 of what must agree across ranks: config.json as stored, each file's name and header, the first
    bytes of each file's tensor data, and the load's own settings (dtype, layers, head, fixes)."""
    digest = hashlib.sha256()
    digest.update((source.path / "config.json").read_bytes())
    ckpt = source.ckpt
    ckpt.hash_headers(digest)
    for file in sorted(ckpt.files, key=lambda f: f.name):
        fd = ckpt._open[file].fileno()
        (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        digest.update(os.pread(fd, SAMPLE_BYTES, 8 + length))
    digest.update(repr(settings).encode())
    return digest.digest()


def agree(group, digest: bytes, what: str) -> None:
    """Every rank sends its digest to every other; a DistributedError on every rank when they differ (each rank
    sees the same gathered digests, so each raises the same error, and none waits on the others)."""
    rank, size = world(group)
    mine = mx.array(list(digest), dtype=mx.int32)
    every = mx.distributed.all_gather(mine, group=group).reshape(size, -1).tolist()
    odd = [r for r, d in enumerate(every) if d != every[0]]
    if odd:
        raise DistributedError(
            f"the {size} ranks did not open the same {what}: rank {odd[0]} differs from rank 0 (config.json, the "
            f"safetensors files or the load's settings): give every rank the same model directory")


def rank0_decides(shard: ExpertShard | None):
    """For a loop whose end depends on a timing (which differs between ranks): None in one process, else a
    function from this rank's value (a number or a bool) to rank 0's, which every rank then follows."""
    if shard is None:
        return None
    return lambda value: broadcast([value], shard.group)[0]


def broadcast(values, group, dtype=mx.float32) -> list:
    """Rank 0's `values` (a list of numbers) on every rank: every other rank sends zeros, so the sum is rank 0's."""
    rank, _ = world(group)
    sent = mx.array(values, dtype=dtype)
    if rank:
        sent = mx.zeros_like(sent)
    return mx.distributed.all_sum(sent, group=group).tolist()
