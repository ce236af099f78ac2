"""The released Qwen3.6-35B-A3B layout end to end: `synthetic --preset` (seeded, experts as holes), doctor,
4-bit convert, reload, two tokens; and loading that measures the memory it needs before it takes it.

The reduced preset (real widths, 4 layers, 16 experts, same names and nesting) always runs; the full-size one
needs tens of GB of disk and memory and is skipped, saying why, where they are not there.
"""

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qmtp import memory
from qmtp.tiny import synthetic
from qmtp.checkpoint import Checkpoint, INDEX_NAME

PYTHON = sys.executable


def run(*args, limit_kb=None, timeout=3600):
    """`python -m qmtp ARGS` in a subprocess (under `ulimit -v limit_kb` if given): (returncode, stdout, stderr)."""
    preexec = None
    if limit_kb is not None:
        def preexec():
            resource.setrlimit(resource.RLIMIT_AS, (limit_kb * 1024, limit_kb * 1024))
    done = subprocess.run([PYTHON, "-m", "qmtp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def workdir():
    directory = Path(tempfile.mkdtemp(prefix="qmtp-fullsize-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
    assert not directory.exists()


@pytest.fixture(scope="module")
def reduced(workdir):
    path = synthetic.write_preset(workdir / "reduced", "qwen3.6-35b-a3b-reduced", sparse=True, progress=False)
    return path


def test_preset_has_the_released_layout(reduced):
    raw = json.loads((reduced / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and raw["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert raw["vision_config"]["hidden_size"] == 1152
    index = json.loads((reduced / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    names = Checkpoint(reduced).names()
    assert any(n.startswith("model.visual.") for n in names)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in names  # the head's experts one by one
    assert (reduced / "tokenizer.json").exists()


def test_sparse_preset_seeds_the_small_tensors_and_leaves_experts_holes(reduced):
    ckpt = Checkpoint(reduced)
    import mlx.core as mx

    experts = ckpt.load("model.language_model.layers.0.mlp.experts.down_proj")
    router = ckpt.load("model.language_model.layers.0.mlp.gate.weight")
    embed = ckpt.load("model.language_model.embed_tokens.weight")
    assert mx.all(experts == 0).item()
    assert mx.std(router.astype(mx.float32)).item() > 0.01
    assert mx.all(embed[synthetic.SEEDED_ROWS:] == 0).item()
    rows = embed[: synthetic.SEEDED_ROWS].astype(mx.float32)
    assert mx.min(mx.sum(rows * rows, axis=1)).item() > 0  # every seeded row is a distinct random vector
    on_disk = sum(p.stat().st_blocks * 512 for p in reduced.glob("*.safetensors"))
    apparent = sum(p.stat().st_size for p in reduced.glob("*.safetensors"))
    assert on_disk < 0.6 * apparent
    assert abs(on_disk - synthetic.stored_bytes(synthetic.PRESETS["qwen3.6-35b-a3b-reduced"]["config"], True)) < 50e6


def test_preset_refuses_an_existing_directory_and_leaves_nothing(workdir):
    code, _, err = run("synthetic", workdir, "--preset", "qwen3.6-35b-a3b-reduced", "--sparse")
    assert code == 2 and err.count("\n") == 1 and "already exists" in err


def test_load_refuses_in_one_line_under_any_address_space_limit(reduced):
    """Never a segfault: from too little to start Python up to just short of the model (2.7 GiB in bfloat16,
    5.4 GiB in float32); with room for bfloat16 only, it loads so and says it."""
    for limit_gb in (0.5, 1, 2, 3):
        code, out, err = run("chat", "--raw", reduced, "--prompt", "hi", "--max-tokens", "1", limit_kb=int(limit_gb * 2**20))
        assert code >= 0, f"killed by signal {-code} under ulimit -v {limit_gb} GB: {err[-300:]}"
        assert code != 0, f"loaded a 2.7 GiB model under a {limit_gb} GB limit?"
        if "needs" in err:
            assert err.count("\n") == 1 and "ulimit -v" in err, err
    code, out, err = run("chat", "--raw", reduced, "--prompt", "hi", "--max-tokens", "1", limit_kb=6 * 2**20)
    assert code == 0 and "loading it in bfloat16" in err, err[-300:]


def test_check_fits_names_the_ceiling():
    with pytest.raises(memory.NotEnoughMemoryError, match="available memory|limit"):
        memory.check_fits(1 << 60, "a model")
    memory.check_fits(0, "nothing")


# Starts ARGV as its own child and prints the child's peak resident set size. A process started straight from
# pytest would count pytest's own size in its peak: Linux carries the peak over fork and exec (into the new
# program), but not to the children of the small process this one is.
MEASURE = """import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024))
"""


def peak_rss(*args) -> int:
    """`python -m qmtp ARGS` in a fresh process; its peak resident set size in bytes (asserts it succeeds)."""
    done = subprocess.run([PYTHON, "-c", MEASURE, PYTHON, "-m", "qmtp", *map(str, args)], capture_output=True,
                          text=True, timeout=1800)
    code, peak = map(int, done.stdout.split()[-2:])
    assert done.returncode == 0 and code == 0, done.stderr[-500:]
    return peak


def test_convert_holds_blocks_of_rows_not_whole_tensors(reduced, workdir):
    """Issue 15: the peak of a 4-bit conversion does not grow with the largest tensor. It reads, quantizes and
    writes a few MB of rows at a time, so its peak stays under half the largest tensor (the 1 GB embedding of
    the reduced preset, real widths); holding that one tensor whole, or the source's pages of it through a
    mapping, is already above. (Measured: 0.2 GB; 2.3 GB before blocks.)"""
    largest = max(info.nbytes for info in Checkpoint(reduced).infos.values())
    peak = peak_rss("convert", reduced, workdir / "reduced-peak", "--bits", "4", "--quiet")
    shutil.rmtree(workdir / "reduced-peak")
    assert peak < largest / 2, f"peak RSS {peak / 2**30:.2f} GiB, largest tensor {largest / 2**30:.2f} GiB"


def end_to_end(source: Path, out: Path) -> dict:
    """doctor, convert 4-bit, reload, two tokens, each timed; asserts each step succeeds."""
    times = {}
    for step, args in (("doctor", ("doctor", source)),
                       ("convert", ("convert", source, out, "--bits", "4", "--quiet")),
                       ("chat", ("chat", out, "--raw", "--use-mtp", "--n-draft", "2", "--max-tokens", "2", "--prompt", "Once"))):
        start = time.perf_counter()
        code, stdout, stderr = run(*args)
        times[step] = time.perf_counter() - start
        assert code == 0, f"{step}: {stderr[-500:]}"
    return times


@pytest.mark.slow
def test_reduced_end_to_end(reduced, workdir):
    print(end_to_end(reduced, workdir / "reduced-q4"))
    shutil.rmtree(workdir / "reduced-q4")


FULL = synthetic.PRESETS["qwen3.6-35b-a3b"]["config"]
# `chat --use-mtp --n-draft 2 --max-tokens 2` on the 4-bit conversion peaked at 20.2 GiB RSS here (the trunk's
# 18.2 GiB, the bf16 head, the runtime), plus 1.3 GiB of margin
FULL_SIZE_CHAT_BYTES = int(21.5 * 2**30)


@pytest.fixture(scope="module")
def full_source(workdir):
    """The full-size sparse synthetic checkpoint (made once for this module's tests, removed after them)."""
    need = synthetic.stored_bytes(FULL, sparse=True)
    free = shutil.disk_usage(workdir).free
    if free < need + 5e9:
        pytest.skip(f"{workdir}: the full-size sparse source needs about {need / 1e9:.0f} GB of disk, "
                    f"{free / 1e9:.0f} GB are free")
    yield synthetic.write_preset(workdir / "full", "qwen3.6-35b-a3b", sparse=True, progress=False)
    shutil.rmtree(workdir / "full", ignore_errors=True)


@pytest.mark.slow
@pytest.mark.alone
def test_full_size_end_to_end(full_source, workdir):
    need_disk = 25e9  # the 4-bit output is about 21 GB, beside the source
    free = shutil.disk_usage(workdir).free
    if free < need_disk + 5e9:
        pytest.skip(f"{workdir}: the full-size 4-bit conversion needs about {need_disk / 1e9:.0f} GB of disk, "
                    f"{free / 1e9:.0f} GB are free")
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()  # buffers this process keeps from earlier tests are memory the chat process cannot have
    room = min(memory.room().values())
    if room < FULL_SIZE_CHAT_BYTES:
        pytest.skip(f"chatting with the 4-bit full-size model needs about {FULL_SIZE_CHAT_BYTES / 2**30:.1f} GiB "
                    f"of memory; this machine leaves {room / 2**30:.1f} GiB")
    try:
        print(end_to_end(full_source, workdir / "full-q4"))
    finally:
        shutil.rmtree(workdir / "full-q4", ignore_errors=True)


# Chapters 2, 3 and 4 at full size, as the budget of the real-checkpoint page has them (qmtp.book.budget): every
# model they load is the first budget.LAYERS trunk layers, in float32, without the head. The same calls as the
# chapters, on the release's names and widths, in a fresh process whose peak resident memory is measured.
BUDGETED = """
import sys, warnings
warnings.simplefilter("ignore")
import qmtp
from qmtp.book import budget, evaluate, mistakes, quality
path = sys.argv[1]
assert budget.active(qmtp.ModelConfig.from_file(path))
opts = dict(layers=budget.LAYERS, head=False)
texts = evaluate.heldout_texts(1)[:budget.FIXES_TEXTS]
measure = dict(max_tokens=budget.FIXES_TOKENS, length=budget.TEXT_TOKENS)
prompt = "Once upon a time"
# chapter 2: the +1 applied twice. Its other variants (a load without the norm fix, a conv mistake MLX refuses)
# load the same tensors at the same widths through the same `mistakes.outcome` and do less with them (no fix
# applied after loading; refused at the first forward), so this one's peak bounds theirs (CI time, issue 33)
assert mistakes.outcome(lambda: mistakes.with_norm_shift(path, "shifted twice (2 + w), a re-conversion", **opts),
                        texts, prompt, **measure)["runs"]
# chapter 4: a trunk width rounded in memory on the first layers (chapter 3 loads the same first layers)
widths = quality.by_trunk_width_in_memory(lambda: qmtp.load(path, **opts), texts, (4,), length=budget.TEXT_TOKENS)
assert set(widths) == {"bf16", 4}, widths
"""


@pytest.mark.slow
@pytest.mark.alone
def test_budgeted_chapters_fit_the_memory_the_page_states(full_source):
    from qmtp.book import budget
    from qmtp.sizes import UNQUANTIZED

    stated = budget.memory_bytes(budget.first_layers(FULL), UNQUANTIZED, head=False)
    allowed = stated + budget.RUNTIME_GB * 2**30
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    room = min(memory.room().values())
    if room < allowed:  # measured: 20.3 GiB peak for 16.3 GiB of weights (471 s here, 2026-12-04)
        pytest.skip(f"the budgeted chapters need about {allowed / 2**30:.1f} GiB; this machine leaves "
                    f"{room / 2**30:.1f}")
    started = time.perf_counter()
    done = subprocess.run([PYTHON, "-c", MEASURE, PYTHON, "-c", BUDGETED, str(full_source)], capture_output=True,
                          text=True, timeout=3600)
    code, peak = map(int, done.stdout.split()[-2:])
    assert done.returncode == 0 and code == 0, done.stderr[-1500:]
    print(f"budgeted chapters 2-4: peak {peak / 2**30:.1f} GiB (weights stated {stated / 2**30:.1f} GiB, "
          f"allowed {allowed / 2**30:.1f}), {time.perf_counter() - started:.0f} s")
    assert peak <= allowed, f"peak RSS {peak / 2**30:.1f} GiB over the {allowed / 2**30:.1f} GiB the page states"


def test_a_model_stored_in_bfloat16_for_lack_of_memory_computes_in_float32(monkeypatch):
    """The bfloat16 fallback keeps float32 activations: on the CPU a quantized matmul with a bfloat16 input
    is several times slower than with a float32 one, for the same bfloat16 scales."""
    import warnings

    import mlx.core as mx

    import qmtp
    from conftest import run_trunk
    from qmtp import loading

    if loading.default_dtype() != mx.float32:
        pytest.skip("the fallback applies where qmtp computes in float32 (the CPU)")
    monkeypatch.setattr(loading, "_dtype_that_fits", lambda model, dtype, chosen, path: mx.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stored = qmtp.load()
    assert stored.embed_tokens.weight.dtype == mx.bfloat16 and stored.dtype == mx.float32
    assert run_trunk(stored, mx.array([[1, 2, 3]]))[1].dtype == mx.float32
    prompt = "Once upon a time"
    assert qmtp.generate(stored, prompt, max_tokens=16, n_draft=3).tokens == qmtp.generate(stored, prompt,
                                                                                          max_tokens=16).tokens
