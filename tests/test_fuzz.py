"""Fuzzing the safetensors header reader: no byte string may crash it, hang it or make it allocate.

Whatever is on disk, `Checkpoint`'s header parser (helpers' `read_header`) either parses it into consistent
`TensorInfo`s or raises ONE `CheckpointError` naming the file; `read_tensor` on what it returned never reads past
the file; a mutated real checkpoint makes `Checkpoint` / `qmtp.load` work or fail with a `QmtpError`.

The default budget keeps this file under 20 s on a small, busy CI machine and is deterministic
(`derandomize=True`, no example database), so CI results never depend on a previous run: the same source
tree gives the same examples. (Hypothesis may still cache constants it collects from the source in the
gitignored `.hypothesis/`; that cache only saves time, it does not change what is generated.) To hunt deeper:

    QMTP_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py          # more examples, still reproducible
    QMTP_FUZZ_SEED=123 QMTP_FUZZ_EXAMPLES=2000 pytest ...       # a different random stream
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import event, fuzz, small_config
from helpers import read_header
import qmtp
from qmtp import checkpoint as ckpt_mod
from qmtp.tiny import synthetic
from qmtp.checkpoint import DTYPES, MAX_HEADER_BYTES, Checkpoint, read_tensor
from qmtp.errors import CheckpointError, QmtpError

# ---- budget ------------------------------------------------------------------------------------------------
_EXTRA = int(os.environ.get("QMTP_FUZZ_EXAMPLES", "0") or 0)


@pytest.fixture(scope="module")
def scratch():
    directory = Path(tempfile.mkdtemp(prefix="qmtp-fuzz-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def parse(path: Path):
    """read_header(path): the result, or None after checking the error is a CheckpointError naming the file."""
    start = time.perf_counter()
    try:
        result = read_header(path)
    except CheckpointError as err:
        message = str(err)
        assert str(path) in message, f"error does not name the file: {message[:300]}"
        event("read_header: CheckpointError")
        return None
    finally:  # no hang: headers here are at most a few MB, read in well under a second
        elapsed = time.perf_counter() - start
        assert elapsed < 10, f"read_header took {elapsed:.1f} s on {path.stat().st_size} bytes"
    event(f"read_header: parsed ({'no' if not result[0] else 'some'} tensors)")
    return result


def check_consistent(path: Path, tensors, metadata) -> None:
    """Every returned TensorInfo lies inside the file's data region and its size matches dtype and shape."""
    size = path.stat().st_size
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    for name, info in tensors.items():
        assert info.name == name and name != "__metadata__"
        assert info.file == path
        assert info.dtype in DTYPES
        assert isinstance(info.shape, tuple) and all(type(d) is int and d >= 0 for d in info.shape)
        assert info.nbytes == math.prod(info.shape) * DTYPES[info.dtype][2]
        assert 8 + header_len <= info.offset
        assert info.offset + info.nbytes <= size
        assert info.nbytes <= size  # read_tensor's allocation is bounded by the file
        assert info.numel == math.prod(info.shape)


def check_reads(tensors) -> None:
    for info in tensors.values():
        try:
            array = read_tensor(info)
        except CheckpointError as err:
            assert str(info.file) in str(err)
            event("read_tensor: CheckpointError")
            continue
        event("read_tensor: read")
        assert tuple(array.shape) == info.shape


def check_parsed(path: Path, reads: bool = False) -> None:
    """parse(path), then check whatever read_header accepted (and, with `reads`, read each tensor back)."""
    result = parse(path)
    if result is not None:
        check_consistent(path, *result)
        if reads:
            check_reads(result[0])


# ---- 1. arbitrary bytes --------------------------------------------------------------------------------------
def _with_length(n: int, rest: bytes = b"") -> bytes:
    return struct.pack("<Q", n) + rest


@fuzz(200)
@given(st.binary(max_size=512))
@example(b"")
@example(b"\x00" * 7)
@example(_with_length(0))
@example(_with_length(2, b"{}"))
@example(_with_length(2, b"[]"))
@example(_with_length(2**64 - 1, b"{}"))
@example(_with_length(MAX_HEADER_BYTES + 1, b"{}"))
@example(_with_length(4, b"null"))
@example(_with_length(3, b"\xef\xbb\xbf"))
@example(_with_length(4, b'"\xff"x'))
def test_arbitrary_bytes(scratch, data):
    path = scratch / "arbitrary.safetensors"
    path.write_bytes(data)
    check_parsed(path)


