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
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import digests
from .checkpoint import _pread_into, open_regular, tensor_bytes
from .errors import CheckpointError, QmtpError

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


# ---- every rank must hold the same model -----------------------------------------------------------------------
# What the ranks compare byte for byte before any weight is read: every file that decides the model's tokens (the
# config, the tokenizer, its template and generation config, the digests a conversion recorded) by name, each one
# digested; then the safetensors headers and the load's own settings.
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              digests.FILE)
ABSENT = bytes(digests.SIZE)  # the digest of a file a rank does not have
TAKING_PART = b"qmtp:same-model!"  # what every rank sends first in a comparison (16 bytes)
OTHERS_PIECE_BYTES = 4 << 20  # rank 0 hashes the other ranks' experts from the file through a buffer this big


def _file_digest(path: Path) -> bytes:
    if not (path.exists() or path.is_symlink()):
        return ABSENT
    try:
        with open_regular(path) as f:
            return digests.of(f.read())
    except (QmtpError, OSError) as err:  # told apart from any readable file, on every rank together
        return digests.of(b"unreadable\0" + str(err).encode())


def _gather(group, values: np.ndarray, what: str) -> np.ndarray:
    """Every rank's `values` ([n, digests.SIZE] uint8, the same n on every rank) as [ranks, n, digests.SIZE].

    Each rank sends a marker first: a rank that stopped before the collective (which MLX's ring backend may
    read as zeros, not as an error) is then named as gone, never taken for a rank holding other bytes."""
    _, size = world(group)
    sent = np.concatenate([np.frombuffer(TAKING_PART, np.uint8), values.reshape(-1)]).view(np.int32)
    every = np.array(mx.distributed.all_gather(mx.array(sent), group=group)).view(np.uint8).reshape(size, -1)
    gone = [r for r in range(size) if every[r, :len(TAKING_PART)].tobytes() != TAKING_PART]
    if gone:
        raise DistributedError(f"rank {gone[0]} did not take part in comparing {what} (it stopped?)")
    return every[:, len(TAKING_PART):].reshape(size, -1, digests.SIZE)


def _as_rows(values: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(values), np.uint8).reshape(len(values), digests.SIZE)


def same_files(group, source, settings: tuple) -> None:
    """A DistributedError on every rank, naming the file, when the ranks' side files (SIDE_FILES), safetensors
    headers or load settings differ. Called before anything that could fail on one rank only."""
    _, size = world(group)
    items = [(name, _file_digest(source.path / name)) for name in SIDE_FILES]
    headers = hashlib.sha256()
    source.ckpt.hash_headers(headers)
    items.append(("the safetensors headers (tensor names, shapes, dtypes, file names)", headers.digest()[:digests.SIZE]))
    items.append(("the load's settings (dtype, layers, head, fixes)", digests.of(repr(settings).encode())))
    every = _gather(group, _as_rows([digest for _, digest in items]), "checkpoint files")
    absent = ~every.any(axis=2)  # [ranks, items]
    for i, (label, _) in enumerate(items):
        odd = next((r for r in range(1, size) if (every[r, i] != every[0, i]).any()), None)
        if odd is not None:
            where = (f" (missing on rank {odd})" if absent[odd, i] else " (missing on rank 0)" if absent[0, i] else "")
            raise DistributedError(f"the {size} ranks did not open the same checkpoint: {label} "
                                   f"differs between rank 0 and rank {odd}{where}: give every rank the same model "
                                   f"directory")


