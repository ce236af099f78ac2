"""Lazy reading of safetensors checkpoints, one file or many shards.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range) and then raw tensor bytes. Listing a checkpoint reads only the headers; loading a tensor reads only
its own byte range. That is what makes a 70 GB checkpoint inspectable on a laptop.

The `safetensors` package cannot hand bfloat16 tensors to MLX (it goes through numpy, which has no
bfloat16), so bytes are read here and viewed as the right MLX dtype; headers are validated here too, so
a truncated download fails with the file's name rather than deep inside a library.

A `Checkpoint` keeps every file open from the moment its header is read and reads each tensor from that open
file (pread, or mx.load through /proc/self/fd), never by path again: a folder replaced meanwhile (another
conversion written into it with --force) cannot mix its files into this one. `check_unchanged` then tells the
caller that the folder changed, so it can refuse rather than pair these weights with another config.json.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
# A header larger than this is a corrupt length field, not a real checkpoint (real ones are < 2 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

# config.json, an index, tokenizer_config.json: real ones are well under a few MB (an index of 70 GB is ~100 kB)
MAX_JSON_BYTES = 64 * 1024 * 1024
# Deepest nesting a qmtp JSON file may have (real ones have 4 or 5 levels); deeper is refused before parsing.
MAX_JSON_DEPTH = 64


def open_regular(path: str | Path, error=CheckpointError, what: str = "file"):
    """Open `path` for reading in binary mode after checking it is a regular file.

    Opened non-blocking, so a FIFO does not wait for a writer, and checked with fstat on the opened descriptor
    (no race with a rename): a FIFO, a device such as /dev/zero or a directory is refused with one line.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a regular {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror or err})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a file")
        raise error(f"{path}: is {kind}, not a regular file; expected a {what}")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return open(fd, "rb")


def _json_depth_problem(text: str) -> str | None:
    """Why `text` is not a JSON file qmtp parses, judged before parsing: nesting past MAX_JSON_DEPTH."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    return f"nested more than {MAX_JSON_DEPTH} levels deep"
        elif ch in "]}":
            depth -= 1
    return None


def _refuse_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice in one object")
        seen[key] = value
    return seen


def parse_json(text: str | bytes, where: str, error=CheckpointError):
    """json.loads with qmtp's limits: no nesting past MAX_JSON_DEPTH, no integer past Python's digit limit,
    no key twice in one object (json would keep the last silently), NaN/Infinity refused. One-line errors."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise error(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    problem = _json_depth_problem(text)
    if problem is None:
        try:
            return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_constant=_no_constant)
        except json.JSONDecodeError as err:
            problem = f"{err.msg} at line {err.lineno} column {err.colno}"
        except RecursionError:
            problem = "nested too deeply"
        except ValueError as err:  # a duplicate key, NaN, or an int past the digit limit
            problem = str(err) if "twice" in str(err) or "not JSON" in str(err) else "a number with thousands of digits"
    raise error(f"{where}: not valid JSON ({problem})")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def read_json(path: str | Path, error=CheckpointError, what: str = "JSON file", limit: int = MAX_JSON_BYTES):
    """Read and parse one JSON file that qmtp opens (config.json, an index, tokenizer_config.json): a regular
    file, at most `limit` bytes, parsed with `parse_json`'s limits. Raises `error` with one line."""
    path = Path(path)
    with open_regular(path, error, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{path}: is {size} bytes, more than the {limit} a {what} can have")
        data = f.read(limit + 1)
    return parse_json(data, str(path), error)


# safetensors dtype -> (numpy dtype used to read the bytes, MLX dtype name, bytes per element)
DTYPES = {
    "F64": (np.float64, "float64", 8),
    "F32": (np.float32, "float32", 4),
    "F16": (np.float16, "float16", 2),
    "BF16": (np.uint16, "bfloat16", 2),
    "I64": (np.int64, "int64", 8),
    "I32": (np.int32, "int32", 4),
    "I16": (np.int16, "int16", 2),
    "I8": (np.int8, "int8", 1),
    "U64": (np.uint64, "uint64", 8),
    "U32": (np.uint32, "uint32", 4),
    "U16": (np.uint16, "uint16", 2),
    "U8": (np.uint8, "uint8", 1),
    "BOOL": (np.bool_, "bool_", 1),
}
# What a model weight may be stored as: every tensor of the model is floating-point (quantized checkpoints,
# with their integer tensors, are refused before their weights are looked at).
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, known from the header alone."""

    name: str
    dtype: str  # safetensors spelling: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _read_header_of(f, path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the safetensors header of the open file `f` (whose name is `path`), read from its
    start: (tensors, metadata). Reads no tensor data."""
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file is {size} bytes, too short to be safetensors (truncated?)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header claims {header_len} bytes, more than the {MAX_HEADER_BYTES} a safetensors "
                f"header can have: corrupt length field"
            )
        if header_len > size - 8:
            raise CheckpointError(
                f"{path}: header claims {header_len} bytes but only {size - 8} follow the length field: truncated"
            )
        raw = f.read(header_len)
        if len(raw) < header_len:
            raise CheckpointError(f"{path}: header claims {header_len} bytes but the file ends first: truncated")
    except OSError as err:  # open_regular has turned a missing file or a directory into one line already
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        # Besides bad syntax (JSONDecodeError, a ValueError): a number past Python's int digit limit (a plain
        # ValueError) or nesting deeper than the parser follows (RecursionError). No writer produces either.
        if isinstance(err, (UnicodeDecodeError, json.JSONDecodeError)) or "twice" in str(err):
            reason = err
        elif isinstance(err, RecursionError):
            reason = "nested too deeply"
        else:
            reason = "a number with thousands of digits"
        raise CheckpointError(f"{path}: header is not valid JSON ({reason}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; the file is corrupt")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + header_len
    data_len = size - data_start
    tensors = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(path, name, entry, data_start, data_len)
    _check_no_overlap(path, tensors)
    return tensors, metadata


