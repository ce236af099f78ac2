"""Reading checkpoints: listing from headers, loading one tensor, the released layouts, and bad input.

Every bad input must end in ONE `qmtp.errors` exception whose one-line message names the file (and the
tensor, where there is one), never in a numpy/MLX error from deep inside the loader.
"""

import json
import os
import shutil
import struct
import warnings

import numpy as np
import pytest

import mlx.core as mx

from helpers import expect, read_header, rewrite
from conftest import mtp_logits, small_config, trunk_logits
import qmtp
from qmtp import fixes as fixes_mod
from qmtp import layout
from qmtp.tiny import synthetic
from qmtp.checkpoint import INDEX_NAME, Checkpoint, write_safetensors
from qmtp.errors import (
    CheckpointError,
    ConfigError,
    IncompleteHeadError,
    QmtpError,
    TensorShapeError,
    UsageError,
)

CONFIG = small_config()
SEED = 7
TOKENS = mx.array([[5, 17, 3, 88, 41, 2, 60, 9, 33, 71, 12, 50]])
VISION = "model.visual.blocks.0.attn.qkv.weight"
P = "model.language_model."  # the released trunk prefix


def write(path, layout="released", dtype="F32", shards=1, **kwargs):
    return synthetic.write_checkpoint(path, CONFIG, layout=layout, dtype=dtype, shards=shards, seed=SEED, **kwargs)


