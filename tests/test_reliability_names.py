"""Reliability, third round (issue 25), classes 1, 2 and 4: no silent wrong weights from names or short configs,
and no load that mixes two conversions.

1. Two stored tensors that make one weight (one weight under two prefixes, expert 7 spelled twice, fused experts
   beside one-by-one ones) are refused, naming both; layer and expert indices are ASCII digits.
2. A config that declares fewer layers (or experts) than the checkpoint holds is refused by load and convert, and
   doctor exits 2 naming it, unless `qmtp.load(path, layers=k)` asks for the first k layers on purpose.
4. A load reads the files whose headers it read; a folder replaced under it (`convert --force`) fails in one line.

Every refusal is checked through the API and as a user meets it: `python -m qmtp chat / convert / doctor` in a
subprocess, exit status 2, one line on stderr naming the tensors.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import helpers
from conftest import small_config, trunk_logits
import qmtp
from helpers import expect, rewrite
from qmtp import layout
from qmtp.checkpoint import Checkpoint
from qmtp.errors import CheckpointError, UsageError
from qmtp.loading import BUNDLED_MODEL
from qmtp.tiny import synthetic
from qmtp.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
# the bundled tokenizer's vocabulary, chat tokens included (copied with tokenizer=True)
CONFIG = small_config(vocab_size=Tokenizer.from_dir(BUNDLED_MODEL).vocab_size)
P = "model.language_model."  # the released trunk prefix
TEXT = "model."  # a text-only export's
FILE = "model.safetensors"


def run(*argv, timeout=120) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    environment.pop("QMTP_MODEL", None)
    return subprocess.run([sys.executable, "-m", "qmtp", *map(str, argv)], capture_output=True, text=True,
                          env=environment, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess, *fragments) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    return helpers.one_line_error(result.stderr, *fragments)


def refused_everywhere(path: Path, tmp_path: Path, *fragments, error=CheckpointError) -> None:
    """load raises `error`, and chat, convert and doctor exit 2 with one line; each message holds every fragment;
    convert writes nothing."""
    print(expect(error, lambda: qmtp.load(path), *fragments))
    print("chat:", one_line_error(run("chat", "--raw", path, "--prompt", "Once", "--max-tokens", "2"), *fragments))
    out = tmp_path / "out"
    print("convert:", one_line_error(run("convert", path, out, "--quiet"), *fragments))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    print("doctor:", one_line_error(run("doctor", path), *fragments))


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    """make(name, config=CONFIG, layout="released", **write_checkpoint options): a fresh F32 checkpoint."""
    root = tmp_path_factory.mktemp("names")

    def build(name, config=CONFIG, **kwargs):
        kwargs.setdefault("tokenizer", True)
        return synthetic.write_checkpoint(root / name, config, dtype="F32", seed=5, **kwargs)

    return build


def edit_config(path: Path, **fields) -> None:
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.update(fields)
    if "num_hidden_layers" in fields:
        text.pop("layer_types", None)  # derived from num_hidden_layers again
    (path / "config.json").write_text(json.dumps(raw))


def copy_tensor(path: Path, name: str, new_name: str) -> None:
    """Store tensor `name` a second time under `new_name` (same dtype, shape and bytes)."""
    info = Checkpoint(path).infos[name]
    rewrite(path / FILE, add={new_name: (info.dtype, info.shape)})
    data = Checkpoint(path).infos[new_name]
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.nbytes)
    with open(data.file, "r+b") as f:
        f.seek(data.offset)
        f.write(raw)


# ---- class 1: two stored tensors, one weight ----------------------------------------------------------------
def two_prefixes(make):
    path = make("two_prefixes")
    first, second = P + "layers.0.input_layernorm.weight", TEXT + "layers.0.input_layernorm.weight"
    copy_tensor(path, first, second)
    return path, [first, second, "both layers.0.input_layernorm.weight", "stored twice"]


def lm_head_twice(make):
    path = make("lm_head_twice")
    copy_tensor(path, "lm_head.weight", "language_model.lm_head.weight")
    return path, ["'lm_head.weight'", "'language_model.lm_head.weight'", "stored twice"]


def expert_spelled_twice(make):
    path = make("expert_twice", layout="text")  # experts one by one, trunk and head
    first = TEXT + "layers.1.mlp.experts.7.up_proj.weight"
    second = TEXT + "layers.1.mlp.experts.007.up_proj.weight"
    copy_tensor(path, first, second)
    return path, [first, second, "both expert 7 of layers.1.mlp.experts.up_proj", "stored twice"]


def head_expert_spelled_twice(make):
    path = make("head_expert_twice")  # the released head stores its experts one by one
    first, second = "mtp.layers.0.mlp.experts.3.gate_proj.weight", "mtp.layers.0.mlp.experts.03.gate_proj.weight"
    copy_tensor(path, first, second)
    return path, [first, second, "expert 3", "stored twice"]


def layer_spelled_twice(make):
    path = make("layer_twice")
    first, second = P + "layers.2.post_attention_layernorm.weight", P + "layers.02.post_attention_layernorm.weight"
    copy_tensor(path, first, second)
    return path, [first, second, "both layers.2.post_attention_layernorm.weight"]


def non_ascii_expert(make):
    path = make("arabic_expert", layout="text")
    name = TEXT + "layers.0.mlp.experts.7.down_proj.weight"
    arabic = TEXT + "layers.0.mlp.experts.\u0667.down_proj.weight"  # ARABIC-INDIC DIGIT SEVEN: \d and int() read 7
    copy_tensor(path, name, arabic)
    rewrite(path / FILE, drop=[name])
    return path, [repr(arabic), "expert index '\u0667'", "ASCII digits"]


def non_ascii_layer(make):
    path = make("arabic_layer")
    name = P + "layers.3.input_layernorm.weight"
    arabic = P + "layers.\u0663.input_layernorm.weight"  # ARABIC-INDIC DIGIT THREE
    copy_tensor(path, name, arabic)
    rewrite(path / FILE, drop=[name])
    return path, [repr(arabic), "layer index '\u0663'", "ASCII digits"]


def fused_beside_one_by_one(make):
    path = make("fused_and_one_by_one")  # released: the trunk's experts fused
    E, I, H = CONFIG.num_experts, CONFIG.moe_intermediate_size, CONFIG.hidden_size
    mlp = P + "layers.0.mlp.experts."
    rewrite(path / FILE, add={f"{mlp}{e}.{p}_proj.weight": ("F32", (H, I) if p == "down" else (I, H))
                              for e in range(E) for p in ("gate", "up", "down")})
    return path, [f"'{mlp}gate_up_proj'", f"'{mlp}0.gate_proj.weight'", "stored twice"]


def fused_beside_one_expert(make):
    path = make("fused_and_one_expert")
    mlp = P + "layers.0.mlp.experts."
    rewrite(path / FILE, add={f"{mlp}5.down_proj.weight": ("F32", (CONFIG.hidden_size, CONFIG.moe_intermediate_size))})
    return path, [f"'{mlp}down_proj'", f"'{mlp}5.down_proj.weight'", "stored twice"]


TWICE = {
    "one weight under two prefixes": two_prefixes,
    "lm_head under two names": lm_head_twice,
    "expert 7 and expert 007": expert_spelled_twice,
    "head expert 3 and 03": head_expert_spelled_twice,
    "layer 2 and layer 02": layer_spelled_twice,
    "expert index in Arabic-Indic digits": non_ascii_expert,
    "layer index in Arabic-Indic digits": non_ascii_layer,
    "fused gate_up_proj beside per-expert tensors": fused_beside_one_by_one,
    "fused down_proj beside one per-expert tensor": fused_beside_one_expert,
}


@pytest.mark.parametrize("case", list(TWICE))
def test_two_tensors_for_one_weight_are_refused_naming_both(make, case, tmp_path):
    path, fragments = TWICE[case](make)
    refused_everywhere(path, tmp_path, *fragments)


def test_a_zero_padded_expert_index_alone_is_that_expert(make):
    """`experts.007` without `experts.7` is expert 7: one spelling, no ambiguity (as before)."""
    path = make("padded_expert", layout="text")
    name = TEXT + "layers.1.mlp.experts.7.up_proj.weight"
    plain = layout.plan(Checkpoint(path), CONFIG).recipes["layers.1.mlp.experts.up_proj.weight"]
    copy_tensor(path, name, name.replace(".7.", ".007."))
    rewrite(path / FILE, drop=[name])
    padded = layout.plan(Checkpoint(path), CONFIG).recipes["layers.1.mlp.experts.up_proj.weight"]
    assert padded.sources[7] == name.replace(".7.", ".007.") and plain.sources[7] == name


# ---- class 2: a config that declares fewer layers or experts than stored --------------------------------------
@pytest.fixture(scope="module")
def short_config(make):
    """Four trunk layers stored, config.json says two."""
    path = make("short_config")
    edit_config(path, num_hidden_layers=2)
    return path


def test_fewer_layers_declared_than_stored_is_refused(short_config, tmp_path):
    refused_everywhere(short_config, tmp_path, "holds 4 trunk layers", "num_hidden_layers=2",
                       f"'{P}layers.2.", "layers=k")


def test_doctor_says_more_layers_are_stored(short_config):
    result = run("doctor", short_config)
    assert "complete" in result.stdout and "MORE LAYERS STORED THAN config.json DECLARES" in result.stdout
    one_line_error(result, "num_hidden_layers=2")


def test_a_short_config_is_refused_even_with_layers(short_config):
    expect(CheckpointError, lambda: qmtp.load(short_config, layers=1), "holds 4 trunk layers", "num_hidden_layers=2")


@pytest.mark.parametrize("where", ["trunk one by one", "fused", "head one by one"])
def test_fewer_experts_declared_than_stored_is_refused(make, where, tmp_path):
    """Always refused, whatever `layers` says. One by one the extra expert is named; fused or stacked, the
    stored shape disagrees with the config's (the router's or the experts')."""
    error = CheckpointError
    if where == "trunk one by one":
        path = make("fewer_experts_text", layout="text")
        fragments = [f"'{TEXT}layers.0.mlp.experts.4.", "is expert 4", "num_experts=4", "fewer experts"]
    elif where == "fused":
        path = make("fewer_experts_fused", head_experts_fused=True)
        fragments, error = ["has shape [8, ", "implies [4, "], qmtp.errors.TensorShapeError
    else:  # the released layout: trunk fused, head one by one (the head's names are read first)
        path = make("fewer_experts_head")
        fragments = ["'mtp.layers.0.mlp.experts.4.", "is expert 4", "num_experts=4"]
    edit_config(path, num_experts=4)
    refused_everywhere(path, tmp_path, *fragments, error=error)
    expect(error, lambda: qmtp.load(path, layers=1, head=False), *fragments)