def _check_no_overlap(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """Two tensors reading the same bytes is a corrupt or forged header (the safetensors library refuses it)."""
    spans = sorted((i.offset, i.offset + i.nbytes, n) for n, i in tensors.items() if i.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap in the file's data "
                                  f"(their data_offsets share bytes): corrupt header")


def _tensor_info(path: Path, name: str, entry, data_start: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list or object is not hashable: check the type first
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not a valid [begin, end] pair")
    if len(shape) > 32:  # the most dimensions every supported numpy (>= 1.26) accepts
        raise CheckpointError(f"{where}: shape has {len(shape)} dimensions, more than the 32 an array can have")
    if any(d >= 2**63 for d in shape):  # sizes are int64 everywhere downstream
        raise CheckpointError(f"{where}: shape {shape} has a dimension of 2**63 or more: corrupt header")
    # exact integer sizes (a float product rounds, overflows to inf, and inf * 0 is nan)
    numel, extent = 1, 1  # extent: the product of the non-zero dimensions
    for d in shape:
        numel *= d
        extent *= d or 1
    expected = numel * DTYPES[dtype][2]
    if numel == 0 and extent >= 2**31:
        # an empty tensor still needs its other dimensions to be valid array dimensions (MLX's are int32)
        raise CheckpointError(f"{where}: empty shape {shape} has dimensions multiplying to {extent}: corrupt header")
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(
            f"{where}: {offsets[1] - offsets[0]} bytes stored but dtype {dtype} and shape {shape} need {expected}"
        )
    if offsets[1] > data_len:
        raise CheckpointError(
            f"{where}: data ends at byte {offsets[1]} but the file holds {data_len} bytes of data "
            f"(truncated download?)"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], expected)


# mx.load's lazy arrays per file, each handed out once (popped), so this cache never holds a loaded tensor.
# One cache per thread, held by the thread itself, because MLX binds an array to the streams of the thread that
# made it: evaluating one of another thread's lazy arrays fails ("There is no Stream(cpu, 0) in current
# thread"). Not a dict keyed by thread id: ids are reused, and a new thread would be handed a dead one's arrays.
# Keyed by the file's identity too, so a file replaced since (another conversion in the same folder) is never
# read through it.
_LAZY = threading.local()
# Where the open file behind a descriptor can be opened again, the same file whatever its path names now (Linux).
_FD_DIR = "/proc/self/fd"


def identity(stat) -> tuple[int, int, int, int]:
    """What tells one file from another at the same path: device, inode, size, modification time (ns)."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _lazy_array(info: TensorInfo, fd: int, stat, pinned: bool):
    """The tensor as one of mx.load's lazy arrays: evaluating it reads its bytes with pread into a buffer of its
    own, so a whole model loads in its own size, without a mapping of the file beside it. None when mx.load
    cannot be pointed at the file open as `fd` (no /proc, and the path names another file now)."""
    import mlx.core as mx

    lazy: dict[Path, tuple[tuple, dict]] = _LAZY.__dict__.setdefault("arrays", {})
    key, where = identity(stat), info.file
    cached = lazy.get(where)
    if cached is None or cached[0] != key or info.name not in cached[1]:
        if pinned and os.path.isdir(_FD_DIR):
            # mx.load opens the file when called: through /proc it opens the file `fd` is, not what the path
            # names now, so a checkpoint's tensors come from the files whose headers it read
            arrays = mx.load(f"{_FD_DIR}/{fd}", format="safetensors")
        else:
            if identity_at(info.file) != key:
                return None
            arrays = mx.load(str(info.file), format="safetensors")
            if identity_at(info.file) != key:  # replaced while mx.load opened it: it may have read the new one
                return None
        cached = lazy[where] = (key, arrays)
    return cached[1].pop(info.name)


def identity_at(path: Path):
    try:
        return identity(os.stat(path))
    except OSError:
        return None


def _block(index: tuple, shape: tuple) -> tuple[tuple[int, int], tuple[int, int, int] | None] | None:
    """`index` as (rows, cut): rows (start, stop) of axis 0 and at most one other axis cut as (axis, start,
    stop), every other axis whole and every step 1; None when `index` selects anything else."""
    if not shape or len(index) > len(shape):
        return None
    spans = []
    for part, size in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        if not isinstance(part, slice) or part.step not in (None, 1):
            return None
        start, stop, _ = part.indices(size)
        spans.append((start, max(start, stop)))
    rows = spans[0]
    cuts = [(axis, *span) for axis, (span, size) in enumerate(zip(spans, shape)) if axis and span != (0, size)]
    if len(cuts) > 1:
        return None
    return rows, (cuts[0] if cuts else None)


def _pread_into(fd: int, buffer: memoryview, at: int, info: TensorInfo) -> None:
    """Fill `buffer` from byte `at` of the file; a single read stops short past 2 GiB on Linux, so loop."""
    done = 0
    while done < buffer.nbytes:
        got = os.preadv(fd, [buffer[done:]], at + done)
        if got <= 0:
            raise CheckpointError(f"{info.file}: tensor {info.name!r} is cut short (read {done} of {buffer.nbytes} "
                                  f"bytes at {at})")
        done += got


def _read_block(fd: int, info: TensorInfo, rows: tuple[int, int], cut: tuple[int, int, int] | None):
    """Read rows [start, stop) of axis 0 (and with `cut` only [start, stop) of one other axis) straight into an
    MLX buffer: one run of bytes per outer index, no mapping of the file and no numpy copy in between. Rows of
    a tensor are one run; the gate half of 256 fused experts is 256 runs."""
    import mlx.core as mx

    _, mx_name, itemsize = DTYPES[info.dtype]
    shape = list(info.shape)
    if cut is None:  # whole rows: one contiguous run
        (axis, start, stop), first, last = (0, *rows), 0, 1
    else:  # the outer indices of `axis` that lie in the rows asked for
        axis, start, stop = cut
        per_row = int(np.prod(shape[1:axis], dtype=np.int64))
        first, last = rows[0] * per_row, rows[1] * per_row
        shape[0] = rows[1] - rows[0]
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64)) * itemsize
    shape[axis] = stop - start
    storage = mx.uint16 if mx_name == "bfloat16" else getattr(mx, mx_name)
    out = mx.zeros(shape, dtype=storage)
    mx.eval(out)
    if out.size == 0:  # nothing to read (and an empty buffer cannot be cast to bytes)
        return out
    buffer = memoryview(out).cast("B")
    run = (stop - start) * inner
    for i in range(first, last):
        at = info.offset + (i * info.shape[axis] + start) * inner
        _pread_into(fd, buffer[(i - first) * run:(i - first + 1) * run], at, info)
    del buffer
    return out


def read_tensor(info: TensorInfo, index: tuple | None = None, fd: int | None = None):
    """Read one tensor's bytes (and nothing else) into an MLX array of its stored dtype.

    A whole tensor is read by MLX (mx.load, then evaluated here): one copy, in a buffer MLX owns. With `index`
    (a tuple of slices: rows of axis 0 and at most one other axis cut) only that part is read, with pread, e.g.
    the gate half of fused experts, or a converter's next few rows. Any other index maps the file and copies.
    `fd`: the file, already open (a `Checkpoint` reads the files whose headers it read); else opened by path.
    """
    try:
        if fd is not None:
            out = _read_from(fd, info, index, pinned=True)
        else:
            with open(info.file, "rb") as f:
                out = _read_from(f.fileno(), info, index, pinned=False)
    except (OSError, RuntimeError, ValueError, KeyError) as err:  # MLX reports its read and header errors as these
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({err})") from None
    if DTYPES[info.dtype][1] == "bfloat16":
        import mlx.core as mx

        out = out.view(mx.bfloat16)
    return out


def _read_from(fd: int, info: TensorInfo, index: tuple | None, pinned: bool):
    import mlx.core as mx

    np_dtype = DTYPES[info.dtype][0]
    stat = os.fstat(fd)
    size = stat.st_size
    if info.offset + info.nbytes > size:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} is cut short ({max(0, size - info.offset)} of {info.nbytes} "
            f"bytes); the file was truncated after its header was read"
        )
    if index is None and info.nbytes:
        try:
            out = _lazy_array(info, fd, stat, pinned)
            if out is not None:
                mx.eval(out)
                return out
        except RuntimeError:  # mx.load checks the whole file: a cut elsewhere still lets this tensor read
            pass
        index = (slice(None),) * len(info.shape)  # read with pread below, not through a mapping
    block = None if index is None else _block(index, info.shape)
    if info.nbytes == 0:
        return mx.array(np.zeros(info.shape, dtype=np_dtype))
    if block is not None:
        return _read_block(fd, info, *block)
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np_dtype, count=info.numel, offset=info.offset).reshape(info.shape)
        out = mx.array(view if index is None else view[index])  # a copy: the mapping can close
        del view
    return out


class Checkpoint:
    """The tensors of a checkpoint directory (or single file), known by name, read on demand.

    >>> ckpt = Checkpoint(path)          # reads headers only
    >>> ckpt.infos["lm_head.weight"].shape
    >>> ckpt.load("lm_head.weight")      # reads that tensor's bytes only
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path}: no such file or directory")
        self.path = path
        self.seen: dict[Path, tuple | None] = {}  # path -> identity when first read (None: absent)
        self.files = self._find_files(path)
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        # Each file stays open from its header on, and every tensor is read from it: a folder replaced meanwhile
        # (`convert --force` into it) cannot mix its new files into this checkpoint. `check_unchanged` says so.
        self._open: dict[Path, object] = {}
        self._closer = weakref.finalize(self, _close_all, self._open)
        for file in self.files:
            f = open_regular(file, what=".safetensors file")
            self._open[file] = f
            self.seen[file] = identity(os.fstat(f.fileno()))
            tensors, metadata = _read_header_of(f, file)
            for name, info in tensors.items():
                if name in self.infos:
                    raise CheckpointError(f"{file}: tensor {name!r} also stored in {self.infos[name].file}")
                self.infos[name] = info
            self.metadata.update(metadata)
        if self.index is not None:
            self._check_index()

    def close(self) -> None:
        """Close the files (a later `load` reopens none: it fails)."""
        self._closer()

    def check_unchanged(self, also=()) -> None:
        """CheckpointError when a file read so far (every shard, the index, and the paths in `also`) is no longer
        the file it was: replaced, rewritten, or removed, e.g. by another conversion into the same folder. The
        tensors were read from the files as they were when their headers were, but config.json or the tokenizer
        may come from the other one: the caller should start again."""
        for file, was in list(self.seen.items()) + [(Path(p), w) for p, w in also]:
            now = identity_at(file)
            handle = self._open.get(file)
            if now != was or (handle is not None and not handle.closed and identity(os.fstat(handle.fileno())) != was):
                raise CheckpointError(f"{self.path}: the folder changed while it was being read ({file.name} was "
                                      f"replaced, rewritten or removed: another conversion into it?); nothing read "
                                      f"from it is used: run again when it is complete")

    def _find_files(self, path: Path) -> list[Path]:
        self.index = None
        if path.is_file():
            return [path]
        index_path = path / INDEX_NAME
        if index_path.exists() or index_path.is_symlink():
            self.seen[index_path] = identity_at(index_path)
            index = read_json(index_path, what="safetensors index")
            try:
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
                if not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map values must be shard file names")
            except (KeyError, TypeError) as err:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({err})") from None
            self.index = weight_map
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if os.sep in shard or shard.startswith(".."):
                    raise CheckpointError(f"{index_path}: shard name {shard!r} points outside the directory")
                if not (path / shard).exists():
                    raise CheckpointError(f"{index_path}: names shard {shard!r}, which is missing from {path}")
            return [path / s for s in shards]
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
        return files

    def _check_index(self) -> None:
        for name, shard in self.index.items():
            info = self.infos.get(name)
            if info is None or info.file.name != shard:
                raise CheckpointError(
                    f"{self.path / INDEX_NAME}: lists tensor {name!r} in {shard}, but {shard} does not contain it"
                )

    # ---- access -------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def __len__(self) -> int:
        return len(self.infos)

    def names(self) -> list[str]:
        return list(self.infos)

    def load(self, name: str, index: tuple | None = None):
        """One tensor (or the part `index` selects) as an MLX array in its stored dtype; only its bytes are read."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        handle = self._open[info.file]
        if handle.closed:
            raise CheckpointError(f"{self.path}: is closed; open it again to read {name!r}")
        return read_tensor(info, index, handle.fileno())

    def fileno(self, name: str) -> int:
        """The open file descriptor of the file that stores tensor `name` (read with pread, never moved)."""
        return self._open[self.infos[name].file].fileno()

    def hash_headers(self, digest) -> None:
        """`hash_headers` of this checkpoint's files as they were read (not what their paths name now)."""
        for file in sorted(self.files, key=lambda f: f.name):
            fd = self._open[file].fileno()
            head = os.pread(fd, 8, 0)
            if len(head) == 8:
                (length,) = struct.unpack("<Q", head)
                digest.update(file.name.encode() + b"\0" + os.pread(fd, min(length, MAX_HEADER_BYTES), 8))

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}: {len(self.infos)} tensors in {len(self.files)} files, {self.nbytes / 1e9:.2f} GB)"