@fuzz(200)
@given(st.binary(max_size=256), st.binary(max_size=256), st.integers(-3, 3))
def test_arbitrary_header_bytes_with_right_length(scratch, header, data, skew):
    """Random header bytes behind a length field that (nearly) matches, so the JSON parser sees them."""
    path = scratch / "arbitrary_header.safetensors"
    path.write_bytes(_with_length(max(len(header) + skew, 0), header + data))
    check_parsed(path, reads=True)


# ---- 2. structured headers -------------------------------------------------------------------------------------
class Raw:
    """JSON text spliced in verbatim (what json.dumps cannot or will not write)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


class Obj:
    """A JSON object as a list of pairs, so keys may repeat."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __repr__(self):
        return f"Obj({self.pairs!r})"


def dump(value, ascii_only: bool) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=ascii_only)}:{dump(v, ascii_only)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return dump(Obj(value.items()), ascii_only)
    if isinstance(value, list):
        return "[" + ",".join(dump(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 7, 2**70, 10**30, -(2**63), -(2**70)]
RAW_NUMBERS = [
    "1" * 5000,  # past Python's int-from-string digit limit
    "-" + "9" * 4400,
    "1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity", "-0", "0.0", "1E2", "4.0",
]
RAW_NESTED = ["[" * 3000 + "]" * 3000, "{\"a\":" * 3000 + "0" + "}" * 3000, "[" * 900 + "]" * 900]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 300),
    st.sampled_from(HUGE_INTS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(RAW_NUMBERS).map(Raw),
)
_nested_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)
# one value in 20 is nested past the parser's depth limit (more often, it would hide everything else)
json_values = st.integers(0, 19).flatmap(lambda i: st.sampled_from(RAW_NESTED).map(Raw) if i == 0 else _nested_values)

dtypes = st.one_of(
    st.sampled_from(sorted(DTYPES)),
    st.sampled_from(["bf16", "F8_E4M3", "F8_E5M2", "", " BF16", "BF16\u0000", "I4", "C64", "__proto__"]),
    scalars,
    json_values,  # lists and objects too: not even hashable
)
dims = st.one_of(st.integers(0, 6), st.integers(0, 6), st.integers(-3, 10**4), st.sampled_from(HUGE_INTS + [0]), scalars)
# integer shapes a writer would not produce but whose byte count can still be matched by data_offsets
edge_shapes = st.one_of(
    st.tuples(st.integers(0, 4), st.lists(st.sampled_from([2**31, 2**40, 2**62, 2**63, 2**70, 10**30, 10**200]), min_size=1, max_size=4))
    .map(lambda cut: cut[1][:cut[0]] + [0] + cut[1][cut[0]:]),  # empty (a 0 somewhere) but otherwise huge
    st.lists(st.sampled_from([0, 1, 1, 1]), min_size=30, max_size=80),  # more dimensions than numpy/MLX take
    st.lists(st.sampled_from([1, 1, 2, 2**31, 2**63 - 1, 2**64]), min_size=1, max_size=4),  # huge, non-empty
    st.just([]),
)
shapes = st.one_of(
    st.lists(st.integers(0, 5), max_size=4),
    st.lists(dims, max_size=6),
    st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=2),  # nested
    edge_shapes,
    json_values,
)
offsets = st.one_of(
    st.tuples(st.integers(0, 64), st.integers(0, 64)).map(list),
    st.lists(st.one_of(st.integers(-5, 2**12), st.sampled_from(HUGE_INTS), scalars), max_size=4),
    json_values,
)
names = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["__metadata__", "", "a", "A", "a ", "model.embed_tokens.weight", "\ud800", "\u00e9", "e\u0301"]),
)
metadatas = st.one_of(
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
    json_values,
)


class Case:
    """A generated file: header JSON bytes and data bytes, with a repr short enough to read in a failure."""

    def __init__(self, raw: bytes, data: bytes):
        self.raw, self.data = raw, data

    def __repr__(self):
        head = self.raw if len(self.raw) <= 400 else self.raw[:200] + b"..." + self.raw[-100:]
        return f"Case(raw={head!r} ({len(self.raw)} bytes), data={len(self.data)} bytes)"