def test_a_second_head_layer_is_refused(make, tmp_path):
    path = make("two_head_layers")
    copy_tensor(path, "mtp.layers.0.input_layernorm.weight", "mtp.layers.1.input_layernorm.weight")
    refused_everywhere(path, tmp_path, "'mtp.layers.1.input_layernorm.weight'", "mtp_num_hidden_layers=1")


def test_a_head_stored_but_not_declared_is_refused(make, tmp_path):
    path = make("undeclared_head")
    edit_config(path, mtp_num_hidden_layers=0)
    refused_everywhere(path, tmp_path, "MTP head tensor 'mtp.", "no MTP head (mtp_num_hidden_layers=0)")


# ---- load(path, layers=k): the first k trunk layers, on purpose ----------------------------------------------
@pytest.fixture(scope="module")
def four_layers(make):
    return make("four_layers")


def test_layers_loads_the_first_layers_with_embeddings_norm_lm_head_and_head(four_layers):
    full = qmtp.load(four_layers)
    part = qmtp.load(four_layers, layers=2)
    assert part.config.num_hidden_layers == 2 and part.config.layer_types == full.config.layer_types[:2]
    assert len(part.layers) == 2 and part.mtp is not None and part.tokenizer is not None
    from mlx.utils import tree_flatten

    kept = dict(tree_flatten(part.parameters()))
    every = dict(tree_flatten(full.parameters()))
    assert set(kept) == {n for n in every if not n.startswith(("layers.2.", "layers.3."))}
    for name, value in kept.items():
        assert mx.array_equal(value, every[name]).item(), name
    # what it computes is the first two layers of the full model, then the final norm and lm_head
    tokens = mx.array([[1, 5, 9, 2]])
    x = full.embed(tokens)
    for layer in full.layers[:2]:
        x = layer(x)
    np.testing.assert_allclose(np.array(trunk_logits(part, tokens)), np.array(full.logits(full.norm(x))), rtol=1e-5, atol=1e-5)
    out = qmtp.generate(part, "Once upon a time", max_tokens=6, n_draft=2)
    assert len(out.tokens) >= 1
    every_layer = qmtp.load(four_layers, layers=4)
    assert every_layer.config == full.config


