"""A checkpoint of the real Qwen3.6-35B-A3B's size (~70 GB apparent) in almost no disk: headers over holes.

Listing it must read only the headers: well under a second, a few MB of reads, no memory growth to speak of;
loading one tensor must read that tensor's bytes only.
"""

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import mlx.core as mx

import qmtp
from qmtp import layout
from qmtp.tiny import synthetic
from qmtp.checkpoint import INDEX_NAME

CONFIG = qmtp.QWEN36_35B_A3B
SHARDS = 8
FIRST_NORM = "model.language_model.layers.0.input_layernorm.weight"


def disk_bytes(path: Path) -> int:
    """Blocks actually allocated (what `du` reports), as opposed to the apparent size."""
    return sum(p.stat().st_blocks * 512 for p in path.iterdir())


def apparent_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


@pytest.fixture(scope="module")
def big():
    # Not tmp_path_factory's directory: pytest keeps the last runs' temp dirs, and this one must go at once.
    directory = Path(tempfile.mkdtemp(prefix="qmtp-scale-"))
    try:
        probe = directory / "probe"
        with open(probe, "wb") as f:
            f.truncate(1 << 30)
        if probe.stat().st_blocks * 512 > (1 << 20):
            pytest.skip(f"{directory}: this filesystem does not keep sparse files sparse")
        probe.unlink()
        path = synthetic.write_checkpoint(directory / "ckpt", CONFIG, layout="released", dtype="BF16",
                                          shards=SHARDS, sparse=True)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert not directory.exists()


def test_it_is_the_real_size_in_no_disk(big):
    apparent, disk = apparent_bytes(big), disk_bytes(big)
    print(f"\napparent size {apparent / 1e9:.1f} GB, on disk {disk / 1e6:.2f} MB")
    assert apparent > 60e9
    assert disk < 50e6
    assert len(list(big.glob("*.safetensors"))) == SHARDS


