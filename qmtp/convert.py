"""Convert and quantize: trunk and MTP head in one file, streamed a block of rows at a time, fixes applied once.

    SRC (any released layout) --layout.plan--> a recipe for every internal tensor
      --Reader.materialise(recipe, rows)--> a block of about 16 MiB of one tensor's rows (a few experts)
      --fixes (norm: 1 + w in float32; conv: [C, 1, K] -> [C, K, 1]), each applied exactly once-->
      --mx.quantize at that tensor's width--> codes, scales, biases of those rows
      --checkpoint.write_safetensors, piece by piece--> DST/model.safetensors

Peak memory is a few blocks, whatever the size of the largest tensor (issue 15: the full-size 4-bit
conversion peaks at about 0.25 GB, where holding a whole 1 GB tensor peaked at 2 GB).

Widths per tensor are `qmtp.sizes`' rules (mlx-lm's): every weight of 2 or more dimensions whose last
dimension is a multiple of the group size is quantized at `bits`, except the router `mlp.gate` and the
`mlp.shared_expert_gate` (`router_bits`, groups of 64), `lm_head` (`lm_head_bits`) and the head (`mtp_bits`;
None keeps it, router included, in the checkpoint dtype). Norms, `dt_bias` and the conv kernels stay in the
checkpoint dtype, `A_log` in float32. So `qmtp.sizes.sizes(config, ...)` is the exact byte count of the
tensors written (tests/test_convert.py checks it).

What is written:

* `model.safetensors` (or `--shards N` files `model-0000i-of-0000N.safetensors` and an index). Keys as mlx-lm
  names them: `language_model.model.embed_tokens`, `language_model.model.layers.{L}.` ...,
  `language_model.model.norm`, `language_model.lm_head`; routed experts stacked as
  `mlp.switch_mlp.{gate,up,down}_proj`; the head under `mtp.` with its routed experts stacked the same way
  (`mtp.layers.0.mlp.switch_mlp.*`). A quantized weight is `X.weight` (uint32 codes), `X.scales`, `X.biases`.
  Metadata: `format: mlx`, `qmtp.version`, `qmtp.fixes` (the fixes now in the weights, so no loader applies
  them again), `qmtp.quantization` (for the stored name of every weight: bits, group size and dtype) and
  `qmtp.source_digest` (sha256 of the source's index and safetensors headers: which checkpoint this came from).
* `config.json`: the source's, plus mlx-lm's `quantization` block (default `group_size`, `bits`, `mode`; an
  entry for every router gate, e.g. `"language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}`,
  and for every other module stored at another width), the same as `quantization_config`, and a `qmtp` block
  recording the fixes, the widths and the source digest. For the trunk, tensors and block are exactly what
  `mlx_lm.convert` writes from the same source (tests/test_convert.py compares them byte for byte), except
  that `A_log` is stored in float32.
* the tokenizer files (`tokenizer*`, `chat_template*`, `special_tokens_map.json`, `vocab.json`, `merges.txt`,
  `added_tokens.json`, `generation_config.json`), when the source has them.

mlx-lm's `load` opens the result (its `sanitize` sees the conv kernels in MLX layout, so it does not shift the
norms again, and drops `mtp.*`); `qmtp.load` reads trunk and head from it. mlx-lm reads only Qwen3.5/3.6
configs this way: a Qwen3-Next source (`qwen3_next`, fused `in_proj_qkvz`) is written in the split layout,
which qmtp loads and mlx-lm's `qwen3_next` model does not; a flat `qwen3_5_moe_text` config has no mlx-lm
model class at all.

How this converter differs from lemon-mlx-engine's is chapter 3's last section.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from . import digests as digests_mod
from . import fixes as fixes_mod
from . import layout
from .checkpoint import (DTYPES, INDEX_NAME, Checkpoint, open_regular, read_json, shard_groups,
                         shard_name, tensor_bytes, write_index, write_safetensors)
from .conventions import GROUP_SIZES, ROUTER_GROUP_SIZE, UNQUANTIZED_BITS, is_router, keeps_float32, parse_width
from .errors import IncompleteHeadError, QmtpError, UsageError, user_path
from .model import release_at_thread_exit
from .sizes import sizes
from .source import HEAD_FULL, HEAD_MISSING, HEAD_NOT_DECLARED, HEAD_SHARED_ONLY, Source, nonfinite_error

# A tensor is read, fixed, quantized and written a block of rows at a time, so memory does not grow with the
# largest tensor (a layer's 256 fused experts are 1 GB in bf16). 16 MiB blocks stay under glibc's largest mmap
# threshold (32 MiB): freed blocks are reused from the heap, where larger ones would be fresh pages every time
# (measured: 100x the page faults at 64 MiB, and most of a conversion's system time).
CHUNK_BYTES = 16 * 1024 * 1024
QUANTIZE_STREAMS = 2  # CPU streams quantizing neighbouring blocks in parallel: two cores
QUEUE_PIECES = 4  # pieces made ahead of the writer, waiting to be written
CACHE_PIECES = 16  # freed buffers MLX may keep for reuse (where it caches at all), in blocks

TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json")
TOKENIZER_PREFIXES = ("tokenizer", "chat_template")

# Headers, config and tokenizer files, on top of the tensor bytes, when checking the free disk space.
DISK_MARGIN = 64 * 1024 * 1024


@dataclass
class Conversion:
    """What `convert` wrote."""

    path: Path
    tensors: int  # stored tensors (a quantized weight counts three: codes, scales, biases)
    nbytes: int  # tensor bytes (headers excluded): equal to the `sizes` estimate
    trunk_bytes: int
    head_bytes: int
    seconds: float
    fixes: tuple[str, ...]  # the fixes now in the weights
    head: str  # "full", "shared expert only" or "none"
    source_digest: str
    files: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.path}:\n  {self.tensors} tensors, {self.nbytes / 1e9:.3f} GB (trunk {self.trunk_bytes / 1e9:.3f}, "
                f"head {self.head_bytes / 1e9:.3f}), MTP head {self.head}, {self.seconds:.1f} s")


# ---- arguments ----------------------------------------------------------------------------------------------
def _check_arguments(bits, group_size, mtp_bits, router_bits, lm_head_bits, shards):
    bits = parse_width(bits, "bits", allow_unquantized=False)
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise UsageError(f"group_size={group_size!r} is not supported; MLX quantizes with groups of {GROUP_SIZES}")
    mtp_bits = parse_width(mtp_bits, "mtp_bits")
    router_bits = parse_width(router_bits, "router_bits")
    lm_head_bits = bits if lm_head_bits is None else parse_width(lm_head_bits, "lm_head_bits")
    if shards is not None and (not isinstance(shards, int) or isinstance(shards, bool) or shards < 1):
        raise UsageError(f"shards={shards!r}: give a number of files, 1 or more")
    return bits, mtp_bits, router_bits, lm_head_bits


def _width(value: int | None) -> int:
    """Unquantized (None) as `sizes` takes it: there None means "as `bits`" for lm_head_bits."""
    return UNQUANTIZED_BITS if value is None else value


# ---- the source ---------------------------------------------------------------------------------------------
def converted_reason(source: Source) -> str | None:
    """Why a checkpoint already is a conversion (qmtp's, mlx-lm's, or another quantized one), or None."""
    ckpt = source.ckpt
    if fixes_mod.METADATA_KEY in ckpt.metadata:
        return f"its metadata records the fixes {list(source.recorded)} as applied"
    if ckpt.metadata.get("format") == "mlx":
        return "its safetensors metadata says format: mlx"
    if "quantization" in source.raw_config or "quantization_config" in source.raw_config:
        return "its config.json has a quantization block"
    if any(n.endswith(layout.QUANTIZED_PARTS) for n in ckpt.names()):
        return "it holds quantized tensors (.scales/.biases)"
    if any(n.startswith(layout.MLX_TRUNK_PREFIX) for n in ckpt.names()):
        return f"its tensors are named as mlx-lm writes them ({layout.MLX_TRUNK_PREFIX}*)"
    if source.carried:
        return "its conv kernels are in MLX layout [C, K, 1], so its norms are already shifted"
    return None


def source_digest(ckpt: Checkpoint) -> str:
    """sha256 of the source's listing: its index (if any), then each file's name and safetensors header."""
    h = hashlib.sha256()
    if ckpt.index is not None:
        h.update((ckpt.path / INDEX_NAME).read_bytes())
    ckpt.hash_headers(h)
    return h.hexdigest()


def _checkpoint_dtype(ckpt: Checkpoint, plan: layout.Plan) -> str:
    """The dtype most of the source's bytes are stored in: unquantized tensors, scales and biases keep it."""
    counts = Counter()
    for name, recipe in plan.recipes.items():
        for source in recipe.sources:
            counts[ckpt.infos[source].dtype] += ckpt.infos[source].nbytes
    return counts.most_common(1)[0][0]


