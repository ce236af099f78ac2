"""Shared by the test files: one clear error, one line of it; reading a safetensors header, editing the files in place."""

import numpy as np
import pytest

from qmtp.checkpoint import DTYPES, Checkpoint, write_safetensors
from qmtp.errors import QmtpError


def read_header(path):
    """One safetensors file's header as `Checkpoint` parses and validates it: (tensors, metadata); reads no
    tensor data, and leaves the file closed."""
    checkpoint = Checkpoint(path)
    checkpoint.close()
    return checkpoint.infos, checkpoint.metadata


def expect(error_type, fn, *fragments) -> str:
    """`fn()` raises `error_type` (or a subclass) with a one-line message containing every fragment."""
    with pytest.raises(QmtpError) as info:
        fn()
    assert isinstance(info.value, error_type), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, f"{fragment!r} not in: {message}"
    return message


def one_line_error(err: str, *fragments) -> str:
    """A CLI's stderr holds exactly one line, `qmtp: error: ...`, containing every fragment; returns it."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qmtp: error: "), err
    for fragment in fragments:
        assert str(fragment) in lines[0], f"{fragment!r} not in: {lines[0]}"
    return lines[0]


def rewrite(file, drop=(), replace=None, add=None, reshape=None):
    """Rewrite one safetensors file: drop tensors, replace some by zeros of another (dtype, shape), add zero
    tensors, or give some a new shape over the same bytes. `replace` and `add` map a name to (dtype, shape),
    `reshape` a name to a shape; the other tensors keep their bytes and order."""
    replace, add, reshape = replace or {}, add or {}, reshape or {}
    infos, metadata = read_header(file)

    def zeros(dtype, shape):
        return bytes(int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][2])

    def raw(info):
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            return f.read(info.nbytes)

    entries = []
    for name, info in infos.items():
        if name in drop:
            continue
        if name in replace:
            dtype, shape = replace[name]
            entries.append((name, dtype, shape, lambda d=dtype, s=shape: zeros(d, s)))
        else:
            data = raw(info)
            entries.append((name, info.dtype, reshape.get(name, info.shape), lambda b=data: b))
    for name, (dtype, shape) in add.items():
        entries.append((name, dtype, shape, lambda d=dtype, s=shape: zeros(d, s)))
    write_safetensors(file, entries, metadata)


def relative_error(a, b) -> float:
    """Largest absolute difference over the largest magnitude of `b`, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())
