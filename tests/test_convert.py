"""Conversion: streamed, quantized, one file for trunk and head, fixes applied once, and opened by mlx-lm.

Small synthetic checkpoints (hidden 64, 8 experts) so that every kind of weight is quantizable at group 32
and some are not at group 64 (the linear-attention value dim and expert width are 32).
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from helpers import expect, one_line_error, read_header, relative_error, rewrite
from conftest import mtp_logits, small_config, trunk_logits
import qmtp
from qmtp import cli, layout
from qmtp.tiny import synthetic
from qmtp import convert as convert_mod
from qmtp.checkpoint import INDEX_NAME, Checkpoint
from qmtp.convert import convert
from qmtp.errors import CheckpointError, ConfigError, IncompleteHeadError, QmtpError, UsageError
from qmtp.moe import QuantizedStackedLinear, StackedLinear
from qmtp.sizes import sizes

CONFIG = small_config(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32)
SEED = 5
TOKENS = mx.array([[5, 17, 3, 88, 41, 2, 60, 9, 33, 71, 12, 50, 8, 1, 94, 27, 30, 61, 7, 44]])
LONG = mx.array([[(7 * i + 3) % CONFIG.vocab_size for i in range(48)]])  # 96 token-expert pairs: the sorted path
EXPERTS = [f"mtp.layers.0.mlp.switch_mlp.{p}_proj" for p in ("gate", "up", "down")]


def f32(array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def write(path, dtype="F32", **kwargs):
    return synthetic.write_checkpoint(path, CONFIG, dtype=dtype, seed=SEED, **kwargs)


def quiet_convert(src, dst, **kwargs):
    return convert(src, dst, progress=False, **kwargs)



def header_bytes(directory: Path) -> dict[str, int]:
    """Stored name -> bytes, over every safetensors file of a directory."""
    return {name: info.nbytes for name, info in Checkpoint(directory).infos.items()}


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write(tmp_path_factory.mktemp("src") / "f32")


@pytest.fixture(scope="module")
def source_bf16(tmp_path_factory):
    return write(tmp_path_factory.mktemp("src") / "bf16", dtype="BF16")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """8-bit trunk, group 32, head bf16 (the default head)."""
    return quiet_convert(source, tmp_path_factory.mktemp("out") / "q8", bits=8, group_size=32).path


@pytest.fixture(scope="module")
def reference(source):
    return qmtp.load(source)


def dequantized_reference(source, converted_path):
    """The unconverted model with every weight the conversion quantized replaced by dequantize(quantize(w)).

    It computes with dense float32 matmuls what the converted model computes with quantized kernels: the two
    must agree to rounding, which checks the whole path (names, widths, codes, loading) without quantization
    error in the way.
    """
    model = qmtp.load(source)
    ckpt = Checkpoint(converted_path)
    widths = layout.quantization(ckpt, layout.plan(ckpt, model.config), model.config)
    params = dict(tree_flatten(model.parameters()))
    updates = []
    for name, (bits, group) in widths.items():
        if name in params:
            w = params[name]
            updates.append((name, mx.dequantize(*mx.quantize(w, group_size=group, bits=bits), group_size=group, bits=bits)))
    model.update(tree_unflatten(updates))
    return model, widths


# ---- round trip -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group_size,mtp_bits", [(8, 32, None), (4, 64, 4), (3, 32, 6), (2, 128, 8)])
def test_converted_model_computes_what_its_widths_say(source, tmp_path, bits, group_size, mtp_bits):
    dst = quiet_convert(source, tmp_path / "out", bits=bits, group_size=group_size, mtp_bits=mtp_bits).path
    model = qmtp.load(dst)
    expected, widths = dequantized_reference(source, dst)
    assert widths  # something was quantized
    for tokens in (TOKENS, LONG):  # experts gathered token by token, then sorted by expert
        assert relative_error(trunk_logits(model, tokens), trunk_logits(expected, tokens)) < 1e-4
        assert relative_error(mtp_logits(model, tokens), mtp_logits(expected, tokens)) < 1e-4


def mean_relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).mean() / np.abs(b).mean())


def test_logits_approach_the_unconverted_model_as_the_width_grows(source, converted, reference, tmp_path):
    """8 bits cost little: logits within about 7% on average, the same top-1 at most positions; fewer bits cost
    more. The tolerances are loose because a random model is chaotic: quantizing only its embedding at 6 bits
    (2% error per weight) moves the logits by a third, and a small change in a router logit swaps an expert.
    Exactness is `test_converted_model_computes_what_its_widths_say`'s job.
    """
    theirs = np.array(trunk_logits(reference, TOKENS))
    ours = np.array(trunk_logits(qmtp.load(converted), TOKENS))
    assert mean_relative_error(ours, theirs) < 0.12
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75
    errors = [mean_relative_error(ours, theirs)]
    for bits in (4, 2):
        dst = quiet_convert(source, tmp_path / f"q{bits}", bits=bits, group_size=32).path
        errors.append(mean_relative_error(trunk_logits(qmtp.load(dst), TOKENS), theirs))
    assert errors == sorted(errors) and errors[-1] > 0.5


def test_a_bf16_head_is_stored_exactly(converted, reference):
    """mtp_bits=None: the head of an F32 source is written in F32, unquantized, and loads bit for bit."""
    head = dict(tree_flatten(qmtp.load(converted).mtp.parameters()))
    for name, w in tree_flatten(reference.mtp.parameters()):
        np.testing.assert_array_equal(np.array(head[name]), np.array(w))


def test_drafting_with_a_quantized_head_is_lossless(source, tmp_path):
    """Greedy MTP decoding on a converted model (quantized head included) gives the plain greedy tokens."""
    model = qmtp.load(quiet_convert(source, tmp_path / "q", bits=4, group_size=32, mtp_bits=4).path)
    plain = qmtp.generate(model, [5, 17, 3, 88], max_tokens=16)
    for n_draft in (2, 3):
        assert qmtp.generate(model, [5, 17, 3, 88], max_tokens=16, n_draft=n_draft).tokens == plain.tokens


def test_quantized_layers_are_loaded_where_the_file_says(converted):
    model = qmtp.load(converted)
    assert isinstance(model.layers[0].mlp.experts.gate_proj, QuantizedStackedLinear)
    assert model.layers[0].mlp.experts.gate_proj.bits == 8
    assert model.layers[0].mlp.gate.group_size == 64  # the router keeps mlx-lm's group of 64
    assert isinstance(model.mtp.layers[0].mlp.experts.gate_proj, StackedLinear)  # head bf16
    assert model.fixes_applied == ("norm", "conv")
    assert model.dtype == mx.float32


def test_unquantized_tensors_are_exact_in_bf16(source_bf16, tmp_path):
    """Everything not quantized is the source tensor with its fix, bit for bit, in the source dtype."""
    dst = quiet_convert(source_bf16, tmp_path / "out", bits=4).path
    src, out = Checkpoint(source_bf16), Checkpoint(dst)
    plan = layout.plan(src, CONFIG)
    record = json.loads(out.metadata[layout.QUANTIZATION_KEY])
    checked = 0
    for key, entry in record.items():
        if entry["bits"] is not None:
            continue
        internal = layout.internal_name(key)
        internal = internal.replace(".switch_mlp.", ".experts.")
        stored = layout.Reader(src, CONFIG).materialise(plan.recipes[internal])
        got = out.load(key)
        if internal.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                              "k_norm.weight")) or internal in ("norm.weight", "mtp.norm.weight",
                                                                "mtp.pre_fc_norm_embedding.weight",
                                                                "mtp.pre_fc_norm_hidden.weight"):
            want = (stored.astype(mx.float32) + 1.0).astype(mx.bfloat16)
        elif internal.endswith("conv1d.weight"):
            want = stored.moveaxis(2, 1)
            assert got.shape == (CONFIG.linear_conv_dim, CONFIG.linear_conv_kernel_dim, 1)
        elif internal.endswith(".A_log"):
            want = stored.astype(mx.float32)
            assert got.dtype == mx.float32
        else:
            want = stored
        assert got.dtype == want.dtype, key
        np.testing.assert_array_equal(f32(got), f32(want), err_msg=key)
        checked += 1
    assert checked >= 54  # norms, conv kernels, A_log, dt_bias, the linear-attention norms, the whole bf16 head


def test_fixes_are_applied_once_and_recorded(source, converted, reference):
    out = Checkpoint(converted)
    assert json.loads(out.metadata["qmtp.fixes"]) == ["norm", "conv"]
    stored = np.array(Checkpoint(source).load("model.language_model.layers.0.input_layernorm.weight"))
    for fixes in (("norm", "conv"), (), "norm"):
        model = qmtp.load(converted, fixes=fixes)
        assert model.fixes_applied == ("norm", "conv")
        np.testing.assert_array_equal(np.array(model.layers[0].input_layernorm.weight), stored + np.float32(1.0))
    np.testing.assert_array_equal(np.array(qmtp.load(converted).mtp.norm.weight), np.array(reference.mtp.norm.weight))


def test_head_experts_are_stacked_under_mtp(source, converted, tmp_path):
    names = set(Checkpoint(converted).names())
    assert not [n for n in names if ".experts." in n]
    E, I, H = CONFIG.num_experts, CONFIG.moe_intermediate_size, CONFIG.hidden_size
    infos = Checkpoint(converted).infos
    assert infos[EXPERTS[0] + ".weight"].shape == (E, I, H)  # bf16 head: stacked, unquantized
    assert infos[EXPERTS[2] + ".weight"].shape == (E, H, I)
    # each stacked expert is the source's expert e (stored one by one in the released head)
    src = Checkpoint(source)
    for e in (0, E - 1):
        np.testing.assert_array_equal(np.array(Checkpoint(converted).load(EXPERTS[1] + ".weight")[e]),
                                      np.array(src.load(f"mtp.layers.0.mlp.experts.{e}.up_proj.weight")))
    quantized = quiet_convert(source, tmp_path / "q", bits=4, mtp_bits=4, group_size=32).path
    infos = Checkpoint(quantized).infos
    for stem in EXPERTS:
        assert infos[stem + ".weight"].dtype == "U32" and infos[stem + ".weight"].shape[0] == E
        assert stem + ".scales" in infos and stem + ".biases" in infos
    assert qmtp.load(quantized).mtp.has_routed_experts


def test_trunk_keys_are_mlx_lms(converted):
    names = set(Checkpoint(converted).names())
    assert {"language_model.model.embed_tokens.weight", "language_model.model.embed_tokens.scales",
            "language_model.model.norm.weight", "language_model.lm_head.weight", "language_model.lm_head.biases",
            "language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight",
            "language_model.model.layers.0.linear_attn.conv1d.weight", "mtp.fc.weight"} <= names
    trunk = [n for n in names if not n.startswith("mtp.")]
    assert all(n.startswith(("language_model.model.", "language_model.lm_head.")) for n in trunk)


@pytest.mark.parametrize("layout_name", ["text", "next"])
def test_every_source_layout_converts_to_the_same_tensors(converted, tmp_path, layout_name):
    src = synthetic.write_checkpoint(tmp_path / "src", CONFIG, layout=layout_name, dtype="F32", seed=SEED)
    dst = quiet_convert(src, tmp_path / "out", bits=8, group_size=32).path
    ours, theirs = Checkpoint(dst), Checkpoint(converted)
    assert ours.names() == theirs.names()
    for name in ours.names():
        assert np.array_equal(np.array(ours.load(name)), np.array(theirs.load(name))), name


# ---- the ecosystem ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(bits=8, group_size=32), dict(bits=4, group_size=64, mtp_bits=4, lm_head_bits="bf16")])
def test_mlx_lm_opens_the_conversion_and_agrees(source, tmp_path, kwargs):
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    dst = quiet_convert(source, tmp_path / "out", **kwargs).path
    theirs, config = mlx_lm_utils.load_model(dst)
    assert config["quantization"]["bits"] == kwargs["bits"]
    ours = qmtp.load(dst)
    assert relative_error(trunk_logits(ours, TOKENS), theirs(TOKENS).astype(mx.float32)) < 1e-4
    # mlx-lm drops the head; qmtp keeps it
    assert not any(k.startswith("mtp") for k, _ in tree_flatten(theirs.parameters()))
    assert ours.mtp is not None


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_trunk_is_bit_identical_to_mlx_lms_own_conversion(tmp_path, bits, group_size):
    """mlx_lm.convert on the same bf16 source writes the same trunk tensors, byte for byte, and the same
    quantization block; only A_log differs in dtype (qmtp stores it float32, mlx-lm keeps the source's)."""
    mlx_lm_convert = pytest.importorskip("mlx_lm.convert")
    from tokenizers import Tokenizer, models

    src = write(tmp_path / "src", dtype="BF16")
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    mlx_lm_convert.convert(hf_path=str(src), mlx_path=str(tmp_path / "mlx_lm"), quantize=True,
                           q_group_size=group_size, q_bits=bits)
    dst = quiet_convert(src, tmp_path / "qmtp", bits=bits, group_size=group_size).path
    theirs = mx.load(str(tmp_path / "mlx_lm" / "model.safetensors"))
    ours = mx.load(str(dst / "model.safetensors"))
    assert sorted(theirs) == sorted(k for k in ours if not k.startswith("mtp."))
    for key, value in theirs.items():
        if key.endswith(".A_log"):
            assert ours[key].dtype == mx.float32 and mx.array_equal(ours[key], value.astype(mx.float32)).item()
        else:
            assert ours[key].dtype == value.dtype and mx.array_equal(ours[key], value).item(), key
    config = json.loads((tmp_path / "mlx_lm" / "config.json").read_text())
    assert json.loads((dst / "config.json").read_text())["quantization"] == config["quantization"]


def test_qmtp_loads_an_mlx_lm_quantized_model(source, tmp_path):
    """No qmtp record: widths are read from the shapes, fixes from the conv layout."""
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    model, config = mlx_lm_utils.load_model(source)
    model, config = mlx_lm_utils.quantize_model(model, config, 32, 4)
    out = tmp_path / "mlx_lm"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    ours = qmtp.load(out)  # mlx-lm dropped the head: loaded without one
    assert ours.mtp is None and ours.fixes_applied == ("norm", "conv")
    assert relative_error(trunk_logits(ours, TOKENS), model(TOKENS)) < 1e-4
    expect(UsageError, lambda: quiet_convert(out, tmp_path / "again"), out, "already converted")


# ---- what is written --------------------------------------------------------------------------------------------
def test_metadata_and_config(source, converted):
    ckpt = Checkpoint(converted)
    meta = ckpt.metadata
    assert meta["format"] == "mlx" and meta["qmtp.version"] == qmtp.__version__
    record = json.loads(meta[layout.QUANTIZATION_KEY])
    weights = [n for n in ckpt.names() if not n.endswith((".scales", ".biases"))]
    assert sorted(record) == sorted(weights)
    assert record["language_model.model.layers.0.mlp.gate.weight"] == {"bits": 8, "group_size": 64, "dtype": "F32"}
    assert record["language_model.model.norm.weight"] == {"bits": None, "group_size": None, "dtype": "F32"}

    h = hashlib.sha256()
    raw = (source / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    h.update(b"model.safetensors\0" + raw[8: 8 + length])
    assert meta["qmtp.source_digest"] == h.hexdigest()

    config = json.loads((converted / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text())
    assert {k: v for k, v in config.items() if k in source_config} == source_config
    q = config["quantization"]
    assert (q["bits"], q["group_size"]) == (8, 32)
    assert q["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert q["language_model.model.layers.3.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    assert "language_model.model.layers.0.mlp.switch_mlp.gate_proj" not in q  # at the default width
    assert config["quantization_config"] == q
    assert config["qmtp"]["fixes"] == ["norm", "conv"] and config["qmtp"]["mtp_bits"] is None
    assert config["qmtp"]["head"] == "full"


def test_tokenizer_files_are_copied(tmp_path):
    src = write(tmp_path / "src")
    wanted = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json"]
    for name in wanted + ["README.md", "notes.txt"]:
        (src / name).write_text(f"{name}\n")
    import tokenizers  # the tokenizer is parsed before it is copied (a corrupt one is refused): real ones

    (src / "tokenizer.json").write_text(tokenizers.Tokenizer(tokenizers.models.BPE()).to_str())
    (src / "tokenizer_config.json").write_text("{}\n")
    dst = quiet_convert(src, tmp_path / "out").path
    assert sorted(p.name for p in dst.iterdir()) == sorted(wanted + ["config.json", "model.safetensors",
                                                            "qmtp-digests.json"])
    assert (dst / "chat_template.jinja").read_text() == "chat_template.jinja\n"


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
@pytest.mark.parametrize("bits,group_size,mtp_bits", [(8, 64, None), (4, 32, 4), (3, 128, None), (6, 32, 2)])
def test_sizes_equal_the_bytes_written(tmp_path, dtype, bits, group_size, mtp_bits):
    src = write(tmp_path / "src", dtype=dtype)
    dst = quiet_convert(src, tmp_path / "out", bits=bits, group_size=group_size, mtp_bits=mtp_bits).path
    written = header_bytes(dst)
    r = sizes(CONFIG, bits=bits, group_size=group_size, mtp_bits=mtp_bits, dtype_bytes=2 if dtype == "BF16" else 4)
    head = sum(b for n, b in written.items() if n.startswith("mtp."))
    assert (sum(written.values()) - head, head) == (r.trunk_bytes, r.head_bytes)


def test_conversion_is_deterministic(source, tmp_path):
    a = quiet_convert(source, tmp_path / "a", bits=4, mtp_bits=4).path
    b = quiet_convert(source, tmp_path / "b", bits=4, mtp_bits=4).path
    assert file_bytes(a) == file_bytes(b)


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_blocks_of_one_row_write_the_same_bytes_as_whole_tensors(tmp_path, monkeypatch, dtype):
    """A tensor is read, fixed, quantized and written a block of rows at a time; the size of the blocks changes
    no byte: one row per block (every fused expert, embedding row and conv channel on its own) against every
    tensor in one block, over a quantized head (stacked experts) and a bf16 one, with shards."""
    src = write(tmp_path / "src", dtype=dtype)
    written = {}
    for chunk in (1, 1 << 40):
        monkeypatch.setattr(convert_mod, "CHUNK_BYTES", chunk)
        for name, kwargs in (("q4", dict(bits=4, mtp_bits=4)), ("q3", dict(bits=3, group_size=32, shards=2))):
            written[chunk, name] = file_bytes(quiet_convert(src, tmp_path / f"{name}-{chunk}", **kwargs).path)
    assert written[1, "q4"] == written[1 << 40, "q4"] and written[1, "q3"] == written[1 << 40, "q3"]


def test_shards_write_an_index_and_load(source, tmp_path):
    single = quiet_convert(source, tmp_path / "one", bits=4, group_size=32).path
    sharded = quiet_convert(source, tmp_path / "three", bits=4, group_size=32, shards=3).path
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(Checkpoint(single).names())
    for name, file in index["weight_map"].items():  # scales and biases sit with their codes
        if name.endswith((".scales", ".biases")):
            assert index["weight_map"][name[: -len(".scales")] + ".weight"] == file
    assert index["metadata"]["total_size"] == sum(header_bytes(single).values())
    np.testing.assert_array_equal(np.array(trunk_logits(qmtp.load(sharded), TOKENS)), np.array(trunk_logits(qmtp.load(single), TOKENS)))
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    theirs, _ = mlx_lm_utils.load_model(sharded)
    assert relative_error(theirs(TOKENS), np.array(trunk_logits(qmtp.load(single), TOKENS))) < 1e-4


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_existing_destination_needs_force(source, tmp_path):
    dst = quiet_convert(source, tmp_path / "out", bits=8).path
    before = file_bytes(dst)
    expect(UsageError, lambda: quiet_convert(source, dst, bits=4), dst, "already exists", "--force")
    assert file_bytes(dst) == before
    quiet_convert(source, dst, bits=4, force=True)
    assert json.loads((dst / "config.json").read_text())["quantization"]["bits"] == 4
    assert not list(tmp_path.glob(".*"))  # no temporary or old directory left beside it
    plain = tmp_path / "file"
    plain.write_text("x")
    expect(UsageError, lambda: quiet_convert(source, plain, force=True), plain, "not a directory")


def test_destination_may_not_be_the_source(source):
    expect(UsageError, lambda: quiet_convert(source, source, force=True), "would replace the source")
    expect(UsageError, lambda: quiet_convert(source, source.parent, force=True), "would replace the source")


def test_a_converted_directory_is_refused(converted, tmp_path):
    expect(UsageError, lambda: quiet_convert(converted, tmp_path / "again"), converted, "already converted",
           "second time")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("metadata", [{"format": "mlx"}, None])
def test_an_unquantized_mlx_lm_conversion_is_refused(source, tmp_path, metadata):
    """mlx-lm's own bf16 conversion carries both fixes but no record: its names and conv layout say so."""
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    model, config = mlx_lm_utils.load_model(source)
    out = tmp_path / "mlx_lm"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata)
    (out / "config.json").write_text(json.dumps(config))
    expect(UsageError, lambda: quiet_convert(out, tmp_path / "again"), "already converted")


def test_conv_in_mlx_layout_is_refused(tmp_path):
    """A checkpoint whose norms were shifted (conv kernels already [C, K, 1]) under the release's names."""
    src = write(tmp_path / "src")
    infos, _ = read_header(src / "model.safetensors")
    rewrite(src / "model.safetensors", reshape={name: (info.shape[0], info.shape[2], 1) for name, info in infos.items()
                                                if name.endswith("conv1d.weight")})
    expect(UsageError, lambda: quiet_convert(src, tmp_path / "out"), "already converted", "conv")


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(bits=7), "bits=7"), (dict(bits=1), "bits=1"), (dict(bits=16), "bits=16"), (dict(bits="bf16"), "bits"),
    (dict(group_size=48), "group_size=48"), (dict(group_size=256), "group_size=256"),
    (dict(mtp_bits=7), "mtp_bits=7"), (dict(router_bits=1), "router_bits=1"), (dict(lm_head_bits=9), "lm_head_bits=9"),
    (dict(shards=0), "shards=0"),
])
def test_bad_widths_and_group_sizes(source, tmp_path, kwargs, fragment):
    expect(UsageError, lambda: quiet_convert(source, tmp_path / "out", **kwargs), fragment)
    assert not (tmp_path / "out").exists()