@pytest.mark.parametrize("layers, fragments", [
    (0, ["layers=0", "at least 1"]), (-2, ["layers=-2", "at least 1"]), (5, ["layers=5", "declares 4", "1 to 4"]),
    (True, ["layers=True", "an int"]), (2.0, ["layers=2.0", "an int"]), ("2", ["layers='2'", "an int"]),
])
def test_layers_out_of_range_is_a_usage_error(four_layers, layers, fragments):
    expect(UsageError, lambda: qmtp.load(four_layers, layers=layers), *fragments)


def test_layers_accepts_numpy_integers(four_layers):
    assert qmtp.load(four_layers, layers=np.int64(3), tokenizer=False).config.num_hidden_layers == 3


def test_layers_loads_a_checkpoint_of_only_those_layers(make):
    """A checkpoint holding only its first two layers: refused whole, loaded with layers=2, not with layers=3."""
    path = make("first_two_only")
    rewrite(path / FILE, drop=[n for n in Checkpoint(path).names() if n.startswith((P + "layers.2.", P + "layers.3."))])
    expect(CheckpointError, lambda: qmtp.load(path), "layers.2.", "missing")
    assert len(qmtp.load(path, layers=2, tokenizer=False).layers) == 2
    expect(UsageError, lambda: qmtp.load(path, layers=3), "layers=3", "stores 2 trunk layers", "1 to 2")