def _tokenizer_files(src: Path) -> list[Path]:
    return sorted(f for f in src.iterdir() if f.is_file() and (f.name in TOKENIZER_FILES or f.name.startswith(TOKENIZER_PREFIXES)))


# ---- the conversion -------------------------------------------------------------------------------------------
def convert(src, dst, bits: int = 8, group_size: int = 64, mtp_bits: int | None = None, router_bits: int = 8,
            lm_head_bits: int | None = None, shards: int | None = None, force: bool = False,
            allow_incomplete_head: bool = False, progress: bool = True) -> Conversion:
    """Convert the checkpoint directory `src` into a quantized one-file model at `dst` (see the module docstring).

    `bits` for the trunk (2, 3, 4, 5, 6 or 8), `group_size` 32, 64 or 128; `mtp_bits` for the head (None or
    "bf16": unquantized); `router_bits` for the router and shared-expert gates (groups of 64); `lm_head_bits`
    for lm_head (default `bits`). `shards` splits the weights into that many files plus an index. An existing
    `dst` is replaced only with `force`; a head without its routed experts is refused unless
    `allow_incomplete_head`. Raises QmtpError subclasses, each with a one-line message.
    """
    started = time.perf_counter()
    bits, mtp_bits, router_bits, lm_head_bits = _check_arguments(bits, group_size, mtp_bits, router_bits,
                                                                 lm_head_bits, shards)
    src, dst = user_path(src, "source"), user_path(dst, "destination")
    if not src.exists():
        raise UsageError(f"{src}: no such checkpoint directory")
    if not src.is_dir():
        raise UsageError(f"{src}: give the checkpoint directory (with config.json), not a file")
    source = Source.open(src)
    reason = converted_reason(source)
    if reason:
        raise UsageError(f"{src}: is already converted ({reason}); converting it again would shift the norms a "
                         f"second time: convert the original checkpoint instead")
    # No fix is carried here (that was refused above); the norms may still look shifted under a PyTorch conv layout.
    fix_plan = source.fix_plan(fixes_mod.FIXES)
    from .tokenizer import Tokenizer

    Tokenizer.check_dir(src, source.config.vocab_size)  # a tokenizer.json chat cannot use is not copied
    _check_destination(src, dst, force)
    with _DestinationLock(dst) as lock:
        return _convert_locked(source, dst, force, lock, started, fix_plan, bits, group_size, mtp_bits, router_bits,
                               lm_head_bits, shards, allow_incomplete_head, progress)


