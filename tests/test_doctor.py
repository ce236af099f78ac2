"""`python -m qmtp doctor [MODEL] [--scan]`: the backend check, checkpoint completeness, fixes, NaN scan."""

import warnings

import numpy as np
import pytest

from conftest import small_config
from qmtp import cli, quant
from qmtp.tiny import synthetic
from qmtp import source as source_mod
from qmtp.loading import load
from qmtp.checkpoint import Checkpoint
from qmtp.convert import convert
from helpers import one_line_error, rewrite

CONFIG = small_config(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def write(path, **kwargs):
    return synthetic.write_checkpoint(path, CONFIG, dtype="F32", seed=2, **kwargs)


def run(capsys, *argv):
    status = cli.main(["doctor", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err



@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write(tmp_path_factory.mktemp("doctor") / "src")


@pytest.fixture(scope="module")
def converted(source):
    return convert(source, source.parent / "q4", bits=4, group_size=32, mtp_bits=8, progress=False).path


def test_backend_only(capsys):
    status, out, err = run(capsys)
    assert status == 0, err
    assert "mlx" in out and "quantized_matmul" in out and "all widths ok" in out


def test_converted_model_is_complete(capsys, converted):
    status, out, err = run(capsys, converted, "--scan")
    assert status == 0, err
    assert "trunk: 76 of 76 tensors, complete" in out
    assert "MTP head: complete, with its routed experts" in out
    assert "fixes in the weights: norm, conv (recorded in the file); qmtp.load applies: nothing" in out
    assert "at 4-bit/32" in out and "at 8-bit/32" in out and "at 8-bit/64" in out
    assert "converted by qmtp" in out
    assert f"scan: {len(Checkpoint(converted))} tensors read, all finite" in out


def test_raw_checkpoint_needs_both_fixes(capsys, source):
    status, out, err = run(capsys, source)
    assert status == 0, err
    assert "fixes in the weights: none (inferred from the conv layout (no record)); qmtp.load applies: norm, conv" in out
    assert "quantized weights: none" in out and "scan:" not in out


def test_head_without_routed_experts(capsys, tmp_path):
    path = write(tmp_path / "m", head_experts=False)
    status, out, err = run(capsys, path)
    assert status == 2
    assert "MTP head: INCOMPLETE, no routed experts" in out
    one_line_error(err, path, "no routed experts")


def test_head_missing_altogether(capsys, tmp_path):
    path = write(tmp_path / "m", head=False)
    status, out, err = run(capsys, path)
    assert status == 2
    assert "MTP head: MISSING" in out
    one_line_error(err, "no MTP head tensors")


def test_head_missing_one_tensor(capsys, tmp_path):
    path = write(tmp_path / "m")
    rewrite(path / "model.safetensors", drop=["mtp.norm.weight"])
    status, out, err = run(capsys, path)
    assert status == 2
    one_line_error(err, "mtp.norm.weight", "missing")


def test_missing_trunk_tensor(capsys, tmp_path):
    path = write(tmp_path / "m")
    rewrite(path / "model.safetensors", drop=["model.language_model.layers.1.linear_attn.A_log"])
    status, out, err = run(capsys, path)
    assert status == 2
    assert "MISSING layers.1.linear_attn.A_log" in out
    one_line_error(err, "layers.1.linear_attn.A_log")


def test_scan_finds_nan(capsys, tmp_path):
    path = write(tmp_path / "m")
    info = Checkpoint(path).infos["model.language_model.layers.2.mlp.shared_expert.up_proj.weight"]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 4 * 7)
        f.write(np.array([np.nan], np.float32).tobytes())
    status, _, err = run(capsys, path)
    assert status == 0, err  # the header is fine; only reading the data shows it
    status, out, err = run(capsys, path, "--scan")
    assert status == 2
    assert "1 with NaN/Inf: model.language_model.layers.2.mlp.shared_expert.up_proj.weight" in out
    one_line_error(err, "NaN", "shared_expert.up_proj")


def test_backend_fault_is_reported(capsys, monkeypatch):
    def faulty(*args, **kwargs):
        return [quant.BackendCheck(4, 1e-6, 1e-3, True), quant.BackendCheck(6, 3.0, 1e-3, False)]

    monkeypatch.setattr(quant, "check_backend", faulty)
    status, out, err = run(capsys)
    assert status == 2
    assert "WRONG at bits 6" in out
    one_line_error(err, "wrongly at 6 bits")


def test_no_such_model(capsys, tmp_path):
    status, _, err = run(capsys, tmp_path / "absent")
    assert status == 2
    one_line_error(err, "absent")


# ---- one Source for load, convert and doctor ------------------------------------------------------------------
# What each of the three reports about a head, keyed by `Source.head_status`.
DOCTOR_HEAD_LINE = {source_mod.HEAD_FULL: "MTP head: complete", source_mod.HEAD_SHARED_ONLY: "no routed experts",
                    source_mod.HEAD_MISSING: "MTP head: MISSING"}
CONVERSION_HEAD = {source_mod.HEAD_FULL: "full", source_mod.HEAD_SHARED_ONLY: "shared expert only",
                   source_mod.HEAD_MISSING: "none"}


@pytest.mark.parametrize("kwargs, status", [({}, source_mod.HEAD_FULL),
                                            (dict(head_experts=False), source_mod.HEAD_SHARED_ONLY),
                                            (dict(head=False), source_mod.HEAD_MISSING)])
def test_load_convert_and_doctor_see_the_same_head(capsys, tmp_path, kwargs, status):
    path = write(tmp_path / "m", **kwargs)
    source = source_mod.Source.open(path)
    assert source.head_status() == status
    assert not source.missing_trunk() and source.widths == {} and source.carried == ()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the incomplete and the missing head warn; their texts are tested elsewhere
        model = load(path, tokenizer=False)
        result = convert(path, tmp_path / "q", bits=4, group_size=32, progress=False, allow_incomplete_head=True)
    assert (model.mtp is not None) == (status != source_mod.HEAD_MISSING)
    assert model.mtp is None or model.mtp.has_routed_experts == (status == source_mod.HEAD_FULL)
    assert result.head == CONVERSION_HEAD[status]
    _, out, _ = run(capsys, path)
    assert DOCTOR_HEAD_LINE[status] in out


def test_source_of_a_conversion_agrees_with_load(converted):
    source = source_mod.Source.open(converted)
    assert source.recorded == source.carried == ("norm", "conv")
    assert source.head_status() == source_mod.HEAD_FULL
    plan = source.fix_plan(("norm", "conv"))
    assert plan.applying == () and plan.warnings(converted) == []
    model = load(converted, tokenizer=False)
    assert model.fixes_applied == plan.result
    quantized = {name: (m.bits, m.group_size) for name, m in model.named_modules() if hasattr(m, "bits")}
    assert quantized == {name[: -len(".weight")]: width for name, width in source.widths.items()}