# ---- class 4: a load reads the files it opened --------------------------------------------------------------
def swap_in(dst: Path, other: Path) -> None:
    """Replace folder `dst` by a copy of `other` as `convert --force` does (rename the old away, the new in)."""
    import shutil

    fresh = dst.with_name(dst.name + ".fresh")
    shutil.copytree(other, fresh)
    old = dst.with_name(f".{dst.name}.qmtp-old")
    os.replace(dst, old)
    os.replace(fresh, dst)
    shutil.rmtree(old)


@pytest.fixture(scope="module")
def two_conversions(make):
    """Two checkpoints of one config and different weights (as two conversions into one folder would be)."""
    a = make("seed_a", shards=2)
    b = synthetic.write_checkpoint(a.parent / "seed_b", CONFIG, dtype="F32", seed=6, shards=2, tokenizer=True)
    return a, b


def fresh_copy(source: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(source, tmp_path / "model"))


NAMES = [P + "embed_tokens.weight", P + "layers.0.mlp.experts.gate_up_proj", "lm_head.weight",
         "mtp.layers.0.mlp.experts.3.up_proj.weight"]


@pytest.mark.parametrize("proc", [True, False], ids=["/proc/self/fd", "no /proc"])
@pytest.mark.parametrize("index", [None, (slice(0, 3),), (slice(None), slice(0, 16))])
def test_a_checkpoint_reads_the_files_whose_headers_it_read(two_conversions, tmp_path, monkeypatch, index, proc):
    """Whole tensors (mx.load's lazy arrays, through /proc/self/fd; without /proc, as on macOS, by path only
    while the path still names the open file, else with pread), rows and a cut (pread), in this thread and
    another: after the folder is replaced, the tensors still come from the first checkpoint, and
    `check_unchanged` refuses the mix."""
    import threading

    from qmtp import checkpoint as checkpoint_mod

    if not proc:
        monkeypatch.setattr(checkpoint_mod, "_FD_DIR", "/nonexistent/fd")
    a, b = two_conversions
    path = fresh_copy(a, tmp_path)
    ckpt, want = Checkpoint(path), Checkpoint(a)
    ckpt.load(NAMES[0], index)  # one read before the swap (the lazy cache holds this thread's mx.load of it)
    swap_in(path, b)
    other = Checkpoint(b)
    for name in NAMES:
        got = np.array(ckpt.load(name, index))
        assert np.array_equal(got, np.array(want.load(name, index))), name
        assert not np.array_equal(got, np.array(other.load(name, index))), name
    seen = {}
    worker = threading.Thread(target=lambda: seen.update(x=np.array(ckpt.load(NAMES[1], index))))
    worker.start()
    worker.join()
    assert np.array_equal(seen["x"], np.array(want.load(NAMES[1], index)))
    expect(CheckpointError, ckpt.check_unchanged, str(path), "folder changed while it was being read", "run again")
    # and a checkpoint opened now reads the new files (the lazy cache is keyed by the file's identity)
    assert np.array_equal(np.array(Checkpoint(path).load(NAMES[0])), np.array(other.load(NAMES[0])))