@st.composite
def headers(draw):
    """Case(header JSON bytes, data bytes): a header mixing consistent entries with broken ones."""
    pairs, cursor = [], 0
    clean = draw(st.integers(0, 2)) == 0  # a third of the headers have only well-formed entries
    kinds = ["valid", "valid", "valid_anywhere", "edge"] + ([] if clean else ["tweaked", "random"])
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(kinds))
        name = draw(names)
        if kind == "random":
            pairs.append((name, draw(json_values)))
            continue
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(edge_shapes if kind == "edge" else st.lists(st.integers(0, 4), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype][2]
        if nbytes > 4096:  # a huge non-empty edge shape: its offsets are what the file cannot hold
            begin = draw(st.integers(0, 8))
            pairs.append((name, {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + nbytes]}))
            continue
        begin = draw(st.integers(0, 64)) if kind == "valid_anywhere" else cursor
        cursor = max(cursor, begin + nbytes)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + nbytes]}
        if kind == "tweaked":  # one field replaced by something from the fuzzier strategies
            field = draw(st.sampled_from(["dtype", "shape", "shape", "data_offsets", "extra", "drop"]))
            if field == "drop":
                del entry[draw(st.sampled_from(sorted(entry)))]
            else:
                entry[field] = draw({"dtype": dtypes, "shape": shapes, "data_offsets": offsets, "extra": json_values}[field])
            new_shape = entry.get("shape")
            if field == "shape" and isinstance(new_shape, list) and all(type(d) is int for d in new_shape) and draw(st.booleans()):
                # byte range recomputed for the strange shape, so the checks after the size match are reached
                size = math.prod(new_shape) * DTYPES[dtype][2] if len(new_shape) < 100 else 0
                entry["data_offsets"] = [begin, begin + size]
            if draw(st.booleans()):
                entry = Obj(list(entry.items()) + [(draw(st.sampled_from(sorted(entry))), draw(json_values))])
        pairs.append((name, entry))
    if draw(st.booleans()):
        where = draw(st.integers(0, len(pairs)))
        pairs.insert(where, ("__metadata__", draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3) if clean else metadatas)))
    if pairs and draw(st.integers(0, 4)) == 0:  # a repeated key, with either value
        pairs.append((draw(st.sampled_from([k for k, _ in pairs])), draw(st.sampled_from([v for _, v in pairs]))))
    top = Obj(pairs) if clean or draw(st.integers(0, 9)) else draw(json_values)  # sometimes not an object at all
    ascii_only = draw(st.booleans())
    raw = dump(top, ascii_only).encode("utf-8", "surrogatepass")
    raw += b" " * draw(st.sampled_from([0, -len(raw) % 8, 3]))
    data_len = draw(st.one_of(st.just(cursor), st.integers(max(cursor - 4, 0), cursor + 8), st.integers(0, 200)))
    if clean:
        data_len = max(data_len, cursor)
    data = draw(st.binary(min_size=data_len, max_size=data_len))
    return Case(raw, data)


@fuzz(250)
@given(headers(), st.sampled_from([0, 0, 0, 0, 0, 0, 1, -1, 8, -8]))
def test_structured_headers(scratch, case, skew):
    raw, data = case.raw, case.data
    path = scratch / "structured.safetensors"
    path.write_bytes(_with_length(max(len(raw) + skew, 0), raw + data))
    check_parsed(path, reads=True)


def _write_header(path: Path, text: str, data: bytes = b"\x00" * 16) -> None:
    raw = text.encode()
    path.write_bytes(_with_length(len(raw), raw + data))