def test_source_without_config_or_weights(source, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    expect(ConfigError, lambda: quiet_convert(empty, tmp_path / "out"), "config.json")
    (empty / "config.json").write_text((source / "config.json").read_text())
    expect(CheckpointError, lambda: quiet_convert(empty, tmp_path / "out"), empty, "no *.safetensors")
    expect(UsageError, lambda: quiet_convert(tmp_path / "absent", tmp_path / "out"), "absent")
    expect(UsageError, lambda: quiet_convert(source / "model.safetensors", tmp_path / "out"), "not a file")


def test_missing_trunk_tensor(tmp_path):
    src = write(tmp_path / "src")
    rewrite(src / "model.safetensors", drop=["model.language_model.layers.2.linear_attn.dt_bias"])
    expect(QmtpError, lambda: quiet_convert(src, tmp_path / "out"), "layers.2.linear_attn.dt_bias", "missing")


def test_head_without_routed_experts_needs_permission(tmp_path):
    src = write(tmp_path / "src", head_experts=False)
    expect(IncompleteHeadError, lambda: quiet_convert(src, tmp_path / "out"), src, "no routed experts",
           "--allow-incomplete-head")
    assert not (tmp_path / "out").exists()
    with pytest.warns(UserWarning, match="INCOMPLETE MTP HEAD"):
        result = quiet_convert(src, tmp_path / "out", allow_incomplete_head=True)
    assert result.head == "shared expert only"
    assert json.loads((result.path / "config.json").read_text())["qmtp"]["head"] == "shared expert only"
    with pytest.warns(UserWarning, match="NO routed experts"):
        model = qmtp.load(result.path)
    assert model.mtp is not None and not model.mtp.has_routed_experts


def test_not_enough_disk_space(source, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    expect(QmtpError, lambda: quiet_convert(source, tmp_path / "out"), "GB free", "needs about")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("exception", [KeyboardInterrupt, RuntimeError, OSError])
def test_an_interrupted_conversion_leaves_nothing(source, tmp_path, monkeypatch, exception):
    calls = []

    def failing(array):
        calls.append(1)
        if len(calls) == 40:
            raise exception(28, "No space left on device") if exception is OSError else exception("stop")
        return real(array)

    real = convert_mod.tensor_bytes
    monkeypatch.setattr(convert_mod, "tensor_bytes", failing)
    expected = QmtpError if exception is OSError else exception
    with pytest.raises(expected):
        quiet_convert(source, tmp_path / "out")
    assert 40 <= len(calls) <= 41  # the worker may have started the tensor after the failing one
    assert list(tmp_path.iterdir()) == []  # no dst, no temporary directory

    # the same over an existing destination with --force: the old conversion stays as it was
    monkeypatch.setattr(convert_mod, "tensor_bytes", real)
    dst = quiet_convert(source, tmp_path / "out", bits=8).path
    before = file_bytes(dst)
    calls.clear()
    monkeypatch.setattr(convert_mod, "tensor_bytes", failing)
    with pytest.raises(expected):
        quiet_convert(source, dst, bits=4, force=True)
    assert file_bytes(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_write_failing_mid_tensor_stops_the_worker_and_leaves_nothing(source, tmp_path, monkeypatch):
    """The disk filling up while the worker is pieces ahead: the run fails in one line, the worker thread
    stops (no thread left behind, still quantizing) and nothing is left on disk."""
    import threading

    real = convert_mod.write_safetensors

    def failing(path, entries, metadata=None):
        def broken(produce):
            def run():
                for n, piece in enumerate(produce()):
                    if n == 0 and broken.tensors == 30:
                        raise OSError(28, "No space left on device")
                    yield piece
                broken.tensors += 1
            return run
        broken.tensors = 0
        return real(path, [(name, dtype, shape, broken(produce)) for name, dtype, shape, produce in entries], metadata)

    monkeypatch.setattr(convert_mod, "write_safetensors", failing)
    threads = threading.active_count()
    expect(QmtpError, lambda: quiet_convert(source, tmp_path / "out"), "No space left on device", "nothing was left")
    assert threading.active_count() == threads
    assert list(tmp_path.iterdir()) == []


def test_a_killed_run_is_cleaned_up_by_the_next(source, tmp_path):
    """A run killed outright (no exception handler ran) leaves its temporary directory; the rerun removes it."""
    stale = tmp_path / ".out.qmtp-partial"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    dst = quiet_convert(source, tmp_path / "out").path
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    qmtp.load(dst)


def test_progress_bar_counts_bytes_and_tensors(source, tmp_path, capsys):
    result = convert(source, tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert f"{result.tensors}/{result.tensors} tensors" in err and "convert" in err
    assert result.nbytes == sum(header_bytes(result.path).values())


# ---- the command line -------------------------------------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err



def test_cli_convert(source, tmp_path, capsys):
    status, out, _ = run_cli(capsys, "convert", source, tmp_path / "out", "--bits", "4", "--group-size", "32",
                             "--mtp-bits", "6", "--lm-head-bits", "bf16", "--shards", "2", "--quiet")
    assert status == 0 and "wrote" in out and "head 6-bit" in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["qmtp"]["mtp_bits"] == 6 and config["qmtp"]["lm_head_bits"] is None
    assert "language_model.lm_head.scales" not in Checkpoint(tmp_path / "out").infos
    qmtp.load(tmp_path / "out")


@pytest.mark.parametrize("args,fragments", [
    (["--bits", "7"], ["--bits", "invalid choice"]),
    (["--group-size", "48"], ["--group-size"]),
    (["--mtp-bits", "7"], ["--mtp-bits", "7 bits"]),
    (["--mtp-bits", "half"], ["--mtp-bits", "half"]),
    (["--shards", "0"], ["shards=0"]),
])
def test_cli_bad_flags_are_one_line(source, tmp_path, capsys, args, fragments):
    status, _, err = run_cli(capsys, "convert", source, tmp_path / "out", *args)
    assert status == 2
    one_line_error(err, *fragments)


def test_cli_refusals_are_one_line(source, converted, tmp_path, capsys):
    status, _, err = run_cli(capsys, "convert", converted, tmp_path / "x", "--quiet")
    assert status == 2
    one_line_error(err, "already converted")
    status, _, err = run_cli(capsys, "convert", source, converted, "--quiet")
    assert status == 2
    one_line_error(err, "already exists", "--force")
    status, _, err = run_cli(capsys, "convert", tmp_path / "absent", tmp_path / "y")
    assert status == 2
    one_line_error(err, "absent")


def test_cli_incomplete_head(tmp_path, capsys):
    src = write(tmp_path / "src", head_experts=False)
    status, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--quiet")
    assert status == 2
    one_line_error(err, "--allow-incomplete-head")
    status, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--quiet", "--allow-incomplete-head")
    assert status == 0 and "INCOMPLETE MTP HEAD" in err