def _close_all(handles: dict) -> None:
    for f in handles.values():
        f.close()


# ---- writing -----------------------------------------------------------------------------------------------
def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder, fsynced, then renamed: a reader
    sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file private (0600): give it the mode open() would, so others can read the model
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise



def array_bytes(array: np.ndarray, dtype: str) -> bytes:
    """A numpy array's bytes in safetensors dtype `dtype`; BF16 rounded by MLX (numpy has no bfloat16)."""
    if dtype == "BF16":
        import mlx.core as mx

        return np.asarray(mx.array(array).astype(mx.bfloat16).view(mx.uint16)).tobytes()
    return np.ascontiguousarray(array, dtype=DTYPES[dtype][0]).tobytes()


def shard_groups(sizes: list[int], shards: int, can_start=lambda i: True) -> list[list[int]]:
    """Indices of `sizes` cut into at most `shards` consecutive runs of about equal bytes; a run starts only
    at an index where `can_start(i)` (a quantized weight's scales and biases stay with its codes)."""
    if shards <= 1:
        return [list(range(len(sizes)))]
    target = sum(sizes) / shards
    groups, current, filled = [], [], 0
    for i, size in enumerate(sizes):
        if current and can_start(i) and filled + size > target * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(current)
            current = []
        current.append(i)
        filled += size
    groups.append(current)
    return groups