# What the fuzzer found crashing read_header (or read_tensor on what it returned) before the checks were
# tightened, with the exception each raised then.
KNOWN_CRASHERS = {
    "deep nesting (RecursionError)": "[" * 100_000 + "]" * 100_000,
    "int past the digit limit (ValueError)": '{"t": {"dtype": "U8", "shape": [' + "1" * 5000 + '], "data_offsets": [0, 1]}}',
    "dtype is a list (TypeError: unhashable)": '{"t": {"dtype": [], "shape": [], "data_offsets": [0, 1]}}',
    "dtype is an object (TypeError: unhashable)": '{"t": {"dtype": {}, "shape": [], "data_offsets": [0, 1]}}',
    "shape overflows float64 (OverflowError)": '{"t": {"dtype": "U8", "shape": [' + "9" * 400 + ', 0], "data_offsets": [0, 0]}}',
    "shape product is inf (OverflowError)": '{"t": {"dtype": "U8", "shape": [1' + "0" * 200 + ", 1" + "0" * 200 + '], "data_offsets": [0, 1]}}',
    "inf times zero is nan (ValueError)": '{"t": {"dtype": "U8", "shape": [1' + "0" * 200 + ", 1" + "0" * 200 + ', 0], "data_offsets": [0, 0]}}',
    "empty, dim past MLX int32 (read_tensor OverflowError)": '{"t": {"dtype": "U8", "shape": [0, 1099511627776], "data_offsets": [0, 0]}}',
    "empty, past numpy's size (read_tensor ValueError)": '{"t": {"dtype": "F32", "shape": [0, 4611686018427387904, 4611686018427387904], "data_offsets": [0, 0]}}',
    "empty, dim past int64 (numel OverflowError)": '{"t": {"dtype": "U8", "shape": [0, 1180591620717411303424], "data_offsets": [0, 0]}}',
    "65 dimensions (read_tensor ValueError)": '{"t": {"dtype": "U8", "shape": [' + ",".join(["1"] * 65) + '], "data_offsets": [0, 1]}}',
}


@pytest.mark.parametrize("text", KNOWN_CRASHERS.values(), ids=KNOWN_CRASHERS.keys())
def test_known_crashers(scratch, text):
    path = scratch / "known.safetensors"
    _write_header(path, text)
    assert parse(path) is None  # each is a corrupt header: refused with a CheckpointError


def _json_depth_limit() -> int:
    """The deepest list json.loads parses from here (it depends on the current stack)."""
    low, high = 1, 100_000
    while low < high:
        mid = (low + high + 1) // 2
        try:
            json.loads("[" * mid + "]" * mid)
            low = mid
        except RecursionError:
            high = mid - 1
    return low


@pytest.mark.parametrize(
    "template",
    [
        '{"t": {"dtype": "U8", "shape": %s, "data_offsets": [0, 0]}}',
        '{"t": {"dtype": %s, "shape": [], "data_offsets": [0, 1]}}',
        '{"t": {"dtype": "U8", "shape": [1], "data_offsets": %s}}',
        '{"t": %s}',
        '{"__metadata__": {"a": %s}}',
        '{"__metadata__": %s}',
    ],
    ids=["shape", "dtype", "offsets", "entry", "metadata-value", "metadata"],
)
def test_nesting_at_the_parsers_limit(scratch, template):
    """Values nested as deep as json still parses must not blow the stack in the checks or their messages."""
    limit = _json_depth_limit()
    path = scratch / "deep.safetensors"
    for depth in range(max(limit - 12, 1), limit + 3):
        _write_header(path, template % ("[" * depth + "]" * depth))
        check_parsed(path)