def test_listing_is_fast_and_sees_every_tensor(big):
    import time

    start = time.perf_counter()
    ckpt = qmtp.Checkpoint(big)
    seconds = time.perf_counter() - start
    print(f"\nlisted {len(ckpt)} tensors, {ckpt.nbytes / 1e9:.2f} GB, in {seconds * 1000:.1f} ms (in process)")
    assert seconds < 2.0
    assert len(ckpt.files) == SHARDS
    index = json.loads((big / INDEX_NAME).read_text())
    assert set(ckpt.names()) == set(index["weight_map"])
    # ~35B parameters in BF16
    assert 34e9 < ckpt.nbytes / 2 < 37e9
    assert {info.dtype for info in ckpt.infos.values()} == {"BF16"}
    # REFERENCE section 2: the head holds 785 tensors when its experts are stored one by one
    assert sum(n.startswith("mtp.") for n in ckpt.names()) == 785
    H = CONFIG.hidden_size
    assert ckpt.infos["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (8192, H)
    assert ckpt.infos["model.language_model.layers.0.linear_attn.conv1d.weight"].shape == (8192, 1, 4)
    assert ckpt.infos["model.language_model.layers.3.self_attn.q_proj.weight"].shape == (8192, H)
    assert ckpt.infos["model.language_model.layers.3.self_attn.k_proj.weight"].shape == (512, H)
    assert ckpt.infos["model.language_model.layers.39.mlp.experts.gate_up_proj"].shape == (256, 1024, H)
    assert ckpt.infos["model.language_model.layers.39.mlp.experts.down_proj"].shape == (256, H, 512)
    assert ckpt.infos["mtp.fc.weight"].shape == (H, 2 * H)
    assert ckpt.infos["mtp.layers.0.mlp.experts.255.down_proj.weight"].shape == (H, 512)
    assert ckpt.infos["lm_head.weight"].shape == (248_320, H)


def test_plan_maps_all_40_layers_and_the_head(big):
    ckpt = qmtp.Checkpoint(big)
    p = layout.plan(ckpt, CONFIG)
    assert set(p.recipes) == set(layout.expected_shapes(CONFIG, head=True))
    assert p.skipped == [] and p.unknown == []
    layers = {int(n.split(".")[1]) for n in p.recipes if n.startswith("layers.")}
    assert layers == set(range(40))
    for i in CONFIG.full_attention_layers:
        assert f"layers.{i}.self_attn.q_proj.weight" in p.recipes
    assert p.head_present and p.head_has_routed_experts
    for proj in ("gate", "up", "down"):
        assert len(p.recipes[f"mtp.layers.0.mlp.experts.{proj}_proj.weight"].sources) == 256
    layout.check_shapes(ckpt, p, CONFIG)


# Runs in a fresh interpreter, so that the peak RSS (ru_maxrss) measures this work and not the test session's.
PROBE = textwrap.dedent("""
    import json, resource, sys, time
    import qmtp

    KB = 1 if sys.platform.startswith("linux") else 1 / 1024  # ru_maxrss: KB on Linux, bytes on macOS
    try:
        import psutil
        proc = psutil.Process()
    except ImportError:
        proc = None

    def sample():
        out = {"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KB * 1024}
        if proc is not None:
            out["rss"] = proc.memory_info().rss
            io = getattr(proc, "io_counters", None)
            if io is not None:
                out["read"] = getattr(io(), "read_chars", None)
        return out

    path, name = sys.argv[1], sys.argv[2]
    result = {"start": sample()}
    t = time.perf_counter()
    ckpt = qmtp.Checkpoint(path)
    result["list_seconds"] = time.perf_counter() - t
    result["n_tensors"] = len(ckpt)
    result["listed"] = sample()
    t = time.perf_counter()
    w = ckpt.load(name)
    import mlx.core as mx
    mx.eval(w)
    result["load_seconds"] = time.perf_counter() - t
    result["shape"], result["dtype"] = list(w.shape), str(w.dtype)
    result["loaded"] = sample()
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def probe(big):
    done = subprocess.run([sys.executable, "-c", PROBE, str(big), FIRST_NORM], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def headers_bytes(path: Path) -> int:
    total = (path / INDEX_NAME).stat().st_size
    for shard in path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_listing_reads_headers_only_in_a_fresh_process(big, probe):
    start, listed = probe["start"], probe["listed"]
    peak_growth = listed["maxrss"] - start["maxrss"]
    rss_growth = listed.get("rss", 0) - start.get("rss", 0)
    read = (listed.get("read") or 0) - (start.get("read") or 0)
    print(f"\nlisting {probe['n_tensors']} tensors of a {apparent_bytes(big) / 1e9:.1f} GB checkpoint: "
          f"{probe['list_seconds'] * 1000:.1f} ms, peak RSS +{peak_growth / 1e6:.1f} MB, "
          f"RSS +{rss_growth / 1e6:.1f} MB, read {read / 1e6:.2f} MB (headers+index {headers_bytes(big) / 1e6:.2f} MB)")
    assert probe["list_seconds"] < 2.0
    assert peak_growth < 100e6
    assert rss_growth < 100e6
    if start.get("read") is not None:
        assert read < 2 * headers_bytes(big) + 1e6


def test_loading_one_tensor_reads_only_that_tensor(big, probe):
    listed, loaded = probe["listed"], probe["loaded"]
    assert probe["shape"] == [CONFIG.hidden_size] and probe["dtype"] == "mlx.core.bfloat16"
    peak_growth = loaded["maxrss"] - listed["maxrss"]
    read = (loaded.get("read") or 0) - (listed.get("read") or 0)
    print(f"\nloading {FIRST_NORM}: {probe['load_seconds'] * 1000:.2f} ms, peak RSS +{peak_growth / 1e6:.1f} MB, "
          f"read {read} bytes")
    assert peak_growth < 100e6
    if listed.get("read") is not None:
        assert read < 1e6  # the tensor is 4 KB; its 8.7 GB shard is never read


def test_loading_one_tensor_in_process(big):
    ckpt = qmtp.Checkpoint(big)
    w = ckpt.load(FIRST_NORM)
    assert w.shape == (CONFIG.hidden_size,)
    assert float(abs(w.astype(mx.float32)).sum()) == 0.0  # a hole reads as zeros
    assert ckpt.infos[FIRST_NORM].file.stat().st_size > 8e9