def shard_name(i: int, n: int) -> str:
    """The usual name of shard `i` (from 1) of `n`."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_index(directory: Path, weight_map: dict[str, str], total_size: int, **metadata) -> None:
    """The index of a sharded checkpoint: which file holds each tensor."""
    index = {"metadata": {"total_size": total_size, **metadata}, "weight_map": weight_map}
    (Path(directory) / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def hash_headers(digest, files) -> None:
    """Feed each safetensors file's name and JSON header (not its tensor data) into `digest`, in name order:
    what identifies a checkpoint without reading its weights."""
    for file in sorted(map(Path, files), key=lambda f: f.name):
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) == 8:
                (length,) = struct.unpack("<Q", head)
                digest.update(file.name.encode() + b"\0" + f.read(min(length, MAX_HEADER_BYTES)))




def tensor_bytes(array) -> memoryview:
    """The raw little-endian bytes of an evaluated MLX array, as a view of its memory (no copy); bfloat16
    through its uint16 view. The view keeps the array alive."""
    import mlx.core as mx

    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    mx.eval(array)
    view = memoryview(array)
    if not view.c_contiguous:  # a slice of a larger array: copy it into row order
        view = memoryview(np.ascontiguousarray(view))
    return view.cast("B")


def _pieces(produced):
    """What a writer's `produce()` returned as byte views: None is no piece, a buffer (bytes, memoryview,
    numpy array) is one, anything else is an iterable of them (a tensor streamed a few rows at a time)."""
    if produced is None:
        return
    try:
        yield memoryview(produced).cast("B")
        return
    except TypeError:  # not a buffer: an iterable of buffers
        pass
    for piece in produced:
        view = memoryview(piece).cast("B")
        del piece  # the view keeps the piece's memory alive, and only as long as the writer holds it
        yield view


def write_safetensors(path: str | Path, entries, metadata: dict[str, str] | None = None,
                      sparse: bool | str = False) -> int:
    """Stream tensors into one safetensors file, one at a time; returns the bytes written.

    `entries` is a list of (name, dtype, shape, produce) where dtype is the safetensors spelling and
    `produce()` returns the tensor's bytes when it is its turn, so only one tensor is in memory at once; or an
    iterable of consecutive pieces of them, written as they come, so that not even one whole tensor is. With
    `sparse=True` the data region is left as a hole (zeros, no disk blocks): checkpoints of the real model's
    size for tests that read only headers. With `sparse="partial"` a produce of None leaves its tensor a hole
    and one returning fewer bytes than the tensor fills only its start (the first rows); the rest reads as zeros.
    """
    path = Path(path)
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][2]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        data_start = 8 + len(raw)
        if sparse is True:
            f.truncate(data_start + offset)
            return data_start + offset
        for name, _, _, produce in entries:
            begin, end = header[name]["data_offsets"]
            produced = None if produce is None else produce()
            written = 0
            f.seek(data_start + begin)
            for piece in _pieces(produced):
                if written + piece.nbytes > end - begin:
                    raise CheckpointError(f"{path}: tensor {name!r} produced {written + piece.nbytes} bytes, more "
                                          f"than its {end - begin}")
                f.write(piece)
                written += piece.nbytes
                del piece  # a piece may hold a large array: let it go before the next is made
            if sparse != "partial" and (produced is None or written != end - begin):
                raise CheckpointError(f"{path}: tensor {name!r} produced "
                                      f"{'nothing' if produced is None else written} bytes, header says {end - begin}")
            del produced
        f.truncate(data_start + offset)  # holes up to the end: the last tensors may not have been written
    return data_start + offset