def test_valid_zero_size_and_scalar_tensors_still_parse(scratch):
    """The tightened checks keep what real files contain: scalars, empty tensors with small dims."""
    header = {
        "scalar": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
        "empty": {"dtype": "BF16", "shape": [0, 16], "data_offsets": [4, 4]},
        "v": {"dtype": "U8", "shape": [3], "data_offsets": [4, 7]},
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    path = scratch / "valid.safetensors"
    path.write_bytes(_with_length(len(raw), raw + bytes(range(7))))
    tensors, metadata = read_header(path)
    assert metadata == {"format": "pt"}
    assert {n: (i.shape, i.nbytes) for n, i in tensors.items()} == {"scalar": ((), 4), "empty": ((0, 16), 0), "v": ((3,), 3)}
    check_consistent(path, tensors, metadata)
    assert read_tensor(tensors["v"]).tolist() == [4, 5, 6]
    assert tuple(read_tensor(tensors["empty"]).shape) == (0, 16)


# ---- 3. mutations of a real checkpoint --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_checkpoint(scratch):
    source = synthetic.write_checkpoint(scratch / "real", small_config())
    file = source / "model.safetensors"
    blob = file.read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    return source, blob, header_len


_LOADS = {"left": max(4, _EXTRA // 100)}  # qmtp.load is the expensive part: only a few per run


def _mutations(header_end: int, total: int):
    pos = st.integers(0, header_end - 1)
    return st.lists(
        st.one_of(
            st.tuples(st.just("flip"), pos, st.integers(0, 7)),
            st.tuples(st.just("set"), pos, st.sampled_from(b'0123456789"{}[],: .-eE\x00\xff')),
            st.tuples(st.just("digit"), st.integers(0, 10**6), st.sampled_from(b"0123456789")),
            st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=4)),
            st.tuples(st.just("delete"), pos, st.integers(1, 4)),
            st.tuples(st.just("truncate"), st.integers(0, total), st.just(0)),
        ),
        min_size=1,
        max_size=3,
    )


def mutate(blob: bytes, header_len: int, ops) -> bytes:
    data = bytearray(blob)
    for op, where, arg in ops:
        end = min(8 + header_len, len(data))
        if op == "truncate":
            del data[min(where, len(data)):]
        elif end == 0:
            continue
        elif op == "flip":
            data[where % end] ^= 1 << arg
        elif op == "set":
            data[where % end] = arg
        elif op == "digit":  # keeps the JSON valid more often, so the semantic checks get exercised
            digits = [i for i in range(8, end) if 0x30 <= data[i] <= 0x39]
            if digits:
                data[digits[where % len(digits)]] = arg
        elif op == "insert":
            data[where % end:where % end] = arg
        elif op == "delete":
            del data[where % end:where % end + arg]
    return bytes(data)


def test_mutations(real_checkpoint, scratch):
    source, blob, header_len = real_checkpoint
    opened = []  # mutated files Checkpoint accepted: the property must not hold only vacuously

    @fuzz(150)
    @given(_mutations(8 + header_len, len(blob)))
    def run(ops):
        target = scratch / "mutated"
        target.mkdir(exist_ok=True)
        shutil.copyfile(source / "config.json", target / "config.json")
        (target / "model.safetensors").write_bytes(mutate(blob, header_len, ops))
        try:
            ckpt = Checkpoint(target)
        except QmtpError as err:
            assert str(target) in str(err)
            event(f"Checkpoint: {type(err).__name__}")
            return
        event("Checkpoint: opened")
        check_consistent(target / "model.safetensors", ckpt.infos, ckpt.metadata)
        opened.append(ops)
        if _LOADS["left"] <= 0:
            return
        _LOADS["left"] -= 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                qmtp.load(target, tokenizer=False)
                event("load: loaded")
            except QmtpError as err:
                event(f"load: {type(err).__name__}")
        for w in caught:
            assert issubclass(w.category, UserWarning) and not issubclass(w.category, (DeprecationWarning, RuntimeWarning)), w

    run()
    assert opened, "no mutation left a readable checkpoint: the mutations are too destructive to test load()"


# ---- 4. length fields that lie, and memory ------------------------------------------------------------------
@pytest.fixture()
def read_sizes(monkeypatch):
    """Every f.read(n) that read_header makes, so a test can check it never asks for more than the file."""
    sizes = []
    real_open = open

    class Recording:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            sizes.append(n)
            return self._f.read(n)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    monkeypatch.setattr(ckpt_mod, "open", lambda *a, **k: Recording(real_open(*a, **k)), raising=False)
    return sizes


MB = 1024 * 1024


def _peak_during(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _garbage(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


@pytest.mark.parametrize(
    "claim",
    ["2**63", "2**64-1", "MAX+1", "MAX", "size-8", "size-7", "size-9", "size-8-1000", "0", "2"],
)
def test_lying_length_field_reads_at_most_the_file(scratch, read_sizes, claim):
    size = MB
    value = eval(claim, {"MAX": MAX_HEADER_BYTES, "size": size})  # noqa: S307 - a fixed table of expressions
    path = scratch / "lying.safetensors"
    path.write_bytes(_with_length(value, _garbage(size - 8)))
    peak = _peak_during(lambda: parse(path))
    assert read_sizes and all(0 <= n <= size for n in read_sizes), read_sizes
    assert peak < 50 * MB, f"read_header peaked at {peak / MB:.1f} MB on a 1 MB file"


@pytest.mark.parametrize(
    "body",
    [
        b"[" + b"{}," * (MB // 3 - 2) + b"{}]",  # many small objects: the most Python objects per byte
        b"[" + b"[]," * (MB // 3 - 2) + b"[]]",
        b'{"a":{"dtype":"U8","shape":[' + b"0," * (MB // 2 - 40) + b'0],"data_offsets":[0,0]}}',  # long shape
        b'{"__metadata__":{' + b",".join(b'"%d":"x"' % i for i in range(MB // 12)) + b"}}",
        b"[" * (MB - 1) + b"]",
    ],
    ids=["objects", "lists", "long-shape", "big-metadata", "deep"],
)
def test_big_json_header_memory(scratch, read_sizes, body):
    path = scratch / "big.safetensors"
    path.write_bytes(_with_length(len(body), body))
    size = path.stat().st_size
    peak = _peak_during(lambda: parse(path))
    assert read_sizes and all(0 <= n <= size for n in read_sizes), read_sizes
    assert peak < 50 * MB, f"read_header peaked at {peak / MB:.1f} MB on a {size / MB:.1f} MB file"


# ---- 5. config.json and the index (issue 17): the same promise for the other JSON files qmtp reads ---------------
from qmtp.config import ModelConfig  # noqa: E402
from qmtp.errors import ConfigError  # noqa: E402

_CONFIG_FIELDS = ["num_hidden_layers", "hidden_size", "vocab_size", "num_experts", "num_experts_per_tok",
                  "rms_norm_eps", "rope_theta", "max_position_embeddings", "layer_types", "tie_word_embeddings",
                  "model_type", "text_config", "rope_parameters", "full_attention_interval", "mtp_num_hidden_layers"]


@st.composite
def config_texts(draw, base: dict):
    """config.json text: the real one with a few fields replaced by fuzzier values (or spliced raw JSON)."""
    raw = json.loads(json.dumps(base))
    text = raw["text_config"]
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(_CONFIG_FIELDS))
        target = raw if field in ("text_config", "model_type") and draw(st.booleans()) else text
        target[field] = draw(json_values)
    top = raw if draw(st.integers(0, 9)) else draw(json_values)
    return dump(top, ascii_only=draw(st.booleans()))


def test_config_json(real_checkpoint, scratch):
    source, _, _ = real_checkpoint
    base = json.loads((source / "config.json").read_text())

    @fuzz(150)
    @given(config_texts(base))
    def run(text):
        path = scratch / "fuzzed_config.json"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        start = time.perf_counter()
        try:
            config = ModelConfig.from_file(path)
        except ConfigError as err:
            assert str(path) in str(err) and "\n" not in str(err), str(err)[:300]
            event("config: ConfigError")
        else:
            event("config: parsed")
            assert config.num_hidden_layers <= 1024 and math.isfinite(config.rms_norm_eps)
        assert time.perf_counter() - start < 10

    run()


@st.composite
def index_texts(draw, weight_map: dict):
    index = {"metadata": {"total_size": 0}, "weight_map": dict(weight_map)}
    if draw(st.integers(0, 9)) == 0:  # sometimes not an index at all
        return dump(draw(json_values), ascii_only=draw(st.booleans()))
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["value", "key", "drop", "map", "other"]))
        names = sorted(index["weight_map"]) if isinstance(index["weight_map"], dict) else []
        if what == "value" and names:
            index["weight_map"][draw(st.sampled_from(names))] = draw(st.one_of(json_values, names_strategy))
        elif what == "key":
            if isinstance(index["weight_map"], dict):
                index["weight_map"][draw(names_strategy)] = draw(st.sampled_from(sorted(set(weight_map.values()))))
        elif what == "drop" and names:
            del index["weight_map"][draw(st.sampled_from(names))]
        elif what == "map":
            index["weight_map"] = draw(json_values)
        else:
            index[draw(st.sampled_from(["metadata", "extra"]))] = draw(json_values)
    return dump(index, ascii_only=draw(st.booleans()))


names_strategy = st.one_of(names, st.sampled_from(["../x.safetensors", "/etc/passwd", "model-00001-of-00002.safetensors",
                                                   "a/b.safetensors", "", "."]))


def test_index(scratch):
    source = synthetic.write_checkpoint(scratch / "sharded", small_config(), shards=2)
    weight_map = json.loads((source / ckpt_mod.INDEX_NAME).read_text())["weight_map"]
    original = (source / ckpt_mod.INDEX_NAME).read_text()

    @fuzz(150)
    @given(index_texts(weight_map))
    def run(text):
        index = source / ckpt_mod.INDEX_NAME
        index.write_text(text, encoding="utf-8", errors="surrogatepass")
        start = time.perf_counter()
        try:
            ckpt = Checkpoint(source)
        except CheckpointError as err:
            assert str(source) in str(err), str(err)[:300]
            event("index: CheckpointError")
        else:
            event("index: opened")
            assert all(ckpt.infos[n].file.name == s for n, s in ckpt.index.items())
        assert time.perf_counter() - start < 10

    try:
        run()
    finally:
        (source / ckpt_mod.INDEX_NAME).write_text(original)