def _convert_locked(source, dst, force, lock, started, fix_plan, bits, group_size, mtp_bits, router_bits,
                    lm_head_bits, shards, allow_incomplete_head, progress) -> Conversion:
    src, config, ckpt, plan = source.path, source.config, source.ckpt, source.plan
    _check_destination(src, dst, force)  # again, under the lock: another run may have finished meanwhile

    source.require_declared()  # layers config.json does not declare would be dropped from the output
    source.widths  # worked out here, so every stored shape is checked (empty: quantized sources were refused)
    source.require_trunk()
    head = _check_head(source, allow_incomplete_head)
    if plan.unknown:
        warnings.warn(f"{src}: {len(plan.unknown)} stored tensors match no tensor of the model and are not "
                      f"written (first: {plan.unknown[0]})", stacklevel=2)

    dtype = _checkpoint_dtype(ckpt, plan)
    report = sizes(config, bits=bits, group_size=group_size, mtp_bits=_width(mtp_bits), router_bits=_width(router_bits),
                   lm_head_bits=_width(lm_head_bits), dtype_bytes=DTYPES[dtype][2], router_group_size=ROUTER_GROUP_SIZE)
    policy = {t.name: t for t in report.tensors if t.name in plan.recipes}  # a head may be absent or partial
    needed = sum(t.nbytes for t in policy.values())
    tokenizer_files = _tokenizer_files(src)
    _check_disk_space(dst, needed + DISK_MARGIN + sum(f.stat().st_size for f in tokenizer_files))

    done = fix_plan.result
    digest = source_digest(ckpt)
    settings = dict(bits=bits, group_size=group_size, mtp_bits=mtp_bits, router_bits=router_bits,
                    router_group_size=ROUTER_GROUP_SIZE, lm_head_bits=lm_head_bits, embed_bits=bits)
    writer = _TensorWriter(ckpt, plan, config, policy, dtype, fix_plan.applying, src)
    metadata = {
        "format": "mlx",
        "qmtp.version": __version__,
        fixes_mod.METADATA_KEY: json.dumps(list(done)),
        layout.QUANTIZATION_KEY: json.dumps(writer.record, separators=(",", ":")),
        "qmtp.source_digest": digest,
        digests_mod.METADATA_KEY: digests_mod.FILE,
    }

    _remove_leftovers(dst)  # what an interrupted run left (only the lock holder writes these)
    tmp = None
    try:
        lock.make_parents()
        tmp = Path(tempfile.mkdtemp(prefix=f".{side_stem(dst.name)}.qmtp-partial-", dir=dst.parent))
        os.chmod(tmp, 0o777 & ~_umask())
        # Freed buffers kept for reuse: fresh pages cost more system time than the copies themselves; but the
        # cache counts in the peak, which should stay a few blocks whatever the largest tensor (issue 15).
        files = _write_weights(tmp, writer.entries, metadata, shards or 1, progress,
                               cache_limit=CACHE_PIECES * CHUNK_BYTES)  # and the digests' side file
        config_out = dict(source.raw_config)
        config_out["quantization"] = writer.quantization_block(bits, group_size)
        config_out["quantization_config"] = dict(config_out["quantization"])
        config_out["qmtp"] = {"version": __version__, "fixes": list(done), **settings, "head": head,
                              "source_digest": digest}
        (tmp / "config.json").write_text(json.dumps(config_out, indent=2) + "\n")
        for f in tokenizer_files:
            shutil.copyfile(f, tmp / f.name)
        source.check_unchanged()  # the source read whole, as one checkpoint (not one changed meanwhile)
        replace_directory(tmp, dst)
    except OSError as err:  # disk full, permissions: nothing that looks complete stays behind
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        lock.remove_parents()
        raise QmtpError(f"{dst}: writing the conversion failed ({err.strerror or err}); nothing was left behind") from None
    except BaseException:  # an error, Ctrl-C or SIGTERM mid-way: the same
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        lock.remove_parents()
        raise

    trunk = sum(t.nbytes for t in policy.values() if not t.is_head)
    return Conversion(dst, len(writer.entries), needed, trunk, needed - trunk, time.perf_counter() - started,
                      done, head, digest, files)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder of `path` (itself excluded) that exists; raises if a regular file stands in the way."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UsageError(f"{path}: {parent} is a file, not a directory, so nothing can be written below it")
            return parent
    return Path(path.anchor or ".")


