"""convert's finiteness check at the speed of a sum (issue 33 item 4): every NaN and Inf still refused, with its row.

The check sums each block (a NaN or an Inf makes the sum non-finite) and runs the exact per-value test only on a
block whose sum is not finite, so large finite values that overflow a sum are read again and let through. Each case
pokes one value into a small synthetic checkpoint in bf16, f16 or f32, at random positions and at the last element
of a tensor and of the file's data, on the quantized path (experts, embeddings) and the plain one (norms, A_log).
"""

import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import expect
from conftest import small_config
from qmtp.checkpoint import Checkpoint
from qmtp.convert import convert
from qmtp.errors import NonFiniteWeightError
from qmtp.tiny import synthetic

P = "model.language_model."
# stored tensor -> how its elements map to the rows convert names (the first axis of the tensor it becomes)
TENSORS = (
    P + "layers.0.mlp.experts.gate_up_proj",  # fused experts [E, 2I, H], quantized: row = expert
    P + "layers.2.mlp.experts.down_proj",  # [E, H, I], quantized
    P + "embed_tokens.weight",  # [V, H], quantized
    P + "layers.1.input_layernorm.weight",  # 1-D, plain (shifted by 1 + w)
    P + "layers.0.linear_attn.A_log",  # 1-D, written in float32
    "mtp.layers.0.mlp.experts.5.up_proj.weight",  # one expert of the head, stacked: row = 5
)
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
LARGE = {"BF16": 3.0e38, "F16": 6.0e4, "F32": 3.0e38}  # finite, but two of them overflow a sum in that dtype


@pytest.fixture(scope="module", params=["BF16", "F16", "F32"])
def source(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"finite_fast_{request.param}") / "src"
    return synthetic.write_checkpoint(path, small_config(), dtype=request.param, seed=4)


def poke(path, name: str, element: int, value: float) -> None:
    info = Checkpoint(path).infos[name]
    if info.dtype == "BF16":
        raw = (np.array([value], np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = np.array([value], {"F16": np.float16, "F32": np.float32}[info.dtype]).tobytes()
    with open(info.file, "r+b") as f:
        f.seek(info.offset + len(raw) * element)
        f.write(raw)


def expected_row(name: str, shape: tuple, element: int) -> int:
    if ".experts." in name and name.split(".experts.")[1][0].isdigit():
        return int(name.split(".experts.")[1].split(".")[0])  # a head expert: its index in the stack
    return element // int(np.prod(shape[1:], dtype=np.int64))


def positions(info, rng) -> list[int]:
    return sorted({0, info.numel - 1, *map(int, rng.integers(0, info.numel, 2))})


def refused(copy, tmp_path, name: str, row: int) -> None:
    message = expect(NonFiniteWeightError,
                     lambda: convert(copy, tmp_path / "out", bits=4, group_size=32, progress=False), name)
    assert f"row {row} of" in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", list(BAD))
def test_nan_and_inf_anywhere_are_refused_with_their_row(source, tmp_path, value):
    rng = np.random.default_rng(abs(hash((value, str(source)))) % 2**32)
    infos = Checkpoint(source).infos
    for name in TENSORS:
        for element in positions(infos[name], rng):
            copy = tmp_path / f"c_{element}"
            shutil.copytree(source, copy)
            poke(copy, name, element, BAD[value])
            refused(copy, tmp_path, name, expected_row(name, infos[name].shape, element))
            shutil.rmtree(copy)


def test_the_last_value_of_the_file_is_checked(source, tmp_path):
    infos = Checkpoint(source).infos
    last = max(infos.values(), key=lambda i: i.offset + i.nbytes)
    for value in BAD.values():
        copy = tmp_path / "last"
        shutil.copytree(source, copy)
        poke(copy, last.name, last.numel - 1, value)
        refused(copy, tmp_path, last.name, expected_row(last.name, last.shape, last.numel - 1))
        shutil.rmtree(copy)


def test_large_finite_values_that_overflow_a_sum_are_converted(source, tmp_path):
    dtype = Checkpoint(source).infos[TENSORS[0]].dtype
    copy = tmp_path / "large"
    shutil.copytree(source, copy)
    infos = Checkpoint(copy).infos
    for name in (TENSORS[0], TENSORS[3], TENSORS[5]):
        for element in (0, 1, infos[name].numel - 1):
            poke(copy, name, element, LARGE[dtype])
    conversion = convert(copy, tmp_path / "out", bits=4, group_size=32, progress=False)
    assert conversion.path.is_dir()


def test_bench_convert_times_another_checkout_in_the_same_rounds(tmp_path):
    from qmtp.book import bench_convert

    versions = {"before-check": tmp_path / "checkout"}
    commands = bench_convert.commands(Path("src"), Path("out"), 4, 64, versions)
    assert commands["qmtp@before-check"] == commands["qmtp"]  # the same command, another qmtp on the path
    assert bench_convert.environment("qmtp@before-check", versions)["PYTHONPATH"] == str(versions["before-check"].resolve())
    assert bench_convert.environment("qmtp", versions) is None
    runs = {"cp": [{"seconds": 1.0}], "qmtp": [{"seconds": 3.0}], "qmtp@before-check": [{"seconds": 2.0}]}
    tools = {t: {"seconds": r[0]["seconds"], "runs": r} for t, r in runs.items()}
    ratios = bench_convert._ratios(tools)
    assert ratios["qmtp_time_over_qmtp@before-check"] == 1.5 and ratios["qmtp_time_over_cp"] == 3.0
    assert ratios["qmtp_time_over_qmtp@before-check_per_round"] == [1.5]
