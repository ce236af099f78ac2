"""Digests of a checkpoint's tensor bytes: written by `convert`, checked by every rank of a group on what it loads.

A qmtp conversion writes `qmtp-digests.json` beside its safetensors, in the same temporary folder that is renamed
into place whole: for every stored tensor the 128-bit XXH3 digest of its bytes, and for the routed
experts' stacks (`mlp.switch_mlp.*`, trunk and head) one digest per expert (each row of the stack's first axis),
so that a rank holding only its block of experts checks exactly the rows it read and nothing else. The safetensors
metadata names the file (`qmtp.digests`), so a conversion whose side file was lost is told from one that never had
one. The rank's hashing runs on worker threads beside the reading (the hash releases the GIL), see
`qmtp.parallel.Holdings`.

Why XXH3 and not sha256: the digests catch ranks whose files differ by accident (a partial copy, another
conversion, a flipped byte), which any 128-bit hash of the bytes tells apart; nothing here defends against a file
forged to collide, which a rank's operator would have to do to their own machines. sha256 ran at 1.15 GB/s on one
core of this project's CPU and XXH3 at 8.6 GB/s; with sha256 a two-rank load of the reduced preset took 2.2x as
long as without the check (tools/rank_digest_cost.py). Conversions written with sha256 digests (their
`algorithm` says so) are still checked with it.
"""

from __future__ import annotations

import hashlib
import json

import xxhash
from pathlib import Path

from .checkpoint import read_json
from .errors import CheckpointError

FILE = "qmtp-digests.json"
METADATA_KEY = "qmtp.digests"
ALGORITHM = "xxh3-128"
SHA256 = "sha256/128"  # the first 16 bytes of sha256: what earlier conversions recorded
SIZE = 16
# Stored names of the routed experts' stacks as a qmtp conversion writes them (mlx-lm's names)
STACKED_EXPERTS = ".mlp.switch_mlp."


def _hasher(algorithm: str = ALGORITHM):
    return xxhash.xxh3_128() if algorithm == ALGORITHM else hashlib.sha256()


def of(data, algorithm: str = ALGORITHM) -> bytes:
    """The digest of a buffer's bytes."""
    if algorithm == ALGORITHM:
        return xxhash.xxh3_128(data).digest()
    return hashlib.sha256(data).digest()[:SIZE]


def rows_of(data, rows: int, algorithm: str = ALGORITHM) -> list[bytes]:
    """One digest per row of a buffer holding `rows` rows of equal size."""
    view = memoryview(data).cast("B")
    step = len(view) // rows if rows else 0
    return [of(view[i * step:(i + 1) * step], algorithm) for i in range(rows)]


class Stream:
    """The digest of one tensor written in pieces of any size: one for the whole tensor, or with `row_bytes`
    one per row (a piece may end inside a row)."""

    def __init__(self, row_bytes: int | None = None, algorithm: str = ALGORITHM):
        self.row_bytes, self.rows, self.algorithm = row_bytes, [], algorithm
        self.current = _hasher(algorithm)
        self.filled = 0

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        if self.row_bytes is None:
            self.current.update(view)
            return
        while len(view):
            take = min(len(view), self.row_bytes - self.filled)
            self.current.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.row_bytes:
                self.rows.append(self.current.digest()[:SIZE].hex())
                self.current, self.filled = _hasher(self.algorithm), 0

    def result(self):
        """The hex digest, or the list of the rows' hex digests."""
        return self.current.digest()[:SIZE].hex() if self.row_bytes is None else self.rows


def is_stacked_experts(stored: str) -> bool:
    return STACKED_EXPERTS in stored


def write(directory: Path, tensors: dict, rows: dict) -> None:
    """The side file: `tensors` stored name -> hex digest, `rows` stored name -> one hex digest per expert."""
    text = json.dumps({"algorithm": ALGORITHM, "tensors": tensors, "rows": rows}, separators=(",", ":"))
    (Path(directory) / FILE).write_text(text + "\n")


class Manifest:
    """A conversion's recorded digests (`read`)."""

    def __init__(self, path: Path, tensors: dict, rows: dict, algorithm: str = ALGORITHM):
        self.path, self.tensors, self.rows, self.algorithm = path, tensors, rows, algorithm

    def whole(self, stored: str) -> bytes:
        value = self.tensors.get(stored)
        if not isinstance(value, str):
            raise CheckpointError(f"{self.path}: records no digest of tensor {stored}: the file is another "
                                  f"conversion's or damaged; convert again")
        return bytes.fromhex(value)

    def row(self, stored: str, row: int) -> bytes:
        values = self.rows.get(stored)
        if not isinstance(values, list) or not 0 <= row < len(values) or not isinstance(values[row], str):
            raise CheckpointError(f"{self.path}: records no digest of row {row} of tensor {stored}: the file is "
                                  f"another conversion's or damaged; convert again")
        return bytes.fromhex(values[row])


def read(path: Path, metadata: dict) -> Manifest | None:
    """The digests recorded for the checkpoint in `path` (None when it records none). CheckpointError when the
    safetensors metadata names a side file that is missing or not one."""
    name = metadata.get(METADATA_KEY)
    if name is None:
        return None
    file = Path(path) / FILE
    if name != FILE or not (file.exists() or file.is_symlink()):
        raise CheckpointError(f"{file}: the checkpoint records its tensors' digests there (safetensors metadata "
                              f"{METADATA_KEY}={name!r}), but it is missing: copy it with the rest of the folder")
    data = read_json(file, what="digests file", limit=1 << 30)
    if not isinstance(data, dict) or data.get("algorithm") not in (ALGORITHM, SHA256) \
            or not isinstance(data.get("tensors"), dict) or not isinstance(data.get("rows"), dict):
        raise CheckpointError(f"{file}: not a digests file qmtp reads (algorithm {ALGORITHM} or {SHA256}, tensors, "
                              f"rows)")
    return Manifest(file, data["tensors"], data["rows"], data["algorithm"])