def is_conversion(directory: Path) -> bool:
    """True for a folder that a previous `convert` wrote (its config.json carries a qmtp block)."""
    try:
        raw = read_json(directory / "config.json")
    except QmtpError:
        return False
    return isinstance(raw, dict) and isinstance(raw.get("qmtp"), dict)


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or d in s.parents:
        raise UsageError(f"{dst}: the destination would replace the source {src}; choose another directory")
    cwd = Path.cwd().resolve()
    if d == cwd or d in cwd.parents:
        raise UsageError(f"{dst}: is the current directory or holds it; choose a new directory to write into")
    ancestor = _existing_ancestor(dst.absolute())
    if dst.is_symlink():
        raise UsageError(f"{dst}: is a symbolic link (to {os.readlink(dst)}); give the folder itself or a new name")
    if dst.exists():
        if not force:
            raise UsageError(f"{dst}: already exists; pass --force (force=True) to replace it")
        if not dst.is_dir():
            raise UsageError(f"{dst}: exists and is not a directory; remove it yourself")
        if any(dst.iterdir()) and not is_conversion(dst):
            raise UsageError(f"{dst}: --force replaces only an earlier conversion (a config.json with a qmtp block) "
                             f"or an empty folder, and this folder is neither; remove it yourself or choose another")
    _check_writable(ancestor)


def _check_writable(folder: Path) -> None:
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise QmtpError(f"{folder}: is on a read-only filesystem; choose a destination on a writable one")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise QmtpError(f"{folder}: is not writable by this user; choose another destination")


def _remove_leftovers(dst: Path) -> None:
    for stale in dst.parent.glob(f".{glob_escape(side_stem(dst.name))}.qmtp-*") if dst.parent.is_dir() else ():
        if stale.name.endswith(".qmtp-lock"):
            continue
        shutil.rmtree(stale, ignore_errors=True)