@pytest.mark.parametrize("after", [1, 40])
def test_a_load_overlapped_by_a_replaced_folder_fails_in_one_line(two_conversions, tmp_path, monkeypatch, after):
    """The folder is replaced after `after` tensors are read: the load refuses (before the fix it returned a
    model with the first tensors of one conversion and the rest of the other)."""
    a, b = two_conversions
    path = fresh_copy(a, tmp_path)
    real, count = layout.Reader.materialise, [0]

    def materialise(self, recipe, rows=None):
        count[0] += 1
        if count[0] == after:
            swap_in(path, b)
        return real(self, recipe, rows)

    monkeypatch.setattr(layout.Reader, "materialise", materialise)
    expect(CheckpointError, lambda: qmtp.load(path), str(path), "folder changed while it was being read")
    monkeypatch.undo()
    assert qmtp.load(path) is not None  # the folder as it is now loads


def test_config_replaced_during_a_load_is_seen(two_conversions, tmp_path, monkeypatch):
    a, _ = two_conversions
    path = fresh_copy(a, tmp_path)
    real = layout.Reader.materialise

    def materialise(self, recipe, rows=None):
        text = (path / "config.json").read_text()
        (path / "config.json").unlink()
        (path / "config.json").write_text(text)  # the same text, a new file: a rewrite is a change
        return real(self, recipe, rows)

    monkeypatch.setattr(layout.Reader, "materialise", materialise)
    expect(CheckpointError, lambda: qmtp.load(path), "config.json", "folder changed")


def test_convert_refuses_a_source_replaced_while_it_is_read(two_conversions, tmp_path, monkeypatch):
    a, b = two_conversions
    path = fresh_copy(a, tmp_path)
    real, count = layout.Reader.materialise, [0]

    def materialise(self, recipe, rows=None):
        count[0] += 1
        if count[0] == 5:
            swap_in(path, b)
        return real(self, recipe, rows)

    monkeypatch.setattr(layout.Reader, "materialise", materialise)
    out = tmp_path / "out"
    from qmtp.convert import convert

    expect(CheckpointError, lambda: convert(path, out, progress=False), "folder changed")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.slow
def test_chat_while_convert_force_replaces_the_folder_is_clean(two_conversions, tmp_path):
    """As a user meets it: `chat` on a folder while `convert --force` writes other conversions into it, over and
    over. Each chat prints the text of one of the two conversions (exit 0) or one line (exit 2): never a mix."""
    import threading

    a, b = two_conversions
    refs = {}
    for name, src in (("a", a), ("b", b)):
        ref = tmp_path / f"ref_{name}"
        assert run("convert", src, ref, "--quiet").returncode == 0
        result = run("chat", "--raw", ref, "--prompt", "Once upon a time", "--max-tokens", "6")
        assert result.returncode == 0, result.stderr
        refs[name] = result.stdout
    assert refs["a"] != refs["b"]
    dst = tmp_path / "dst"
    assert run("convert", a, dst, "--quiet").returncode == 0
    done, failures = threading.Event(), []

    def convert_loop():
        try:
            for i in range(8):
                result = run("convert", b if i % 2 == 0 else a, dst, "--quiet", "--force")
                if result.returncode != 0:
                    failures.append(result.stderr)
        finally:
            done.set()

    worker = threading.Thread(target=convert_loop)
    worker.start()
    outcomes = []
    while not done.is_set():
        result = run("chat", "--raw", dst, "--prompt", "Once upon a time", "--max-tokens", "6")
        assert "Traceback" not in result.stderr, result.stderr
        if result.returncode == 0:
            assert result.stdout in refs.values(), (result.stdout, refs)
            outcomes.append("a" if result.stdout == refs["a"] else "b")
        else:
            outcomes.append(one_line_error(result))
    worker.join()
    assert not failures, failures
    print(outcomes)
    assert outcomes