class Holdings:
    """The digests of the tensor bytes this rank loads, and the check that every rank holds the same model.

    A unit is one tensor, or one expert of a routed expert stack. A conversion's recorded digests (`qmtp.digests`)
    are what every rank's units must match; a checkpoint without them (the release, the bundled model) has only
    its ranks to compare: rank 0 then also reads and hashes the experts the other ranks hold (reading the whole
    checkpoint once; the others read their share), and every rank's units must match rank 0's.
    """

    def __init__(self, source, shard: ExpertShard, names: list[str]):
        self.source, self.shard = source, shard
        self.manifest = digests.read(source.path, source.ckpt.metadata)
        # a conversion's digests are checked with the algorithm it recorded them with; ranks without any compare theirs
        self.algorithm = self.manifest.algorithm if self.manifest is not None else digests.ALGORITHM
        self.units: dict[tuple[str, int | None], int] = {}
        for name in names:
            for row in (range(shard.n_experts) if is_routed_expert(name) else (None,)):
                self.units[(name, row)] = len(self.units)
        self.computed = np.zeros((len(self.units), digests.SIZE), np.uint8)  # zeros: not read by this rank

    @property
    def reads_every_expert(self) -> bool:
        """Whether this rank reads every expert (rank 0 of a checkpoint without recorded digests), as the one
        reference the others' experts are held to."""
        return self.manifest is None and self.shard.rank == 0

    def add(self, name: str, raw, rows: tuple[int, int] | None) -> None:
        """Hash `raw` (the evaluated tensor as stored, or rows `rows` of a routed expert stack).

        On the loading thread, while the bytes are in the CPU's caches: XXH3 runs at several GB/s a core, so a
        hash costs a few percent of a load. Hashing on worker threads beside the reading cost more on a machine
        with few cores, the workers competing with the reading and with MLX's own threads
        (tools/rank_digest_cost.py compares the two)."""
        view = tensor_bytes(raw)
        if rows is None:
            self._record(self.units[(name, None)], digests.of(view, self.algorithm))
            return
        for row, digest in zip(range(*rows), digests.rows_of(view, rows[1] - rows[0], self.algorithm)):
            self._record(self.units[(name, row)], digest)

    def _record(self, unit: int, digest: bytes) -> None:
        self.computed[unit] = np.frombuffer(digest, np.uint8)

    def add_others(self, reader, name: str, recipe) -> None:
        """For `reads_every_expert`: hash the other ranks' blocks of routed expert stack `name`.

        A stored stack (`copy`) is hashed straight from the file through a small buffer, never held as an MLX
        array (at full size the other ranks' experts are most of the checkpoint); a stack made of per-expert
        tensors (the release's layout) is read one expert at a time."""
        held = self.shard.held
        for rank in range(1, self.shard.size):
            rows = (rank * held, (rank + 1) * held)
            if recipe.op == "copy":
                info = self.source.ckpt.infos[recipe.sources[0]]
                for row, digest in zip(range(*rows), self._file_rows(info, rows)):
                    self._record(self.units[(name, row)], digest)
                continue
            for row in range(*rows):
                raw = reader.materialise(recipe, (row, row + 1))
                mx.eval(raw)
                self.add(name, raw, (row, row + 1))
                del raw

    def _file_rows(self, info, rows: tuple[int, int]):
        """The digest of each row `rows` of stored tensor `info`, read from its file in pieces of at most
        OTHERS_PIECE_BYTES."""
        row_bytes = info.nbytes // info.shape[0]
        stream = digests.Stream(row_bytes, self.algorithm)
        buffer = memoryview(bytearray(min(OTHERS_PIECE_BYTES, row_bytes * (rows[1] - rows[0]))))
        at, end = info.offset + rows[0] * row_bytes, info.offset + rows[1] * row_bytes
        fd = self.source.ckpt.fileno(info.name)  # the file whose header was read, not what its path names now
        while at < end:
            piece = buffer[:min(len(buffer), end - at)]
            _pread_into(fd, piece, at, info)
            stream.update(piece)
            at += len(piece)
        return [bytes.fromhex(digest) for digest in stream.result()]

    def close(self) -> None:
        """Nothing is left running: the hashing is done as each tensor is added."""

    def _stored(self, name: str, row: int | None) -> str:
        recipe = self.source.plan.recipes[name]
        return recipe.sources[row] if recipe.op == "stack" and row is not None else recipe.sources[0]

    def _expected(self) -> np.ndarray:
        """The recorded digest of every unit, [units, digests.SIZE]."""
        expected = []
        for name, row in self.units:
            recipe = self.source.plan.recipes[name]
            if recipe.op != "copy":
                raise CheckpointError(f"{self.manifest.path}: records the digests of stored tensors, but {name} is "
                                      f"made from {recipe}: the folder mixes a conversion's digests with another layout")
            stored = recipe.sources[0]
            expected.append(self.manifest.whole(stored) if row is None else self.manifest.row(stored, row))
        return _as_rows(expected)

    def agree(self, group) -> None:
        """A DistributedError on every rank, naming the first tensor (and expert) and the rank, when a rank's bytes
        differ from the recorded digests, or (none recorded) from rank 0's."""
        self.close()
        _, size = world(group)
        every = _gather(group, self.computed, "tensor digests")
        expected = every[0] if self.manifest is None else self._expected()
        wrong = every.any(axis=2) & (every != expected[None]).any(axis=2)  # [ranks, units]: read, and not as expected
        if not wrong.any():
            return
        unit, odd = (int(i) for i in np.argwhere(wrong.T)[0])  # the first unit, then the first rank
        name, row = list(self.units)[unit]
        against = "rank 0's" if self.manifest is None else f"the digest {digests.FILE} records"
        expert = "" if row is None else f" (expert {row})"
        raise DistributedError(
            f"the {size} ranks did not open the same checkpoint: rank {odd} holds other bytes than {against} in "
            f"tensor {self._stored(name, row)}{expert}: give every rank the same model directory")


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