SIDE_STEM_BYTES = 200  # side files add up to 24 bytes to a name; the filesystem allows 255


def side_stem(name: str) -> str:
    """What the side files of a destination `name` (`.STEM.qmtp-lock`, `-partial-*`, `-old`) carry of it: the name,
    or for a name too long to take their suffixes within 255 bytes its start and a hash of the whole."""
    encoded = os.fsencode(name)
    if len(encoded) <= SIDE_STEM_BYTES:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    return _cut(name, 160) + "~" + digest


def _cut(name: str, size: int) -> str:
    """The longest start of `name` of at most `size` bytes (whole characters)."""
    name = name[:size]
    while len(os.fsencode(name)) > size:
        name = name[:-1]
    return name


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


class _DestinationLock:
    """An exclusive lock on one destination, held for the whole conversion, so two runs never write it at once.

    The lock file `.DST.qmtp-lock` sits beside DST and is removed when the holder is done; a run that finds it
    locked stops at once and says so. (A removed lock file may still be held by a run that opened it before the
    removal: the holder checks after locking that the file it holds is the one at the path.) Folders created
    on the way to DST are recorded, so a failed run removes them again.
    """

    def __init__(self, dst: Path):
        self.dst = dst.absolute()
        self.created: list[Path] = []
        self.fd = None
        self.path = None

    def __enter__(self):
        import fcntl

        parent = self.dst.parent
        if not parent.exists():
            self.make_parents()
        self.path = parent / f".{side_stem(self.dst.name)}.qmtp-lock"
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
            except OSError as err:
                self.remove_parents()
                if err.errno == errno.EROFS:
                    raise QmtpError(f"{parent}: is on a read-only filesystem; choose a destination on a writable one") from None
                raise QmtpError(f"{self.path}: cannot create the destination's lock ({err.strerror or err})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self.remove_parents()
                raise QmtpError(f"{self.dst}: another conversion is writing this destination right now; wait for it "
                                f"to finish (then --force replaces its result) or choose another destination") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return self
            os.close(fd)  # the holder before us removed this file: lock the new one

    def make_parents(self) -> None:
        missing = [p for p in [self.dst.parent, *self.dst.parent.parents] if not p.exists()]
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            except OSError as err:
                self.remove_parents()
                if err.errno == errno.EROFS:
                    raise QmtpError(f"{folder.parent}: is on a read-only filesystem; choose a destination on a "
                                    f"writable one") from None
                raise QmtpError(f"{folder}: cannot be created ({err.strerror or err})") from None
            self.created.append(folder)

    def remove_parents(self) -> None:
        if self.fd is not None and self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = []

    def __exit__(self, kind, value, traceback):
        if kind is not None:  # refused or failed: the folders made on the way go again
            self.remove_parents()
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        return False


def _check_head(source: Source, allow_incomplete: bool) -> str:
    """The head as `Conversion.head` names it: "full", "shared expert only" or "none"."""
    src, status = source.path, source.head_status()
    if status == HEAD_NOT_DECLARED:
        return "none"
    if status == HEAD_MISSING:
        warnings.warn(f"{src}: the config declares an MTP head but no mtp.* tensors are stored: the converted "
                      f"model has no head and cannot draft", stacklevel=3)
        return "none"
    if status == HEAD_FULL:
        return HEAD_FULL
    if not allow_incomplete:
        raise IncompleteHeadError(
            f"{src}: the MTP head has no routed experts (mtp.layers.0.mlp.experts.* absent), so it would draft "
            f"with its shared expert alone; convert the complete checkpoint, or pass --allow-incomplete-head"
        )
    warnings.warn(
        f"{src}: CONVERTING AN INCOMPLETE MTP HEAD: it has no routed experts, so the converted model drafts "
        f"with the head's shared expert alone and its acceptance will be far below the complete head's",
        stacklevel=3,
    )
    return HEAD_SHARED_ONLY


def _check_disk_space(dst: Path, needed: int) -> None:
    parent = dst.parent if dst.parent.exists() else _existing_ancestor(dst.absolute())
    _check_writable(parent)
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise QmtpError(f"{parent}: {free / 1e9:.2f} GB free, but the conversion needs about {needed / 1e9:.2f} GB; "
                        f"free some space or choose another destination")


def replace_directory(tmp: Path, dst: Path) -> None:
    """Move the finished temporary directory into place; an old `dst` is removed only after that.

    A run killed between the two renames, or while removing the old directory, leaves `.DST.qmtp-old`
    behind (and no `dst` in the first case): the next run removes it, whether or not `dst` exists then.
    """
    _flush_to_disk(tmp)
    old = dst.with_name(f".{side_stem(dst.name)}.qmtp-old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def _flush_to_disk(directory: Path) -> None:
    """fsync every file of `directory` and the directory itself, so that after a crash or power cut the
    renamed folder never holds files the disk has only partly received."""
    for file in directory.iterdir():
        with open_regular(file) as f:
            os.fsync(f.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _stop(start: int, block) -> int | None:
    """The row after the last of `block` (rows start.. of its tensor); None for a scalar tensor's one block."""
    return start + block.shape[0] if block.ndim else None


class _TensorWriter:
    """The output tensors as (name, dtype, nbytes, shape, produce) entries; `produce()` yields the tensor's
    bytes in pieces, a block of about CHUNK_BYTES of its rows at a time, so no tensor is ever whole in memory.

    A quantized weight is three consecutive entries (codes, scales, biases) made by one pass of mx.quantize
    over its blocks: the codes' producer yields each block's codes and keeps its scales and biases (each 1/32
    of the weight's bytes at group 64 in bf16, 1/16 at group 32) until their turn; then they are dropped.
    """

    def __init__(self, ckpt, plan, config, policy, dtype, applying, where=None):
        self.plan, self.policy, self.dtype, self.applying = plan, policy, dtype, applying
        self.where = where if where is not None else ckpt.path  # how errors name the source
        self.reader = layout.Reader(ckpt, config)
        self.names = list(policy)  # trunk, then head, in the config's order (that of `sizes`)
        self.pending: dict[str, tuple[list, list]] = {}
        self.streams = None  # made on first use, by the thread that quantizes
        self.entries, self.record = [], {}
        for i, name in enumerate(self.names):
            t, key = policy[name], layout.mlx_name(name)
            following = self.names[i + 1] if i + 1 < len(self.names) else None
            if t.bits is None:
                out_dtype = "F32" if keeps_float32(name) else dtype
                self._add(key, out_dtype, t.shape, lambda n=name, d=out_dtype, f=following: self._plain(n, d, f))
                self.record[key] = {"bits": None, "group_size": None, "dtype": out_dtype}
            else:
                codes, groups = layout.quantized_shapes(t.shape, t.bits, t.group_size)
                stem = key[: -len(".weight")]
                self._add(key, "U32", codes, lambda n=name, f=following: self._quantize(n, f))
                self._add(stem + ".scales", dtype, groups, lambda n=name: self._take(n, 0))
                self._add(stem + ".biases", dtype, groups, lambda n=name: self._take(n, 1))
                self.record[key] = {"bits": t.bits, "group_size": t.group_size, "dtype": dtype}

    def _add(self, name, dtype, shape, produce):
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][2]
        self.entries.append((name, dtype, nbytes, tuple(shape), produce))

    def _blocks(self, name, following, out_dtype):
        """The tensor `name`, fixed and in `out_dtype`, as consecutive blocks of rows of its first axis, each
        read from the source on its own, with the first row of each: (start, block). Cutting there changes no
        byte: both fixes act on each row alone (the norm shift elementwise, the conv kernel on its last two axes)
        and every quantization group lies within a row."""
        shape = self.policy[name].shape
        if not shape:  # a scalar: one block
            yield 0, self._block(name, None, out_dtype)
        else:
            row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * DTYPES[out_dtype][2]
            step = max(1, CHUNK_BYTES // max(1, row_bytes))
            for start in range(0, shape[0], step):
                yield start, self._block(name, (start, min(shape[0], start + step)), out_dtype)
        # Keep a stored tensor read for slicing only while the next output tensor slices it too.
        recipe = self.plan.recipes[name]
        if following is None or self.plan.recipes[following].sources[0] != recipe.sources[0]:
            self.reader.forget()

    def _block(self, name, rows, out_dtype):
        """Rows `rows` (start, stop; None: a scalar tensor whole) of tensor `name`, fixed, in `out_dtype` (lazy)."""
        import mlx.core as mx

        dtype = getattr(mx, DTYPES[out_dtype][1])
        recipe = self.plan.recipes[name]
        return fixes_mod.apply(name, self.reader.materialise(recipe, rows), self.applying).astype(dtype)

    @staticmethod
    def _total(block, stream=None):
        """The sum of `block` (lazy): NaN or infinite when the block holds a NaN or an Inf, since IEEE sums
        propagate them, and finite otherwise unless large finite values overflowed it. A sum runs about nine
        times as fast as `isfinite` on the CPU (2.8 against 0.31 GB/s in bfloat16), so the exact per-row test
        (`_rows_finite`) runs only on a block whose sum is not finite."""
        return block.sum(stream=stream)

    @staticmethod
    def _rows_finite(block, stream=None):
        """Per row of `block` (its first axis), whether it holds no NaN or Inf (lazy: evaluated with the block)."""
        import mlx.core as mx

        finite = mx.isfinite(block, stream=stream)
        return finite.all(axis=tuple(range(1, block.ndim)), stream=stream) if block.ndim > 1 else finite

    def _check(self, name, start: int, stop: int | None, total, out_dtype) -> None:
        """Refuse a block (rows start..stop of tensor `name`) holding NaN or Inf, naming the stored tensor:
        quantized, a NaN would be hidden in its group's scale (making the whole group NaN), and written, it
        would change tokens with no warning. It is raised before the output replaces the destination (nothing
        is left). `total` is the block's evaluated sum: when it is finite so is every value; when not, the block
        is read again and tested value by value (large finite values may overflow a sum)."""
        import mlx.core as mx

        if math.isfinite(total.item()):
            return
        block = self._block(name, None if stop is None else (start, stop), out_dtype)
        finite = self._rows_finite(block)
        mx.eval(finite)
        if finite.all().item():
            return
        row = start + (int(mx.argmin(finite.reshape(-1)).item()) if finite.ndim else 0)
        recipe = self.plan.recipes[name]
        stored = recipe.sources[row] if recipe.op == "stack" else recipe.sources[0]
        where = f"row {row} of {name}" if finite.ndim else ""
        raise nonfinite_error(self.where, self.reader.ckpt, stored, where)

    def _plain(self, name, out_dtype, following):
        import mlx.core as mx

        for start, block in self._blocks(name, following, out_dtype):
            total = self._total(block)
            mx.eval(block, total)
            self._check(name, start, _stop(start, block), total, out_dtype)
            yield tensor_bytes(block)

    def _quantize(self, name, following):
        import mlx.core as mx

        t = self.policy[name]
        if self.streams is None:
            self.streams = [mx.new_stream(mx.cpu) for _ in range(QUANTIZE_STREAMS)]
        scales, biases = self.pending[name] = ([], [])
        blocks = self._blocks(name, following, self.dtype)
        # Neighbouring blocks go to the CPU streams, i.e. to two cores, and are evaluated together.
        while batch := list(itertools.islice(blocks, len(self.streams))):
            parts = [mx.quantize(block, group_size=t.group_size, bits=t.bits, stream=stream)
                     for (_, block), stream in zip(batch, self.streams)]
            totals = [self._total(block, stream) for (_, block), stream in zip(batch, self.streams)]
            spans = [(start, _stop(start, block)) for start, block in batch]
            del batch
            mx.eval(parts, totals)
            for (start, stop), total in zip(spans, totals):
                self._check(name, start, stop, total, self.dtype)
            for codes, block_scales, block_biases in parts:
                scales.append(block_scales)
                biases.append(block_biases)
                yield tensor_bytes(codes)
            del parts, codes

    def _take(self, name, part):
        """The scales (part 0) or biases (1) `_quantize` kept for `name`, a block at a time, each dropped once
        handed out."""
        kept = self.pending[name][part]
        while kept:
            yield tensor_bytes(kept.pop(0))
        if part == 1:
            del self.pending[name]

    def quantization_block(self, bits: int, group_size: int) -> dict:
        """mlx-lm's config block: the default width, then the router gates (always listed, as mlx-lm lists
        them) and every other module stored at another width."""
        block = {"group_size": group_size, "bits": bits, "mode": "affine"}
        for name in self.names:
            t = self.policy[name]
            if t.bits is not None and ((t.bits, t.group_size) != (bits, group_size) or is_router(name)):
                block[layout.mlx_name(name)[: -len(".weight")]] = {"group_size": t.group_size, "bits": t.bits}
        return block


def _write_weights(directory: Path, entries, metadata: dict, shards: int, progress: bool,
                   cache_limit: int | None = None) -> list[str]:
    """Write the entries into one file, or `shards` files and an index, and the digests of the bytes written
    (`qmtp.digests`, hashed as they are written); returns the file names.

    The tensors are read and quantized on a worker thread a few pieces ahead of the writing (`_Pieces`), so a
    conversion keeps two cores busy and holds a few blocks of rows, not whole tensors. MLX keeps freed buffers
    for reuse up to `cache_limit` bytes (fresh pages cost more than the copies). A progress bar (on stderr)
    counts bytes and tensors as they are written.
    """
    import mlx.core as mx
    from tqdm import tqdm

    bar = tqdm(total=sum(e[2] for e in entries), unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
               disable=not progress, dynamic_ncols=True)
    pieces = _Pieces([e[4] for e in entries])
    done = 0
    whole, rows = {}, {}

    def counted(i):
        def run():
            nonlocal done
            name, _, nbytes, shape, _ = entries[i]
            stacked = digests_mod.is_stacked_experts(name) and len(shape) > 1 and shape[0]
            digest = digests_mod.Stream(nbytes // shape[0] if stacked else None)
            for piece in pieces.of(i):
                bar.update(piece.nbytes)
                digest.update(piece)
                yield piece
            (rows if stacked else whole)[name] = digest.result()
            done += 1
            bar.set_postfix_str(f"{done}/{len(entries)} tensors", refresh=False)
        return run

    # scales and biases stay in the file of their codes
    groups = shard_groups([e[2] for e in entries], shards,
                          can_start=lambda i: not entries[i][0].endswith(layout.QUANTIZED_PARTS))
    files = ["model.safetensors"] if len(groups) == 1 else [shard_name(i, len(groups)) for i in range(1, len(groups) + 1)]
    previous_limit = mx.set_cache_limit(cache_limit) if cache_limit is not None else None
    try:
        for file, group in zip(files, groups):
            tensors = []
            for i in group:
                name, dtype, _, shape, _ = entries[i]
                tensors.append((name, dtype, shape, counted(i)))
            write_safetensors(directory / file, tensors, metadata)
    finally:
        pieces.close()
        bar.close()
        if previous_limit is not None:
            mx.set_cache_limit(previous_limit)
        mx.clear_cache()
    if len(groups) > 1:
        write_index(directory, {entries[i][0]: file for file, group in zip(files, groups) for i in group},
                    sum(e[2] for e in entries), format="mlx")
    digests_mod.write(directory, whole, rows)
    return files


class _Pieces:
    """Runs the producers in order on one worker thread and hands their pieces to the caller in that order,
    at most QUEUE_PIECES ahead: while the caller writes one piece the next are read and quantized, and memory
    holds a few pieces whatever the size of a tensor. Every MLX array is made and evaluated on the worker (MLX
    binds an array to its thread's streams); the caller only writes evaluated bytes."""

    def __init__(self, produces):
        self.queue = queue.Queue(maxsize=QUEUE_PIECES)
        self.stop = threading.Event()
        self.worker = threading.Thread(target=self._run, args=(produces,), name="qmtp-convert", daemon=True)
        self.worker.start()

    def _run(self, produces) -> None:
        # this thread makes MLX arrays: it frees its streams and compiled traces as it ends, as a decoding
        # thread does, so that the interpreter's shutdown never races MLX's thread-exit cleanup
        release_at_thread_exit()
        try:
            for i, produce in enumerate(produces):
                for piece in produce():
                    if not self._put((i, piece)):
                        return
                    del piece
                if not self._put((i, None)):  # entry i is complete
                    return
        except BaseException as err:  # handed to the caller, who raises it (Ctrl-C's KeyboardInterrupt too)
            self._put((None, err))

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room; False once the caller has stopped reading."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def of(self, i: int):
        """The pieces of entry `i` as they come; entries are asked for in order, each to its end."""
        while True:
            entry, piece = self.queue.get()
            if entry is None:
                raise piece
            if entry != i:
                raise RuntimeError(f"convert: entry {entry} produced while entry {i} was being written")
            if piece is None:
                return
            yield piece
            del piece

    def close(self) -> None:
        """Stop the worker: a piece in progress finishes before the caller cleans up; what waits is dropped."""
        self.stop.set()
        self.worker.join()
        while not self.queue.empty():
            self.queue.get_nowait()
