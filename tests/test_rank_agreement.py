"""Ranks that hold different models refuse before the first token (issue 32 item 1), naming what differs.

Two ranks of MLX's ring backend on localhost (tests/ep_worker.py's `load`), each given its own copy of a model:
a tensor changed deep inside a file (the last bytes of an expert stack, the last bytes of the file), or one of
the files that decide the prompt and the stop ids (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json). The bundled model records no digests: rank 0 reads every expert and the ranks compare
what they hashed. A qmtp conversion records its tensors' digests (qmtp-digests.json): each rank checks the
bytes it loaded against them.
"""

import json
import shutil
from pathlib import Path

import pytest

from qmtp import digests
from qmtp.checkpoint import Checkpoint
from qmtp.loading import BUNDLED_MODEL
from test_distributed import ranks_import_this_checkout, run_ranks  # noqa: F401 (a fixture)

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_of(model: Path, where: Path) -> Path:
    shutil.copytree(model, where, ignore=shutil.ignore_patterns("previous_head", "*.png", "*.md", "*loss_curve*"))
    return where


def flip_last_bytes(path: Path, name: str, count: int = 2) -> None:
    """Change the last `count` bytes of stored tensor `name` in place (deep inside its file, past any sample)."""
    info = Checkpoint(path).infos[name]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + info.nbytes - count)
        data = f.read(count)
        f.seek(info.offset + info.nbytes - count)
        f.write(bytes(b ^ 0x5A for b in data))


def last_tensor(path: Path, containing: str = "") -> str:
    infos = [i for i in Checkpoint(path).infos.values() if containing in i.name]
    return max(infos, key=lambda i: i.offset).name


def errors(tmp_path: Path, first: Path, second: Path) -> list[str]:
    out = tmp_path / "out"
    out.mkdir()
    code, output, found = run_ranks(2, "load", out, first, second, timeout=120)
    assert code == 0 and len(found) == 2, output[-3000:]
    return [f["error"] for f in found]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from qmtp.convert import convert

    return convert(BUNDLED_MODEL, tmp_path_factory.mktemp("agree") / "q4", bits=4, mtp_bits=4, progress=False).path


def refused_by_both(messages: list[str], *fragments: str) -> str:
    assert len(set(messages)) == 1, messages
    (message,) = set(messages)
    assert message is not None and "did not open the same checkpoint" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_an_expert_differing_in_its_last_bytes_is_named(tmp_path):
    other = copy_of(BUNDLED_MODEL, tmp_path / "other")
    name = last_tensor(other, ".mlp.experts.")  # the head's last expert stack: its last rows are rank 1's
    flip_last_bytes(other, name)
    refused_by_both(errors(tmp_path, BUNDLED_MODEL, other), f"tensor {name}", "(expert 255)", "rank 1")


@pytest.mark.parametrize("stack", ["down_proj", "gate_up_proj"])
def test_rank_0_differing_in_an_expert_it_does_not_hold_is_caught(tmp_path, stack):
    """Rank 0 hashes the other ranks' experts itself: a stored stack (down_proj, loaded as it is) straight from
    the file, a fused one (gate_up_proj, loaded as two slices) one expert at a time."""
    other = copy_of(BUNDLED_MODEL, tmp_path / "other")
    name = last_tensor(other, f".mlp.experts.{stack}")
    flip_last_bytes(other, name)
    refused_by_both(errors(tmp_path, other, BUNDLED_MODEL), f"tensor {name}", "(expert 255)")


def test_the_last_bytes_of_the_file_differing_are_named(tmp_path):
    other = copy_of(BUNDLED_MODEL, tmp_path / "other")
    name = last_tensor(other)
    flip_last_bytes(other, name)
    refused_by_both(errors(tmp_path, BUNDLED_MODEL, other), f"tensor {name}")