def as_f32(array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def bf16(values: np.ndarray) -> np.ndarray:
    """What BF16 storage makes of float32 values."""
    return as_f32(mx.array(values).astype(mx.bfloat16))


def listing(ckpt: Checkpoint) -> dict:
    return {name: (info.dtype, info.shape) for name, info in ckpt.infos.items()}



# ---- editing safetensors files in place --------------------------------------------------------------------
def file_of(directory, name):
    return Checkpoint(directory).infos[name].file


def edit_config(directory, **text_fields):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    target = raw.get("text_config", raw)
    target.update(text_fields)
    path.write_text(json.dumps(raw))


def add_vision_tensor(directory):
    """A vision tower tensor, in an extra shard listed in the index (or an extra file next to model.safetensors)."""
    index_path = directory / INDEX_NAME
    shard = "model-visual.safetensors" if index_path.exists() else "visual.safetensors"
    write_safetensors(directory / shard, [(VISION, "F32", (48, 16), lambda: np.ones((48, 16), np.float32).tobytes())])
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"][VISION] = shard
        index_path.write_text(json.dumps(index))


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return write(tmp_path_factory.mktemp("released"))


@pytest.fixture(scope="module")
def baseline(released):
    """Logits and head logits of the released layout, the reference for every other way of loading it."""
    model = qmtp.load(released)
    return np.array(trunk_logits(model, TOKENS)), np.array(mtp_logits(model, TOKENS))


@pytest.fixture
def fresh(tmp_path):
    """A released checkpoint of our own to damage."""
    return write(tmp_path / "ckpt")


@pytest.fixture
def fresh_sharded(tmp_path):
    return write(tmp_path / "ckpt", shards=3)


# ---- listing ---------------------------------------------------------------------------------------------------
def n_head_tensors(config, one_by_one=True) -> int:
    """mtp.fc, 3 head norms, and one full-attention layer (2 norms, 6 attention, router, 4 shared-expert)."""
    experts = 3 * config.num_experts if one_by_one else 2
    return 4 + 2 + 6 + 1 + 4 + experts


def test_listing_single_file(tmp_path):
    path = write(tmp_path, dtype="BF16")
    ckpt = Checkpoint(path)
    assert ckpt.files == [path / "model.safetensors"]
    assert ckpt.metadata == {"format": "pt"}
    H, V, E, I = CONFIG.hidden_size, CONFIG.vocab_size, CONFIG.num_experts, CONFIG.moe_intermediate_size
    infos = ckpt.infos
    assert infos[f"{P}embed_tokens.weight"].shape == (V, H)
    assert infos["lm_head.weight"].shape == (V, H)
    assert infos[f"{P}norm.weight"].shape == (H,)
    # trunk experts fused, gate rows then up rows, no .weight suffix
    assert infos[f"{P}layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert infos[f"{P}layers.0.mlp.experts.down_proj"].shape == (E, H, I)
    # conv kernel in PyTorch layout [C, 1, K]
    assert infos[f"{P}layers.0.linear_attn.conv1d.weight"].shape == (CONFIG.linear_conv_dim, 1, CONFIG.linear_conv_kernel_dim)
    assert infos[f"{P}layers.3.self_attn.q_proj.weight"].shape == (2 * CONFIG.num_attention_heads * CONFIG.head_dim, H)
    # head experts one by one
    assert infos[f"mtp.layers.0.mlp.experts.{E - 1}.down_proj.weight"].shape == (H, I)
    assert infos["mtp.fc.weight"].shape == (H, 2 * H)
    assert sum(n.startswith("mtp.") for n in infos) == n_head_tensors(CONFIG)
    assert {info.dtype for info in infos.values()} == {"BF16"}
    assert ckpt.nbytes == sum(info.numel * 2 for info in infos.values())
    assert ckpt.nbytes < (path / "model.safetensors").stat().st_size
    assert len(ckpt) == len(ckpt.names()) and f"{P}norm.weight" in ckpt


def test_listing_sharded_matches_single_file(tmp_path):
    single = Checkpoint(write(tmp_path / "single", dtype="BF16"))
    path = write(tmp_path / "sharded", dtype="BF16", shards=4)
    sharded = Checkpoint(path)
    assert len(sharded.files) == 4
    assert [f.name for f in sharded.files] == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert listing(sharded) == listing(single)
    index = json.loads((path / INDEX_NAME).read_text())
    assert index["weight_map"] == {name: info.file.name for name, info in sharded.infos.items()}
    assert index["metadata"]["total_size"] == sharded.nbytes
    # every shard holds something, and no tensor is listed twice
    assert {info.file for info in sharded.infos.values()} == set(sharded.files)


def test_listing_a_single_file_path(released):
    ckpt = Checkpoint(released / "model.safetensors")
    assert listing(ckpt) == listing(Checkpoint(released))


@pytest.mark.parametrize("layout_name", ["text", "next"])
def test_listing_other_layouts(tmp_path, layout_name):
    ckpt = Checkpoint(write(tmp_path, layout=layout_name))
    assert all(n.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head", "mtp.")) for n in ckpt.names())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in ckpt
    fused = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert (fused in ckpt) == (layout_name == "next")


def test_read_header_reads_no_tensor_data(released):
    infos, metadata = read_header(released / "model.safetensors")
    assert metadata == {"format": "pt"}
    info = infos[f"{P}norm.weight"]
    assert info.file == released / "model.safetensors"
    assert info.nbytes == 4 * CONFIG.hidden_size and info.offset % 8 == 0


# ---- loading one tensor ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("shards", [1, 3])
def test_load_one_tensor_returns_the_stored_values(tmp_path, dtype, shards):
    ckpt = Checkpoint(write(tmp_path, dtype=dtype, shards=shards))
    exact = (lambda v: v) if dtype == "F32" else bf16
    want_dtype = mx.float32 if dtype == "F32" else mx.bfloat16
    H, I = CONFIG.hidden_size, CONFIG.moe_intermediate_size

    norm = ckpt.load(f"{P}layers.0.input_layernorm.weight")
    assert norm.dtype == want_dtype and norm.shape == (H,)
    assert np.array_equal(as_f32(norm), exact(synthetic.stored_value("layers.0.input_layernorm.weight", (H,), SEED)))

    head = ckpt.load("mtp.fc.weight")
    assert np.array_equal(as_f32(head), exact(synthetic.stored_value("mtp.fc.weight", (H, 2 * H), SEED)))

    conv_shape = (CONFIG.linear_conv_dim, CONFIG.linear_conv_kernel_dim, 1)
    conv = ckpt.load(f"{P}layers.1.linear_attn.conv1d.weight")
    assert conv.shape == (CONFIG.linear_conv_dim, 1, CONFIG.linear_conv_kernel_dim)
    assert np.array_equal(as_f32(conv), exact(synthetic.stored_value("layers.1.linear_attn.conv1d.weight", conv_shape, SEED)))

    E = CONFIG.num_experts
    gate = synthetic.stored_value("layers.2.mlp.experts.gate_proj.weight", (E, I, H), SEED)
    up = synthetic.stored_value("layers.2.mlp.experts.up_proj.weight", (E, I, H), SEED)
    gate_up = ckpt.load(f"{P}layers.2.mlp.experts.gate_up_proj")
    assert np.array_equal(as_f32(gate_up), exact(np.concatenate([gate, up], axis=1)))

    expert = ckpt.load("mtp.layers.0.mlp.experts.5.up_proj.weight")
    assert np.array_equal(as_f32(expert), exact(synthetic.expert_value("mtp.layers.0.mlp.experts.up_proj.weight", 5, (I, H), SEED)))


BLOCKS = [(), (slice(1, 3),), (slice(1, 3), slice(2, 5)), (slice(None), slice(None), slice(1, 6)),
          (slice(2, 4), slice(None), slice(None), slice(1, 2)), (slice(0, 0),), (slice(3, 1),),
          (slice(None, None, 2),), (slice(1, 2), slice(1, 2), slice(1, 2))]


@pytest.mark.parametrize("index", BLOCKS)
def test_load_with_an_index_returns_that_block(tmp_path, index):
    """Rows of the first axis, with or without a cut of one other axis, are read with pread; anything else
    (a step, two cuts) through a mapping; either way the values numpy's indexing gives."""
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((5, 6, 7, 3)).astype(np.float32), "b": rng.standard_normal((9, 4)).astype(np.float32)}
    write_safetensors(tmp_path / "m.safetensors", [(k, "F32", v.shape, lambda v=v: v.tobytes()) for k, v in arrays.items()])
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    for name, value in arrays.items():
        if len(index) <= value.ndim:
            got = np.array(ckpt.load(name, index))
            assert got.shape == value[index].shape and np.array_equal(got, value[index]), (name, index)


def test_reads_never_map_the_file_whatever_the_thread(fresh, monkeypatch):
    """A mapping's pages count in the reader's resident memory beside the copy: reading a whole tensor or rows
    of it must not map the file, also on another thread than the one that first read the file (MLX binds
    mx.load's lazy arrays to their thread's streams; a converter reads on a worker thread)."""
    from concurrent.futures import ThreadPoolExecutor

    from qmtp import checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the file was mapped")

    monkeypatch.setattr(checkpoint.mmap, "mmap", refuse)
    ckpt = Checkpoint(fresh)
    name = f"{P}layers.2.mlp.experts.gate_up_proj"
    ckpt.load(f"{P}layers.2.input_layernorm.weight")  # the main thread reads the file first
    got = {}

    def worker():
        got["whole"] = as_f32(ckpt.load(name))
        got["rows"] = as_f32(ckpt.load(name, (slice(2, 5),)))
        got["gate"] = as_f32(ckpt.load(name, (slice(2, 5), slice(0, CONFIG.moe_intermediate_size))))

    with ThreadPoolExecutor(1) as pool:
        pool.submit(worker).result()  # raises what the worker raised
    want = as_f32(ckpt.load(name))
    assert np.array_equal(got["whole"], want) and np.array_equal(got["rows"], want[2:5])
    assert np.array_equal(got["gate"], want[2:5, :CONFIG.moe_intermediate_size])


def test_load_unknown_tensor(released):
    expect(CheckpointError, lambda: Checkpoint(released).load("model.nope.weight"), released, "'model.nope.weight'")


def test_file_cut_after_listing_fails_on_load_naming_the_tensor(fresh):
    ckpt = Checkpoint(fresh)
    last = max(ckpt.infos.values(), key=lambda i: i.offset)
    os.truncate(last.file, last.offset + 4)
    expect(CheckpointError, lambda: ckpt.load(last.name), last.file, repr(last.name), "cut short")
    ckpt.load(f"{P}embed_tokens.weight")  # tensors before the cut still read


# ---- the released layouts load to the same model ------------------------------------------------------------------
@pytest.mark.parametrize("layout_name,shards", [("released", 3), ("text", 1), ("text", 2), ("next", 1), ("next", 4)])
def test_every_layout_loads_to_identical_logits(tmp_path, baseline, layout_name, shards):
    model = qmtp.load(write(tmp_path, layout=layout_name, shards=shards))
    logits, head_logits = baseline
    np.testing.assert_array_equal(np.array(trunk_logits(model, TOKENS)), logits)
    np.testing.assert_array_equal(np.array(mtp_logits(model, TOKENS)), head_logits)
    assert model.mtp.has_routed_experts


def test_bf16_checkpoint_loads_the_rounded_weights(tmp_path, released):
    """BF16 storage changes each weight by at most bf16 rounding (logits may move more: top-k routing flips)."""
    from mlx.utils import tree_flatten

    exact = dict(tree_flatten(qmtp.load(released).parameters()))
    rounded = dict(tree_flatten(qmtp.load(write(tmp_path, dtype="BF16"), dtype=mx.float32).parameters()))
    assert rounded.keys() == exact.keys()
    for name, w in exact.items():
        a, b = np.array(rounded[name]), np.array(w)
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=2**-8, atol=1e-7, err_msg=name)
    assert any(not np.array_equal(np.array(rounded[n]), np.array(exact[n])) for n in exact)


@pytest.mark.parametrize("layout_name", synthetic.LAYOUTS)
def test_plan_maps_every_tensor_including_the_head_experts(tmp_path, layout_name):
    ckpt = Checkpoint(write(tmp_path, layout=layout_name))
    p = layout.plan(ckpt, CONFIG)
    assert set(p.recipes) == set(layout.expected_shapes(CONFIG, head=True))
    assert p.skipped == [] and p.unknown == []
    assert p.head_present and p.head_has_routed_experts
    for proj in ("gate", "up", "down"):
        recipe = p.recipes[f"mtp.layers.0.mlp.experts.{proj}_proj.weight"]
        assert recipe.op == "stack" and len(recipe.sources) == CONFIG.num_experts
    trunk = p.recipes["layers.0.mlp.experts.up_proj.weight"]
    if layout_name == "released":
        assert trunk.op == "slice" and trunk.sources == (f"{P}layers.0.mlp.experts.gate_up_proj",)
    else:
        assert trunk.op == "stack"
    layout.check_shapes(ckpt, p, CONFIG)


@pytest.mark.parametrize("shards", [1, 3])
def test_vision_tensors_are_skipped(tmp_path, baseline, shards):
    path = write(tmp_path, shards=shards)
    add_vision_tensor(path)
    ckpt = Checkpoint(path)
    assert VISION in ckpt
    p = layout.plan(ckpt, CONFIG)
    assert p.skipped == [VISION] and p.unknown == []
    assert VISION not in {s for r in p.recipes.values() for s in r.sources}
    model = qmtp.load(path)
    np.testing.assert_array_equal(np.array(trunk_logits(model, TOKENS)), baseline[0])


def test_head_experts_fused_are_mapped_too(tmp_path, baseline):
    path = write(tmp_path, head_experts_fused=True)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in Checkpoint(path)
    assert sum(n.startswith("mtp.") for n in Checkpoint(path).names()) == n_head_tensors(CONFIG, one_by_one=False)
    model = qmtp.load(path)
    np.testing.assert_array_equal(np.array(mtp_logits(model, TOKENS)), baseline[1])


# ---- the head: present, crippled, absent --------------------------------------------------------------------------
def test_head_without_routed_experts_loads_with_a_warning(tmp_path):
    path = write(tmp_path, head_experts=False)
    assert not any(".experts." in n for n in Checkpoint(path).names() if n.startswith("mtp."))
    assert not layout.plan(Checkpoint(path), CONFIG).head_has_routed_experts
    with pytest.warns(UserWarning, match="NO routed experts") as record:
        model = qmtp.load(path)
    assert len(record) == 1 and str(path) in str(record[0].message)
    assert model.mtp is not None and not model.mtp.has_routed_experts
    assert mtp_logits(model, TOKENS).shape == (1, TOKENS.shape[1] - 1, CONFIG.vocab_size)
    assert "shared expert only" in repr(model)


def test_complete_head_loads_without_warnings(released):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = qmtp.load(released)
    assert model.mtp.has_routed_experts


def test_checkpoint_without_head(tmp_path, baseline):
    path = write(tmp_path, head=False)
    assert not any(n.startswith("mtp.") for n in Checkpoint(path).names())
    model = qmtp.load(path)
    assert model.mtp is None
    np.testing.assert_array_equal(np.array(trunk_logits(model, TOKENS)), baseline[0])
    expect(QmtpError, lambda: mtp_logits(model, TOKENS), path, "no MTP head")


def test_load_without_head_on_request(released, baseline):
    model = qmtp.load(released, head=False)
    assert model.mtp is None
    np.testing.assert_array_equal(np.array(trunk_logits(model, TOKENS)), baseline[0])


# ---- the fixes ------------------------------------------------------------------------------------------------------
def test_raw_load_differs_from_fixed_load(released, baseline):
    fixed = qmtp.load(released)
    with pytest.warns(UserWarning, match="without the 'conv' fix"), \
            pytest.warns(UserWarning, match="without the 'norm' fix"):
        raw = qmtp.load(released, fixes=())
    assert fixed.fixes_applied == ("norm", "conv") and raw.fixes_applied == ()
    # the norms as stored (w) against as applied (1 + w)
    stored = as_f32(Checkpoint(released).load(f"{P}norm.weight"))
    assert np.array_equal(as_f32(raw.norm.weight), stored)
    np.testing.assert_allclose(as_f32(fixed.norm.weight), stored + 1.0, rtol=1e-6)
    # the conv kernel as stored [C, 1, K] against MLX's [C, K, 1]
    C, K = CONFIG.linear_conv_dim, CONFIG.linear_conv_kernel_dim
    assert raw.layers[0].linear_attn.conv1d["weight"].shape == (C, 1, K)
    assert fixed.layers[0].linear_attn.conv1d["weight"].shape == (C, K, 1)
    # With the raw [C, 1, K] kernel MLX's conv1d refuses to run (load() keeps it so the chapter on the fixes
    # can show that error); with the conv fix only, the logits differ from the fully fixed model's.
    with pytest.raises(ValueError):
        mx.eval(trunk_logits(raw, TOKENS))
    with pytest.warns(UserWarning, match="without the 'norm' fix"):
        only_conv = qmtp.load(released, fixes=("conv",))
    assert only_conv.fixes_applied == ("conv",)
    assert not np.allclose(np.array(trunk_logits(only_conv, TOKENS)), baseline[0], atol=1e-3)


def test_unknown_fix_name(released):
    expect(UsageError, lambda: qmtp.load(released, fixes=("norm", "bias")), "'bias'", "norm", "conv")


def test_fixes_given_as_a_bare_string(released):
    """`fixes="norm"` means ("norm",), not the letters n, o, r, m."""
    with pytest.warns(UserWarning, match="without the 'conv' fix"):
        model = qmtp.load(released, fixes="norm")
    assert model.fixes_applied == ("norm",)


@pytest.mark.parametrize("fixes,fragment", [
    (("norm", 1), "1 is not a fix name"),
    ([None], "None is not a fix name"),
    (3, "fixes=3: give a fix name or a sequence of them"),
])
def test_fixes_that_are_not_names(released, fixes, fragment):
    expect(UsageError, lambda: qmtp.load(released, fixes=fixes), fragment, "norm", "conv")


def warnings_of(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    assert all(issubclass(w.category, UserWarning) for w in record)
    return [str(w.message) for w in record]


@pytest.mark.parametrize("fixes,expected", [
    ((), ["'norm'", "'conv'"]),
    (("norm",), ["'conv'"]),
    (("conv",), ["'norm'"]),
    (("norm", "conv"), []),
])
def test_a_fix_left_out_is_a_warning_at_load_time(released, fixes, expected):
    messages = warnings_of(lambda: qmtp.load(released, fixes=fixes))
    assert len(messages) == len(expected), messages
    for message, fix in zip(messages, expected):
        assert str(released) in message and f"without the {fix} fix" in message and "\n" not in message
    if "'conv'" in expected:
        assert any("PyTorch layout [C, 1, K]" in m and "conv1d will refuse" in m and 'apply the "conv" fix' in m
                   for m in messages)
    if "'norm'" in expected:
        assert any("norms used as stored (w, not 1 + w): output will be incoherent" in m for m in messages)


def shift_stored_norms(file) -> None:
    """Store every zero-centred norm of an F32 file as 1 + w, in place, as a conversion that applied the fix does."""
    infos, _ = read_header(file)
    with open(file, "r+b") as f:
        for name, info in infos.items():
            if fixes_mod.is_zero_centred_norm(layout.internal_name(name) or ""):
                f.seek(info.offset)
                w = np.frombuffer(f.read(info.nbytes), np.float32)
                f.seek(info.offset)
                f.write((w + 1).astype(np.float32).tobytes())


def test_no_warning_for_fixes_the_weights_already_carry(tmp_path, released):
    """An mlx-lm conversion (conv kernel in MLX layout, so norms shifted too) loaded raw: nothing is left out."""
    path = write(tmp_path / "mlx")
    file = path / "model.safetensors"
    infos, _ = read_header(file)
    convs = {n: ("F32", (i.shape[0], i.shape[2], 1)) for n, i in infos.items() if n.endswith("conv1d.weight")}
    assert convs
    rewrite(file, replace=convs)
    shift_stored_norms(file)  # mlx-lm moves the conv axis and shifts the norms in one pass
    assert warnings_of(lambda: qmtp.load(path, fixes=())) == []
    assert qmtp.load(path, fixes=()).fixes_applied == ("norm", "conv")


# ---- bad input ------------------------------------------------------------------------------------------------------
def test_truncated_in_the_data_region(fresh):
    file = fresh / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    expect(CheckpointError, lambda: qmtp.load(fresh), file, "tensor '", "truncated")
    expect(CheckpointError, lambda: Checkpoint(fresh), file, "truncated")


def test_truncated_shard_names_the_shard(fresh_sharded):
    shard = fresh_sharded / "model-00002-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    expect(CheckpointError, lambda: qmtp.load(fresh_sharded), shard, "tensor '", "truncated")


@pytest.mark.parametrize("size", [50, 4, 0])
def test_truncated_in_the_header(fresh, size):
    file = fresh / "model.safetensors"
    os.truncate(file, size)
    message = expect(CheckpointError, lambda: qmtp.load(fresh), file)
    assert "truncated" in message


def test_corrupt_header_json(fresh):
    file = fresh / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"#garbage!!!!"
    file.write_bytes(bytes(data))
    expect(CheckpointError, lambda: qmtp.load(fresh), file, "not valid JSON", "corrupt")


def test_header_that_is_not_an_object(tmp_path):
    file = tmp_path / "model.safetensors"
    raw = b"[1, 2, 3]    "
    file.write_bytes(struct.pack("<Q", len(raw)) + raw)
    expect(CheckpointError, lambda: Checkpoint(tmp_path), file, "not a JSON object")


@pytest.mark.parametrize("length", [2**62, 2**64 - 1])
def test_oversized_header_length_field(fresh, length):
    file = fresh / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[:8] = struct.pack("<Q", length)
    file.write_bytes(bytes(data))
    expect(CheckpointError, lambda: qmtp.load(fresh), file, f"header claims {length} bytes")


def test_header_length_above_the_sanity_limit(tmp_path):
    """Once 'header claims N bytes but the file has M' with M > N, which contradicted itself."""
    from qmtp.checkpoint import MAX_HEADER_BYTES

    file = tmp_path / "model.safetensors"
    claimed = MAX_HEADER_BYTES + 1024
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", claimed))
        f.truncate(2 * MAX_HEADER_BYTES)  # sparse: no disk used
    message = expect(CheckpointError, lambda: read_header(file), file, f"header claims {claimed} bytes",
                     f"more than the {MAX_HEADER_BYTES}", "corrupt length field")
    assert "truncated" not in message


def test_header_length_past_the_end_of_the_file(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 1000) + b"{}")
    message = expect(CheckpointError, lambda: read_header(file), file, "header claims 1000 bytes",
                     "only 2 follow the length field: truncated")
    assert "corrupt" not in message


def test_index_naming_a_missing_shard(fresh_sharded):
    (fresh_sharded / "model-00002-of-00003.safetensors").unlink()
    expect(CheckpointError, lambda: qmtp.load(fresh_sharded), fresh_sharded / INDEX_NAME,
           "'model-00002-of-00003.safetensors'", "missing")


def test_index_that_is_not_json(fresh_sharded):
    (fresh_sharded / INDEX_NAME).write_text("{not json")
    expect(CheckpointError, lambda: qmtp.load(fresh_sharded), fresh_sharded / INDEX_NAME, "not valid JSON")


def test_index_without_weight_map(fresh_sharded):
    (fresh_sharded / INDEX_NAME).write_text('{"metadata": {}}')
    expect(CheckpointError, lambda: qmtp.load(fresh_sharded), fresh_sharded / INDEX_NAME, "weight_map")


def test_tensor_in_the_index_but_not_in_its_shard(fresh_sharded):
    name = f"{P}layers.2.linear_attn.out_proj.weight"
    shard = file_of(fresh_sharded, name)
    rewrite(shard, drop=[name])
    expect(CheckpointError, lambda: qmtp.load(fresh_sharded), fresh_sharded / INDEX_NAME, repr(name), shard.name)


def test_index_pointing_at_the_wrong_shard(fresh_sharded):
    index = json.loads((fresh_sharded / INDEX_NAME).read_text())
    name = f"{P}embed_tokens.weight"
    right = index["weight_map"][name]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"][name] = wrong
    (fresh_sharded / INDEX_NAME).write_text(json.dumps(index))
    expect(CheckpointError, lambda: Checkpoint(fresh_sharded), INDEX_NAME, repr(name), wrong)


def test_tensor_stored_twice(fresh):
    name = f"{P}norm.weight"
    write_safetensors(fresh / "extra.safetensors", [(name, "F32", (CONFIG.hidden_size,), lambda: bytes(4 * CONFIG.hidden_size))])
    expect(CheckpointError, lambda: Checkpoint(fresh), "extra.safetensors", "model.safetensors", repr(name))


def test_wrong_hidden_size_in_config(fresh):
    edit_config(fresh, hidden_size=48)
    expect(TensorShapeError, lambda: qmtp.load(fresh), fresh / "model.safetensors", f"'{P}embed_tokens.weight'",
           "[97, 32]", "[97, 48]")


def test_wrong_moe_intermediate_size_in_config(fresh):
    edit_config(fresh, moe_intermediate_size=8)
    # the first tensor the new size contradicts: the fused gate_up_proj [E, 2I, H]
    expect(TensorShapeError, lambda: qmtp.load(fresh), fresh / "model.safetensors",
           f"'{P}layers.0.mlp.experts.gate_up_proj'", "[8, 32, 32]", "[8, 16, 32]")


def test_tensor_written_with_the_wrong_shape(fresh_sharded):
    name = f"{P}layers.1.linear_attn.out_proj.weight"
    shard = file_of(fresh_sharded, name)
    rewrite(shard, replace={name: ("F32", (CONFIG.hidden_size, CONFIG.linear_value_dim + 1))})
    expect(TensorShapeError, lambda: qmtp.load(fresh_sharded), shard, repr(name), "[32, 33]", "[32, 32]")


def test_head_tensor_with_the_wrong_shape(fresh):
    rewrite(fresh / "model.safetensors", replace={"mtp.fc.weight": ("F32", (CONFIG.hidden_size, CONFIG.hidden_size))})
    expect(TensorShapeError, lambda: qmtp.load(fresh), fresh / "model.safetensors", "'mtp.fc.weight'")


def test_fused_gate_up_with_the_wrong_shape(fresh):
    """Once loaded silently: the slice bounds were trusted, the stored middle dim never compared with 2I."""
    name = f"{P}layers.0.mlp.experts.gate_up_proj"
    E, I, H = CONFIG.num_experts, CONFIG.moe_intermediate_size, CONFIG.hidden_size
    rewrite(fresh / "model.safetensors", replace={name: ("F32", (E, 2 * I + 2, H))})
    expect(TensorShapeError, lambda: qmtp.load(fresh), fresh / "model.safetensors", repr(name),
           f"[{E}, {2 * I + 2}, {H}]", f"[{E}, {2 * I}, {H}]")


@pytest.mark.parametrize("fused,rows", [
    ("in_proj_qkvz", CONFIG.linear_conv_dim + CONFIG.linear_value_dim),
    ("in_proj_ba", 2 * CONFIG.linear_num_value_heads),
])
def test_fused_linear_projection_with_the_wrong_shape(tmp_path, fused, rows):
    """Once MLX's bare reshape ValueError, naming no file."""
    path = write(tmp_path, layout="next")
    name = f"model.layers.0.linear_attn.{fused}.weight"
    H = CONFIG.hidden_size
    assert Checkpoint(path).infos[name].shape == (rows, H)
    rewrite(path / "model.safetensors", replace={name: ("F32", (rows - 2, H))})
    expect(TensorShapeError, lambda: qmtp.load(path), path / "model.safetensors", repr(name),
           f"[{rows - 2}, {H}]", f"[{rows}, {H}]")


@pytest.mark.parametrize("layout_name,expert", [("text", 5), ("text", 0), ("released", 7)])
def test_one_expert_with_the_wrong_shape(tmp_path, layout_name, expert):
    """Once only the first expert of a group was checked: expert 5 ended in MLX's bare '[stack]' ValueError."""
    path = write(tmp_path, layout=layout_name)
    stem = "model.layers.0" if layout_name == "text" else "mtp.layers.0"
    name = f"{stem}.mlp.experts.{expert}.gate_proj.weight"
    I, H = CONFIG.moe_intermediate_size, CONFIG.hidden_size
    rewrite(path / "model.safetensors", replace={name: ("F32", (I + 1, H))})
    expect(TensorShapeError, lambda: qmtp.load(path), path / "model.safetensors", repr(name),
           f"[{I + 1}, {H}]", f"[{I}, {H}]")


def test_unknown_dtype_in_the_header(fresh):
    file = fresh / "model.safetensors"
    data = file.read_bytes()
    assert data.count(b'"dtype":"F32"') > 1
    file.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"F99"', 1))
    expect(CheckpointError, lambda: qmtp.load(fresh), file, "tensor '", "'F99'")


@pytest.mark.parametrize("name", [f"{P}norm.weight", "mtp.layers.0.mlp.experts.3.down_proj.weight"])
def test_integer_dtype_for_a_float_weight(fresh, name):
    """Once loaded silently, as huge floats."""
    file = fresh / "model.safetensors"
    data = file.read_bytes()
    key = json.dumps(name).encode() + b':{"dtype":"F32"'
    assert data.count(key) == 1
    file.write_bytes(data.replace(key, key.replace(b"F32", b"I32")))  # same width: the byte ranges stay valid
    expect(TensorShapeError, lambda: qmtp.load(fresh), file, repr(name),
           "stored as I32; qmtp expects a floating-point dtype (BF16/F16/F32)")


def test_byte_range_disagreeing_with_dtype_and_shape(fresh):
    file = fresh / "model.safetensors"
    data = file.read_bytes()
    # same length, so the header stays valid JSON: F32 -> I16 halves the bytes the shape needs
    file.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"I16"', 1))
    expect(CheckpointError, lambda: Checkpoint(fresh), file, "tensor '", "bytes stored", "I16")


def test_missing_trunk_tensor(fresh):
    name = f"{P}layers.3.self_attn.k_norm.weight"
    rewrite(fresh / "model.safetensors", drop=[name])
    expect(CheckpointError, lambda: qmtp.load(fresh), fresh, "layers.3.self_attn.k_norm.weight", "missing")


def test_missing_one_head_expert(fresh):
    rewrite(fresh / "model.safetensors", drop=["mtp.layers.0.mlp.experts.5.up_proj.weight"])
    message = expect(IncompleteHeadError, lambda: qmtp.load(fresh), fresh, "mtp.layers.0.mlp", "up_proj")
    assert "7 of 8" in message and "[5]" in message


def test_missing_head_tensor(fresh):
    rewrite(fresh / "model.safetensors", drop=["mtp.pre_fc_norm_hidden.weight"])
    expect(IncompleteHeadError, lambda: qmtp.load(fresh), fresh, "mtp.pre_fc_norm_hidden.weight", "missing")


def test_head_with_one_fused_expert_tensor_of_two(tmp_path):
    path = write(tmp_path, head_experts_fused=True)
    rewrite(path / "model.safetensors", drop=["mtp.layers.0.mlp.experts.down_proj"])
    expect(IncompleteHeadError, lambda: qmtp.load(path), path, "mtp.layers.0.mlp.experts.down_proj.weight",
           "missing", "mtp.layers.0.mlp.experts.gate_proj.weight")


def test_missing_trunk_expert_is_not_a_head_error(tmp_path):
    path = write(tmp_path, layout="text")
    rewrite(path / "model.safetensors", drop=["model.layers.1.mlp.experts.2.down_proj.weight"])
    with pytest.raises(CheckpointError, match="layers.1.mlp.experts has 7 of 8 down_proj") as info:
        qmtp.load(path)
    assert not isinstance(info.value, IncompleteHeadError)


def test_incomplete_head_error_is_a_checkpoint_error():
    assert issubclass(IncompleteHeadError, CheckpointError)


def test_unmapped_tensors_are_reported_not_loaded(fresh, baseline):
    rewrite(fresh / "model.safetensors", add={f"{P}layers.0.mystery.weight": ("F32", (4,))})
    p = layout.plan(Checkpoint(fresh), CONFIG)
    assert p.unknown == [f"{P}layers.0.mystery.weight"]
    np.testing.assert_array_equal(np.array(trunk_logits(qmtp.load(fresh), TOKENS)), baseline[0])


def test_quantized_checkpoint_is_refused(fresh):
    rewrite(fresh / "model.safetensors", add={f"{P}layers.0.mlp.gate.scales": ("F32", (8, 1))})
    expect(QmtpError, lambda: qmtp.load(fresh), fresh, "quantized")


def test_config_json_missing(fresh):
    (fresh / "config.json").unlink()
    expect(ConfigError, lambda: qmtp.load(fresh), fresh / "config.json")


def test_config_json_invalid(fresh):
    (fresh / "config.json").write_text("{")
    expect(ConfigError, lambda: qmtp.load(fresh), fresh / "config.json", "not valid JSON")


def test_another_model_family(fresh):
    (fresh / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 4}))
    expect(ConfigError, lambda: qmtp.load(fresh), fresh / "config.json", "'llama'", "not supported")


def test_no_such_directory(tmp_path):
    expect(CheckpointError, lambda: qmtp.load(tmp_path / "absent"), tmp_path / "absent")
    expect(CheckpointError, lambda: Checkpoint(tmp_path / "absent"), tmp_path / "absent")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_released_dict()))
    expect(CheckpointError, lambda: qmtp.load(tmp_path), tmp_path, "no *.safetensors")


def test_errors_do_not_leave_files_open(fresh):
    """A failed load must not leak file handles (a notebook retries many times)."""
    psutil = pytest.importorskip("psutil")
    os.truncate(fresh / "model.safetensors", 50)
    proc = psutil.Process()
    before = len(proc.open_files())
    for _ in range(5):
        with pytest.raises(CheckpointError):
            Checkpoint(fresh)
    assert len(proc.open_files()) == before


def test_copy_of_a_checkpoint_loads_the_same(tmp_path, released, baseline):
    """Nothing in a checkpoint refers to its own absolute path."""
    copy = tmp_path / "copy"
    shutil.copytree(released, copy)
    np.testing.assert_array_equal(np.array(trunk_logits(qmtp.load(copy), TOKENS)), baseline[0])