def test_a_conversion_checks_each_ranks_bytes_against_its_recorded_digests(tmp_path, converted):
    other = copy_of(converted, tmp_path / "other")
    name = last_tensor(other, ".switch_mlp.")
    flip_last_bytes(other, name)
    message = refused_by_both(errors(tmp_path, converted, other), f"tensor {name}", "(expert 255)", "rank 1",
                              digests.FILE)
    assert "rank 1 holds other bytes" in message


def test_a_conversion_on_rank_0_differing_in_its_own_experts_is_named(tmp_path, converted):
    other = copy_of(converted, tmp_path / "other")
    name = next(n for n in Checkpoint(other).infos if "layers.1.mlp.switch_mlp.gate_proj.scales" in n)
    info = Checkpoint(other).infos[name]
    with open(info.file, "r+b") as f:  # expert 3's first bytes: held by rank 0
        f.seek(info.offset + 3 * info.nbytes // info.shape[0])
        f.write(b"\x01\x02")
    refused_by_both(errors(tmp_path, other, converted), f"tensor {name}", "(expert 3)", "rank 0 holds other bytes")


def test_copies_of_a_conversion_load_together(tmp_path, converted):
    assert errors(tmp_path, converted, copy_of(converted, tmp_path / "copy")) == [None, None]


@pytest.mark.parametrize("file", SIDE_FILES)
def test_each_side_file_differing_is_named(tmp_path, file):
    other = copy_of(BUNDLED_MODEL, tmp_path / "other")
    path = other / file
    if file.endswith(".json"):
        data = json.loads(path.read_text())
        data["qmtp_test"] = 1  # the same model, one more key
        path.write_text(json.dumps(data))
    else:
        path.write_text(path.read_text() + "\n")
    refused_by_both(errors(tmp_path, BUNDLED_MODEL, other), f"{file} differs between rank 0 and rank 1")


def test_a_side_file_missing_on_one_rank_is_named(tmp_path):
    other = copy_of(BUNDLED_MODEL, tmp_path / "other")
    (other / "generation_config.json").unlink()
    refused_by_both(errors(tmp_path, BUNDLED_MODEL, other), "generation_config.json", "(missing on rank 1)")


def test_a_conversion_whose_digests_were_lost_is_refused_on_ranks(tmp_path, converted):
    other = copy_of(converted, tmp_path / "other")
    (other / digests.FILE).unlink()
    refused_by_both(errors(tmp_path, converted, other), f"{digests.FILE} differs", "(missing on rank 1)")
    both = copy_of(other, tmp_path / "both")
    out = tmp_path / "out2"
    out.mkdir()
    code, output, _ = run_ranks(2, "load", out, other, both, timeout=120)
    assert code not in (0, 124) and f"{digests.FILE}: the checkpoint records its tensors' digests there" in output


def test_digests_of_rows_do_not_depend_on_how_the_bytes_are_cut():
    data = bytes(range(256)) * 12  # 6 rows of 512 bytes
    stream = digests.Stream(512)
    cuts = [0, 100, 700, 701, 1900, 3072]
    for start, stop in zip(cuts, cuts[1:]):
        stream.update(data[start:stop])
    assert stream.result() == [d.hex() for d in digests.rows_of(data, 6)]
    whole = digests.Stream()
    whole.update(data[:5])
    whole.update(data[5:])
    assert whole.result() == digests.of(data).hex()


def test_a_conversion_recorded_with_sha256_is_checked_with_sha256(tmp_path):
    """Conversions written before the digests were XXH3 record sha256's: read as such, never refused or compared
    against the other algorithm's bytes."""
    import hashlib

    data = bytes(range(256)) * 4
    (tmp_path / digests.FILE).write_text(json.dumps({"algorithm": digests.SHA256, "tensors": {
        "t": hashlib.sha256(data).digest()[:16].hex()}, "rows": {}}))
    manifest = digests.read(tmp_path, {digests.METADATA_KEY: digests.FILE})
    assert manifest.algorithm == digests.SHA256
    assert manifest.whole("t") == digests.of(data, manifest.algorithm) != digests.of(data)
