"""Reliability as a user meets it (issue 7): bad input on the command line, killed conversions, determinism.

Every case runs `python -m qmtp chat / convert / doctor` in a subprocess, as a user would, and expects what
`qmtp.cli` promises: exit status 2, exactly one line on stderr ("qmtp: error: ..."), naming the file (and the
tensor, where there is one) and saying what is wrong, and never a traceback. The Python API's side of the
same inputs (exception types, messages) is in tests/test_checkpoint.py, test_config.py and test_doctor.py.

A head without its routed experts is not an error: loading it warns, drafting with it works (far worse), so
`chat --use-mtp` runs and prints the warning as one loud line, `doctor` flags it (status 2), and `convert`
refuses it unless given --allow-incomplete-head.
"""

import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import helpers
from conftest import small_config
import qmtp
from helpers import rewrite
from qmtp.tiny import corpus, synthetic
from qmtp.checkpoint import INDEX_NAME, Checkpoint
from qmtp.errors import QmtpError, UsageError
from qmtp.tiny.bpe import train_bpe
from qmtp.tokenizer import save

REPO = Path(__file__).resolve().parents[1]
VOCAB = 300  # the trained tokenizer's size, and so the synthetic model's
CONFIG = small_config(vocab_size=VOCAB)
P = "model.language_model."  # the released trunk prefix
UP = P + "layers.1.mlp.shared_expert.up_proj.weight"  # [24, 32] in CONFIG
PROMPT = "Once upon a time"


# ---- running the command line -------------------------------------------------------------------------------
def run(*argv, env=None, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    environment.pop("QMTP_MODEL", None)
    return subprocess.run([sys.executable, "-m", "qmtp", *map(str, argv)], capture_output=True, text=True,
                          env=environment, timeout=timeout, **kwargs)


def chat(model, *args, prompt=PROMPT, **kwargs):
    return run("chat", "--raw", model, "--prompt", prompt, "--max-tokens", "4", *args, **kwargs)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def one_line_error(result: subprocess.CompletedProcess, *fragments) -> str:
    """Status 2, one line on stderr, that line a qmtp error holding every fragment; no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    return helpers.one_line_error(result.stderr, *fragments)


def tree_digest(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


# ---- checkpoints --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    tok = train_bpe((t for _, t in corpus.iter_documents(300, seed=0)), vocab_size=VOCAB)
    assert tok.get_vocab_size() == VOCAB
    return tok


@pytest.fixture(scope="module")
def make(tmp_path_factory, tokenizer):
    """make(name, config=CONFIG, **write_checkpoint options): a fresh F32 checkpoint with a tokenizer."""
    root = tmp_path_factory.mktemp("reliability")

    def build(name, config=CONFIG, tokenizer_files=True, **kwargs):
        path = synthetic.write_checkpoint(root / name, config, dtype="F32", seed=3, **kwargs)
        if tokenizer_files:
            save(tokenizer, path)
        return path

    return build


@pytest.fixture(scope="module")
def good(make):
    return make("good", shards=2)


@pytest.fixture(scope="module")
def converted(good):
    dst = good.parent / "converted"
    result = run("convert", good, dst, "--quiet")
    assert result.returncode == 0, result.stderr
    return dst


def edit_config(path: Path, drop=(), **fields):
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw)
    for name in drop:
        del text[name]
    text.update(fields)
    (path / "config.json").write_text(json.dumps(raw))


def poke(path: Path, name: str, value: float, element: int = 3):
    """Overwrite one float32 element of stored tensor `name` in place (the header stays as it was)."""
    info = Checkpoint(path).infos[name]
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 4 * element)
        f.write(np.array([value], np.float32).tobytes())


# ---- damaged checkpoints: every command that reads the weights refuses them in one line ---------------------
SHARD2 = "model-00002-of-00002.safetensors"


def truncated_data(path):
    shard = path / SHARD2
    os.truncate(shard, shard.stat().st_size // 2)
    return [shard, "tensor '", "truncated"]


def truncated_header(path):
    shard = path / SHARD2
    os.truncate(shard, 50)
    return [shard, "truncated"]


def corrupt_header(path):
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"#garbage!!!!"
    file.write_bytes(bytes(data))
    return [file, "header is not valid JSON", "corrupt"]


def oversized_header(path):
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    file.write_bytes(bytes(data))
    return [file, f"header claims {2**40} bytes", "corrupt length field"]


def missing_shard(path):
    (path / SHARD2).unlink()
    return [path / INDEX_NAME, repr(SHARD2), "missing"]


def wrong_shape(path):
    rewrite(path / "model.safetensors", replace={UP: ("F32", (25, 32))})
    return [path / "model.safetensors", repr(UP), "has shape [25, 32]", "implies [24, 32]"]


def wrong_dtype(path):
    rewrite(path / "model.safetensors", replace={UP: ("I32", (24, 32))})
    return [path / "model.safetensors", repr(UP), "stored as I32", "floating-point dtype (BF16/F16/F32)"]


def wide_dtype(path):
    rewrite(path / "model.safetensors", replace={UP: ("F64", (24, 32))})
    return [path / "model.safetensors", repr(UP), "stored as F64", "BF16/F16/F32"]


def config_field_missing(path):
    edit_config(path, drop=["hidden_size"])
    return [path / "config.json", "missing required fields ['hidden_size']"]


def config_contradictory(path):
    edit_config(path, num_experts_per_tok=9)
    return [path / "config.json", "num_experts_per_tok=9", "num_experts=8"]


def config_contradicts_tensors(path):
    edit_config(path, hidden_size=48)
    return [path / "model.safetensors", f"tensor '{P}embed_tokens.weight'", "shape [300, 32]", "hidden_size=48",
            "implies [300, 48]"]


def another_family(path):
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "hidden_size": 32, "num_hidden_layers": 4, "vocab_size": VOCAB}))
    return [path / "config.json", "model_type 'llama' is not supported", "qwen3_5_moe"]


def no_config(path):
    (path / "config.json").unlink()
    return [path / "config.json", "file not found"]


DAMAGE = {  # name -> (shards, damage(path) -> fragments the error line must hold)
    "truncated shard (data)": (2, truncated_data),
    "truncated shard (header)": (2, truncated_header),
    "corrupt header": (1, corrupt_header),
    "oversized header": (1, oversized_header),
    "index naming a missing shard": (2, missing_shard),
    "tensor of the wrong shape": (1, wrong_shape),
    "tensor of the wrong dtype (I32)": (1, wrong_dtype),
    "tensor of the wrong dtype (F64)": (1, wide_dtype),
    "config field missing": (1, config_field_missing),
    "config fields contradictory": (1, config_contradictory),
    "config contradicting the tensors": (1, config_contradicts_tensors),
    "another model family": (1, another_family),
    "no config.json": (1, no_config),
}


@pytest.fixture(scope="module")
def damaged(make):
    built = {}

    def get(case):
        if case not in built:
            shards, damage = DAMAGE[case]
            path = make(case.replace(" ", "_").replace("(", "").replace(")", ""), shards=shards)
            built[case] = path, damage(path)
        return built[case]

    return get


@pytest.mark.parametrize("command", ["chat", "doctor", "convert"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_one_line(damaged, case, command, tmp_path):
    path, fragments = damaged(case)
    if command == "chat":
        result = chat(path)
    elif command == "doctor":
        result = run("doctor", path)
    else:
        result = run("convert", path, tmp_path / "out", "--quiet")
    print(f"{case} / {command}: {one_line_error(result, *fragments)}")
    assert list(tmp_path.iterdir()) == []  # convert wrote nothing, not even a temporary directory


# ---- the MTP head ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def crippled(make):
    return make("crippled", head_experts=False)


def test_crippled_head_loads_with_a_warning_and_drafts(crippled):
    """The Python API the command line follows: a warning, then drafting works (with the shared expert alone)."""
    with pytest.warns(UserWarning, match="NO routed experts"):
        model = qmtp.load(crippled)
    g = qmtp.generate(model, PROMPT, max_tokens=6, n_draft=3, stop_at_eos=False)
    assert g.stats.generated == 6 and sum(g.stats.drafted) > 0


@pytest.mark.parametrize("use_mtp", [True, False])
def test_chat_with_a_crippled_head_warns_in_one_loud_line(crippled, use_mtp):
    result = chat(crippled, *(["--use-mtp"] if use_mtp else []))
    assert result.returncode == 0, result.stderr
    err = lines(result.stderr)
    warning = [line for line in err if line.startswith("qmtp: warning: ")]
    assert len(warning) == 1 and str(crippled) in warning[0] and "NO routed experts" in warning[0], result.stderr
    assert "UserWarning" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(err) == 2 and re.match(r"\[\d tokens", err[1])  # the warning and the statistics, nothing else
    assert ("acceptance" in err[1]) == use_mtp
    assert result.stdout.startswith(PROMPT)
    print(f"chat{' --use-mtp' if use_mtp else ''}: {warning[0]}")


def test_doctor_flags_a_crippled_head(crippled):
    result = run("doctor", crippled)
    assert "MTP head: INCOMPLETE, no routed experts" in result.stdout
    print(one_line_error(result, crippled, "no routed experts", "mtp.layers.0.mlp.experts"))


def test_convert_refuses_a_crippled_head_unless_allowed(crippled, tmp_path):
    result = run("convert", crippled, tmp_path / "out", "--quiet")
    print(one_line_error(result, crippled, "no routed experts", "--allow-incomplete-head"))
    assert list(tmp_path.iterdir()) == []
    result = run("convert", crippled, tmp_path / "out", "--quiet", "--allow-incomplete-head")
    assert result.returncode == 0, result.stderr
    err = lines(result.stderr)
    assert len(err) == 1 and err[0].startswith("qmtp: warning: ") and "INCOMPLETE MTP HEAD" in err[0], result.stderr
    print(f"convert --allow-incomplete-head: {err[0]}")


@pytest.mark.parametrize("kind", ["head tensors absent", "no head in config.json"])
def test_a_model_without_head_cannot_draft(make, kind):
    if kind == "head tensors absent":
        path = make("headless", head=False)
    else:
        path = make("no_mtp", config=small_config(vocab_size=VOCAB, mtp_num_hidden_layers=0))
    print(f"{kind}: {one_line_error(chat(path, '--use-mtp'), path, 'no MTP head', 'cannot draft')}")
    plain = chat(path)
    assert plain.returncode == 0 and re.fullmatch(r"\[\d tokens.*\]", lines(plain.stderr)[0]), plain.stderr


def test_doctor_flags_head_tensors_absent(make):
    path = make("headless_doctor", head=False, tokenizer_files=False)
    result = run("doctor", path)
    assert "MTP head: MISSING" in result.stdout
    print(one_line_error(result, path, "no MTP head tensors (mtp.*)", "config.json declares a head"))


# ---- converted sources, NaN and Inf ---------------------------------------------------------------------------
def test_convert_refuses_a_converted_checkpoint(converted, tmp_path):
    result = run("convert", converted, tmp_path / "again", "--quiet")
    print(one_line_error(result, converted, "already converted", "norms a second time", "original checkpoint"))
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_an_existing_destination(good, converted):
    before = tree_digest(converted)
    print(one_line_error(run("convert", good, converted, "--quiet"), converted, "already exists", "--force"))
    assert tree_digest(converted) == before


def test_doctor_scan_finds_nan_and_inf(make):
    path = make("nonfinite", tokenizer_files=False)
    nan_name, inf_name = P + "layers.2.mlp.shared_expert.up_proj.weight", "mtp.fc.weight"
    poke(path, nan_name, np.nan)
    poke(path, inf_name, -np.inf)
    result = run("doctor", path)  # headers are fine: only reading the data shows it
    assert result.returncode == 0 and result.stderr == "", result.stderr
    result = run("doctor", path, "--scan")
    assert f"2 with NaN/Inf: {nan_name}, {inf_name}" in result.stdout
    print(one_line_error(result, path, "2 tensors hold NaN or Inf", nan_name))


# ---- tokenizer and prompts -------------------------------------------------------------------------------------
def test_chat_without_tokenizer(make):
    path = make("no_tokenizer", tokenizer_files=False)
    print(one_line_error(chat(path), path, "no tokenizer.json"))


def test_chat_with_a_corrupt_tokenizer(make):
    path = make("bad_tokenizer")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    print(one_line_error(chat(path), path / "tokenizer.json", "cannot load tokenizer"))


def test_chat_with_another_models_tokenizer(make, tokenizer):
    """A tokenizer larger than the model's vocabulary: its ids would index past the embedding (a crash); refused
    at load, before any prompt."""
    path = make("small_vocab", config=small_config(), tokenizer_files=False)  # vocab 97
    save(tokenizer, path)
    print(one_line_error(chat(path), path, f"tokenizer.json has {VOCAB} ids", "vocabulary has 97", "another model's"))


FLAG_CASES = {  # name -> (chat flags, fragments of the error line)
    "empty prompt": (["--prompt", ""], ["the prompt is empty"]),
    "prompt longer than the context": (["--prompt", "the cat sat " * 2000],
                                       ["tokens is longer than the context of 4096"]),
    "prompt + new tokens past the context": (["--max-tokens", "5000"], ["new ones is", "more than the context of 4096",
                                                                        "ask for at most"]),
    "n_draft above the range": (["--use-mtp", "--n-draft", "9"],
                                ["--n-draft: 9 is out of range", "1 (plain decoding) to 8"]),
    "n_draft 1 with --use-mtp": (["--use-mtp", "--n-draft", "1"], ["--n-draft 1 with --use-mtp", "2 or more"]),
    "n_draft negative": (["--use-mtp", "--n-draft", "-3"], ["--n-draft: -3"]),
    "n_draft not a number": (["--n-draft", "two"], ["--n-draft", "expected a whole number or 'auto', got 'two'"]),
    "n_draft auto without mtp": (["--n-draft", "auto"], ["--n-draft auto", "needs --use-mtp"]),
    "temperature NaN": (["--temperature", "nan"], ["temperature=nan must be a finite number >= 0"]),
    "temperature negative": (["--temperature", "-0.5"], ["temperature=-0.5"]),
    "seed negative": (["--seed", "-1"], ["seed=-1 must be a non-negative integer"]),
    "max_tokens 0": (["--max-tokens", "0"], ["max_tokens=0 must be at least 1"]),
    "use-mtp not a boolean": (["--use-mtp=maybe"], ["--use-mtp", "expected true or false, got 'maybe'"]),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_bad_chat_flags_are_one_line(good, case):
    flags, fragments = FLAG_CASES[case]
    # flags after the defaults of `chat()`, so theirs win (argparse keeps the last value)
    print(f"{case}: {one_line_error(chat(good, *flags), *fragments)}")


def test_drafts_past_the_context(good, tokenizer):
    """Plain decoding of that many tokens would fit; the drafts verified past the last token do not."""
    fits = 4096 - len(tokenizer.encode(PROMPT).ids)
    result = chat(good, "--max-tokens", str(fits), "--use-mtp", "--n-draft", "3")
    print(one_line_error(result, f"{fits} new ones + 2 drafted ahead is 4098 positions", "context of 4096",
                         f"at most {fits - 2} new tokens"))


def test_chat_on_a_missing_directory(tmp_path):
    print(one_line_error(chat(tmp_path / "absent"), tmp_path / "absent", "no such model directory"))


def test_n_draft_out_of_range_without_use_mtp(good):
    """The range is checked whatever --use-mtp says."""
    one_line_error(chat(good, "--n-draft", "0"), "--n-draft")


def test_error_after_a_warning_is_still_one_line(crippled):
    """chat checks the prompt and flags before loading (on the real model a minute, and warnings)."""
    one_line_error(chat(crippled, prompt=""), "the prompt is empty")


# ---- the prompt checks behind those lines, in the Python API ------------------------------------------------------
@pytest.fixture(scope="module")
def short_context(make):
    """A model with a 32-position context, to check the context arithmetic exactly."""
    path = make("short", config=small_config(vocab_size=VOCAB, max_position_embeddings=32),
                tokenizer_files=False)
    return qmtp.load(path)


def test_token_ids_outside_the_vocabulary_are_refused(short_context):
    """Once garbage (MLX does not bounds-check an embedding lookup), or a segmentation fault for large ids."""
    for bad in (VOCAB, -1, 10**6):
        with pytest.raises(UsageError, match=f"prompt token id {bad} is outside the vocabulary"):
            qmtp.generate(short_context, [5, bad, 7], max_tokens=2)
    for bad in (["a", "b"], [1.5], [[1, 2]], 7):
        with pytest.raises(UsageError, match="sequence of integer token ids"):
            qmtp.generate(short_context, bad, max_tokens=2)
    assert qmtp.generate(short_context, np.array([0, VOCAB - 1]), max_tokens=2).tokens


@pytest.mark.parametrize("n_draft", [1, 2, 4])
def test_the_context_check_is_exact(short_context, monkeypatch, n_draft):
    """Prompt + new tokens + drafts past the end fit the context: the largest such request runs without any cache
    going past the context; one token more is refused."""
    prompt = list(range(1, 21))
    fits = 32 - len(prompt) - (n_draft - 1)
    with pytest.raises(UsageError, match=f"ask for at most {fits} new tokens"):
        qmtp.generate(short_context, prompt, max_tokens=fits + 1, n_draft=n_draft)

    from qmtp.attention import GatedAttention

    largest = []  # the end of every block of positions written into a KV buffer, trunk and head
    attend = GatedAttention.step

    def watched(attention, x, buffers, offset):
        largest.append(offset.item() + x.shape[1])
        return attend(attention, x, buffers, offset)

    monkeypatch.setattr(GatedAttention, "step", watched)
    eager = qmtp.Engine(compiled=False)  # so that every pass's offset can be read
    g = qmtp.generate(short_context, prompt, max_tokens=fits, n_draft=n_draft, stop_at_eos=False, engine=eager)
    assert g.stats.generated == fits and largest and max(largest) <= 32


def test_a_prompt_longer_than_the_context(short_context):
    with pytest.raises(UsageError, match="prompt of 33 tokens is longer than the context of 32 positions"):
        qmtp.generate(short_context, [1] * 33, max_tokens=1)


# ---- determinism ---------------------------------------------------------------------------------------------------
def test_same_seed_same_tokens_in_process(good):
    model = qmtp.load(good)
    for n_draft in (1, 3):
        greedy = [qmtp.generate(model, PROMPT, max_tokens=16, n_draft=n_draft, stop_at_eos=False).tokens for _ in "ab"]
        assert greedy[0] == greedy[1]
        sampled = [qmtp.generate(model, PROMPT, max_tokens=16, n_draft=n_draft, temperature=0.9, seed=s,
                                 stop_at_eos=False).tokens for s in (11, 11, 12)]
        assert sampled[0] == sampled[1]
        assert sampled[0] != sampled[2]  # the seed is what makes them equal


@pytest.mark.parametrize("flags", [["--temperature", "0.9", "--seed", "5"],
                                   ["--temperature", "0.9", "--seed", "5", "--use-mtp", "--n-draft", "3"],
                                   ["--use-mtp", "--n-draft", "2"]])
def test_same_seed_same_text_across_processes(good, flags):
    outputs = []
    for hash_seed in ("1", "2"):
        result = run("chat", "--raw", good, "--prompt", PROMPT, "--max-tokens", "24", *flags, env={"PYTHONHASHSEED": hash_seed})
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1] and outputs[0].startswith(PROMPT)


def test_same_conversion_same_bytes_across_processes(good, tmp_path):
    digests = []
    for hash_seed in ("1", "2"):
        dst = tmp_path / f"out{hash_seed}"
        result = run("convert", good, dst, "--bits", "4", "--group-size", "32", "--mtp-bits", "8", "--shards", "2",
                     "--quiet", env={"PYTHONHASHSEED": hash_seed})
        assert result.returncode == 0, result.stderr
        digests.append(tree_digest(dst))
    assert digests[0] == digests[1]
    assert {"config.json", INDEX_NAME, "tokenizer.json", "tokenizer_config.json"} <= set(digests[0])


# ---- conversions killed outright -------------------------------------------------------------------------------------
def test_a_run_killed_between_the_renames_is_cleaned_up_by_the_next(good, converted, tmp_path):
    """Killed after moving the old DST aside and before moving the new one in: the next run removes both leftovers."""
    shutil.copytree(converted, tmp_path / ".out.qmtp-old")
    (tmp_path / ".out.qmtp-partial").mkdir()
    (tmp_path / ".out.qmtp-partial" / "model.safetensors").write_bytes(b"half a file")
    result = run("convert", good, tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert tree_digest(tmp_path / "out") == tree_digest(converted)


BIG = small_config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=16, num_experts=64,
                             moe_intermediate_size=64, shared_expert_intermediate_size=128)
TRIALS = 6


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name != dst.name)


@pytest.mark.slow
def test_killed_conversions_leave_nothing_that_loads_and_reruns_are_identical(tmp_path, tokenizer):
    """SIGKILL at random moments (no handler runs): DST is absent, or the old conversion untouched, or (killed after
    the final rename) the finished one; the rerun completes and gives the bytes of an uninterrupted run."""
    src = synthetic.write_checkpoint(tmp_path / "src", BIG, dtype="BF16", seed=0)
    save(tokenizer, src)
    work = tmp_path / "work"
    work.mkdir()

    # the uninterrupted run, timed: from spawn, and from the moment its temporary directory appears
    reference = work / "reference"
    proc = subprocess.Popen([sys.executable, "-m", "qmtp", "convert", src, reference, "--quiet"],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    started, writing = time.perf_counter(), None
    while proc.poll() is None:
        if writing is None and any(work.glob(".reference.qmtp-partial*")):
            writing = time.perf_counter() - started
        time.sleep(0.005)
    total = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr.read()
    writing = writing if writing is not None else total / 2
    expected = tree_digest(reference)
    old_version = work / "old"
    assert run("convert", src, old_version, "--bits", "4", "--quiet").returncode == 0
    old = tree_digest(old_version)
    assert old != expected

    rng = random.Random(7)
    report = [f"uninterrupted: {total:.2f} s, writing from {writing:.2f} s"]
    for trial in range(TRIALS):
        over_old = trial % 2 == 1  # every other trial replaces an existing conversion with --force
        dst = tmp_path / f"trial{trial}" / "model"
        dst.parent.mkdir()
        if over_old:
            shutil.copytree(old_version, dst)
        argv = [sys.executable, "-m", "qmtp", "convert", src, dst, "--quiet", *(["--force"] if over_old else [])]
        # half the trials kill at any moment from spawn, half while the weights are being written
        during_write = trial >= TRIALS // 2
        delay = rng.uniform(0.0, total - writing) if during_write else rng.uniform(0.0, total)
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED=str(trial))
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t0 = time.perf_counter()
        while during_write and proc.poll() is None and not any(dst.parent.glob(".model.qmtp-partial*")):
            time.sleep(0.002)
        time.sleep(delay)
        partial_seen = any(dst.parent.glob(".model.qmtp-partial*"))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.perf_counter() - t0

        state = tree_digest(dst) if dst.exists() else None
        if proc.returncode == -signal.SIGKILL:
            if over_old:
                assert state in (old, expected), f"trial {trial}: the old conversion was damaged"
            else:
                assert state in (None, expected), f"trial {trial}: a partial conversion at DST"
            if state is None:
                with pytest.raises(QmtpError):
                    qmtp.load(dst)
        else:  # finished before the signal: a complete conversion
            assert proc.returncode == 0 and state == expected
        outcome = ("DST absent" if state is None else "old conversion untouched" if state == old
                   else "finished conversion")
        left = leftovers(dst)

        t1 = time.perf_counter()
        rerun = run("convert", src, dst, "--quiet", *(["--force"] if dst.exists() else []))
        rerun_seconds = time.perf_counter() - t1
        assert rerun.returncode == 0, rerun.stderr
        assert tree_digest(dst) == expected, f"trial {trial}: the rerun differs from the uninterrupted run"
        assert leftovers(dst) == [], f"trial {trial}: the rerun left {leftovers(dst)}"
        report.append(
            f"trial {trial}: {'over an old conversion' if over_old else 'fresh DST':22} "
            f"{'after writing began' if during_write else 'from spawn':19} delay {delay:.2f} s, killed at "
            f"{killed_at:.2f} s (status {proc.returncode}, partial dir {'seen' if partial_seen else 'not yet'}): "
            f"{outcome}, left {left or 'nothing'}; rerun {rerun_seconds:.2f} s, identical"
        )
    print("\n".join(report))


@pytest.mark.parametrize("flags", [[], ["--use-mtp"], ["--temperature", "0.7"]])
def test_chat_on_damaged_weights_says_so(make, flags):
    """NaN weights used to give an empty (argmax of NaN) answer; now the first logits are checked. (A NaN in a
    norm is refused already by `load`, naming it: tests/test_finite.py; here a large tensor every token reads.)"""
    path = make("nan_chat")
    poke(path, UP, np.nan)
    result = run("chat", "--raw", path, "--prompt", "hello", "--max-tokens", "4", *flags)
    print(one_line_error(result, path, "NaN or Inf logits", "doctor MODEL --scan"))


# ---- issue 17: hostile and careless use, second round ------------------------------------------------------------
def _clean(result) -> bool:
    """Exit 0, or exit 2 with one qmtp error line; never a traceback."""
    if "Traceback" in result.stderr:
        return False
    if result.returncode == 0:
        return True
    errors = [line for line in lines(result.stderr) if not line.startswith("qmtp: warning: ")]
    return result.returncode == 2 and len(errors) == 1 and errors[0].startswith("qmtp: error: ")


def _conversions_equal(dst: Path, reference: Path) -> bool:
    return tree_digest(dst) == tree_digest(reference)


@pytest.fixture(scope="module")
def references(good):
    """The uninterrupted conversions at 4 and 8 bits, to compare what concurrent runs leave with."""
    out = {}
    for bits in ("4", "8"):
        dst = good.parent / f"reference{bits}"
        assert run("convert", good, dst, "--bits", bits, "--quiet").returncode == 0
        out[bits] = dst
    return out


@pytest.mark.parametrize("force", [False, True])
def test_concurrent_conversions_never_mix_or_lose_a_result(good, references, tmp_path, force):
    """Two real processes converting into one destination at once (4-bit and 8-bit): whoever wins, the result is
    exactly one complete conversion that one of the winners reported; a loser says why in one line; no leftovers."""
    for trial in range(3):
        work = tmp_path / f"trial{trial}"
        work.mkdir()
        dst = work / "out"
        if force:
            shutil.copytree(references["8"], dst)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        procs = [subprocess.Popen([sys.executable, "-m", "qmtp", "convert", str(good), str(dst), "--bits", bits,
                                   "--quiet", *(["--force"] if force else [])], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for bits in ("4", "8")]
        outcomes = [(p, *p.communicate(timeout=120)) for p in procs]
        results = [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, out, err in outcomes]
        assert all(_clean(r) for r in results), [r.stderr for r in results]
        winners = [bits for bits, r in zip(("4", "8"), results) if r.returncode == 0]
        assert winners, [r.stderr for r in results]
        assert any(_conversions_equal(dst, references[bits]) for bits in winners), f"trial {trial}: mixed result"
        for r in results:
            if r.returncode:
                assert "already exists" in r.stderr or "another conversion" in r.stderr, r.stderr
        assert leftovers(dst) == [], leftovers(dst)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_terminated_conversion_leaves_nothing(tmp_path, tokenizer, signum):
    """SIGTERM and SIGHUP clean up like Ctrl-C: no partial folder, no lock, no destination."""
    src = synthetic.write_checkpoint(tmp_path / "src", BIG, dtype="BF16", seed=0)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "qmtp", "convert", src, work / "out", "--quiet"],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while proc.poll() is None and not list(work.glob(".out.qmtp-partial*")) and time.time() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.skip("the conversion finished before it could be interrupted")
    proc.send_signal(signum)
    err = proc.communicate(timeout=30)[1]
    if proc.returncode == 0:  # it finished between the poll and the signal: then it must be whole, nothing else left
        assert [p.name for p in work.iterdir()] == ["out"] and "Traceback" not in err, err
        pytest.skip("the conversion finished before the signal arrived")
    assert proc.returncode == 128 + signum and "Traceback" not in err, err
    assert list(work.iterdir()) == []


def test_a_failed_conversion_removes_the_folders_it_created(crippled, tmp_path):
    print(one_line_error(run("convert", crippled, tmp_path / "a" / "b" / "out", "--quiet"), "no routed experts"))
    assert list(tmp_path.iterdir()) == []


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


FIFO_CASES = {"config.json": 1, INDEX_NAME: 2, SHARD2: 2, "tokenizer.json": 1, "tokenizer_config.json": 1}


@pytest.mark.parametrize("name", list(FIFO_CASES))
def test_a_fifo_never_hangs(make, name, tmp_path):
    path = make(f"fifo_{name}", shards=FIFO_CASES[name])
    _replace_with_fifo(path / name)
    started = time.perf_counter()
    result = run("chat", "--raw", path, "--prompt", PROMPT, "--max-tokens", "2", timeout=30)
    assert time.perf_counter() - started < 30
    print(one_line_error(result, path / name, "FIFO", "not a regular file"))
    if not name.startswith("tokenizer"):
        one_line_error(run("doctor", path, timeout=30), "FIFO")
        one_line_error(run("convert", path, tmp_path / "out", "--quiet", timeout=30), "FIFO")


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME, "tokenizer_config.json"])
def test_a_json_file_linked_to_dev_zero_is_refused(make, name):
    path = make(f"zero_{name}", shards=2)
    (path / name).unlink()
    (path / name).symlink_to("/dev/zero")
    print(one_line_error(chat(path), path / name, "a device", "not a regular file"))


def _splice(path: Path, text: str) -> None:
    """Add a field whose JSON value is `text`, verbatim."""
    raw = json.loads(path.read_text())
    raw["qmtp_test_extra"] = "@@"
    path.write_text(json.dumps(raw).replace('"@@"', text))


HOSTILE_JSON = {"deep nesting": "[" * 100_000 + "]" * 100_000, "a huge integer": "1" * 5000,
                "NaN": "NaN", "a duplicate key": '1, "qmtp_test_extra": 2'}


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME, "tokenizer_config.json"])
@pytest.mark.parametrize("kind", list(HOSTILE_JSON))
def test_hostile_json_in_every_file_qmtp_reads(make, name, kind):
    path = make(f"json_{name}_{kind.replace(' ', '_')}", shards=2)
    _splice(path / name, HOSTILE_JSON[kind])
    print(f"{kind} in {name}: {one_line_error(chat(path), path / name, 'not valid JSON')}")


@pytest.mark.parametrize("name", ["config.json", INDEX_NAME])
def test_a_folder_where_a_json_file_should_be(make, name):
    path = make(f"folder_{name}", shards=2)
    (path / name).unlink()
    (path / name).mkdir()
    print(one_line_error(run("doctor", path), path / name, "directory"))


CONFIG_VALUES = {  # field -> JSON text of a value that must be refused
    "num_hidden_layers": "1000000000", "num_experts": "1000000000", "max_position_embeddings": "1" + "0" * 30,
    "rms_norm_eps": "Infinity", "rope_theta": "1e300", "vocab_size": "9" * 4000,
}


@pytest.mark.parametrize("field", list(CONFIG_VALUES))
def test_config_values_are_range_checked(make, field):
    path = make(f"range_{field}")
    raw = json.loads((path / "config.json").read_text())
    text = raw["text_config"]
    text[field] = "@@"
    text.pop("layer_types", None)
    text.get("rope_parameters", {}).pop(field, None)
    (path / "config.json").write_text(json.dumps(raw).replace('"@@"', CONFIG_VALUES[field]))
    started = time.perf_counter()
    print(one_line_error(run("doctor", path, timeout=30), "config.json"))
    assert time.perf_counter() - started < 30


def _header(file: Path):
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _write_header(file: Path, text: str, data: bytes) -> None:
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_overlapping_tensors_are_refused(make):
    path = make("overlap")
    file = path / "model.safetensors"
    header, data = _header(file)
    same = [n for n, e in header.items() if n != "__metadata__" and e["shape"] == [24, 32]]
    header[same[1]]["data_offsets"] = list(header[same[0]]["data_offsets"])
    _write_header(file, json.dumps(header), data)
    print(one_line_error(run("doctor", path), file, "overlap"))


def test_a_duplicate_tensor_name_is_refused(make):
    path = make("duplicate")
    file = path / "model.safetensors"
    header, data = _header(file)
    name = next(n for n in header if n.endswith("norm.weight"))
    text = json.dumps(header)
    _write_header(file, text[:-1] + ", " + json.dumps({name: header[name]})[1:-1] + "}", data)
    print(one_line_error(run("doctor", path), file, "appears twice"))


def _set_fixes_record(path: Path, record: str, shift_norms: bool = False, mlx_conv: bool = False) -> None:
    file = path / "model.safetensors"
    header, data = _header(file)
    data = bytearray(data)
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        internal = qmtp.layout.internal_name(name) or ""
        if shift_norms and qmtp.fixes.is_zero_centred_norm(internal):
            begin, end = entry["data_offsets"]
            data[begin:end] = (np.frombuffer(bytes(data[begin:end]), np.float32) + 1).tobytes()
        if mlx_conv and internal.endswith("conv1d.weight"):
            C, _, K = entry["shape"]
            entry["shape"] = [C, K, 1]
    header["__metadata__"] = {"format": "pt", "qmtp.fixes": record}
    _write_header(file, json.dumps(header), bytes(data))


FIXES_RECORDS = {  # name -> (record, shift the norms, conv in MLX layout, fragment)
    "says conv only, norms shifted": ('["conv"]', True, True, "norms look already shifted"),
    "says both, conv in PyTorch layout": ('["norm", "conv"]', False, False, "PyTorch layout"),
    "says none, conv in MLX layout": ("[]", False, True, "MLX layout"),
    "not JSON": ("not json", False, False, "not valid JSON"),
    "deeply nested": ("[" * 5000 + "]" * 5000, False, False, "not valid JSON"),
    "unknown fix": ('["norm", "bogus"]', False, False, "not a list of fix names"),
}


@pytest.mark.parametrize("case", list(FIXES_RECORDS))
def test_a_fixes_record_the_tensors_contradict_is_refused(make, case):
    record, shift, mlx_conv, fragment = FIXES_RECORDS[case]
    path = make(f"record_{case.replace(' ', '_').replace(',', '')}")
    _set_fixes_record(path, record, shift, mlx_conv)
    print(f"{case}: {one_line_error(chat(path), 'qmtp.fixes', fragment)}")
    one_line_error(run("doctor", path), "qmtp.fixes")


def test_shifted_norms_without_a_record_are_not_shifted_again(make, tmp_path):
    path = make("shifted_no_record")
    file = path / "model.safetensors"
    _set_fixes_record(path, "[]", shift_norms=True)
    header, data = _header(file)
    header["__metadata__"] = {"format": "pt"}
    _write_header(file, json.dumps(header), data)
    print(one_line_error(chat(path), "norms look already shifted"))
    one_line_error(run("convert", path, tmp_path / "out", "--quiet"), "norms look already shifted")
    assert list(tmp_path.iterdir()) == []


def test_tied_embeddings_with_a_stored_lm_head_say_so(make):
    path = make("tied")
    raw = json.loads((path / "config.json").read_text())
    raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(raw))
    result = chat(path)
    assert result.returncode == 0 and "tie_word_embeddings: true" in result.stderr and "lm_head" in result.stderr


def test_a_tokenizer_much_smaller_than_the_embedding_warns(make, tokenizer):
    path = make("wide_embedding", config=small_config(vocab_size=5000), tokenizer_files=False)
    save(tokenizer, path)
    result = chat(path)
    warning = [line for line in lines(result.stderr) if line.startswith("qmtp: warning: ")]
    assert result.returncode == 0 and len(warning) == 1, result.stderr
    assert f"{VOCAB} ids" in warning[0] and "5000 rows" in warning[0]


def test_undecodable_prompts_are_one_line(good):
    result = subprocess.run([sys.executable.encode(), b"-m", b"qmtp", b"chat", b"--raw", str(good).encode(), b"--prompt",
                             b"\xff\xfe hi"], capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    helpers.one_line_error(result.stderr.decode(), "--prompt", "not valid UTF-8")
    assert result.returncode == 2
    result = run("chat", "--raw", good, "--max-tokens", "2", input="\udcff bad\n".encode("utf-8", "surrogateescape").decode(
        "latin-1"))
    assert result.returncode in (0, 2) and "Traceback" not in result.stderr
    raw = subprocess.run([sys.executable, "-m", "qmtp", "chat", "--raw", str(good), "--max-tokens", "2"], input=b"\xff\xfe\n",
                         capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert raw.returncode == 2
    helpers.one_line_error(raw.stderr.decode(), "stdin", "not valid UTF-8")


def test_a_closed_stdout_is_quiet(good):
    script = (f"printf 'a\\nb\\nc\\n' | {sys.executable} -m qmtp chat --raw {good} --max-tokens 20 2>err.txt | head -c 1 "
              f">/dev/null; {sys.executable} -m qmtp doctor {good} 2>>err.txt | head -1 >/dev/null; cat err.txt")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=good.parent,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert "Traceback" not in result.stdout and "Exception ignored" not in result.stdout, result.stdout


def test_force_replaces_only_a_conversion(good, converted, tmp_path):
    """--force over a folder that no conversion wrote (the current one, home, a symlink) is refused."""
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    print(one_line_error(run("convert", good, keep, "--force", "--quiet"), "replaces only an earlier conversion"))
    print(one_line_error(run("convert", good, ".", "--force", "--quiet", cwd=keep), "current directory"))
    (tmp_path / "link").symlink_to(converted)
    print(one_line_error(run("convert", good, tmp_path / "link", "--force", "--quiet"), "symbolic link"))
    assert (keep / "notes.txt").read_text() == "mine" and (tmp_path / "link").is_symlink()
    (tmp_path / "file").write_text("x")
    print(one_line_error(run("convert", good, tmp_path / "file" / "out", "--quiet"), "is a file, not a directory"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "mine"]


def _read_only_mount() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 3 and "ro" in parts[3].split(",") and Path(parts[1]).is_dir():
            return Path(parts[1])
    return None


def test_a_read_only_filesystem_is_named_as_such(good):
    mount = _read_only_mount()
    if mount is None:
        pytest.skip("no read-only filesystem mounted here")
    result = run("convert", good, mount / "qmtp-out", "--quiet")
    line = one_line_error(result, "read-only filesystem")
    assert "GB free" not in line


def test_a_newline_in_a_path_stays_on_one_line(tmp_path):
    print(one_line_error(chat(tmp_path / "no\nsuch"), "no\\nsuch"))


BENCH_FLAGS = {"--repeats": "0", "--prompts-per-register": "0", "--prompts": "0", "--max-tokens": "-1", "--n-draft-max": "0"}


@pytest.mark.parametrize("flag", list(BENCH_FLAGS))
def test_bench_mtp_counts_must_be_positive(good, flag):
    print(one_line_error(run("bench", "mtp", good, flag, BENCH_FLAGS[flag]), flag, "give 1 or more"))


def test_bench_json_is_checked_before_the_run(good, tmp_path):
    started = time.perf_counter()
    for bench in ("mtp", "decode", "convert"):
        print(one_line_error(run("bench", bench, *([good] if bench != "convert" else []), "--json", tmp_path),
                             "--json", "is a directory"))
    one_line_error(run("bench", "mtp", good, "--json", tmp_path / "absent" / "x.json"), "--json", "does not exist")
    assert time.perf_counter() - started < 60  # refused at parse time, not after minutes of benchmark


def test_n_draft_without_use_mtp_is_refused(good):
    print(one_line_error(chat(good, "--n-draft", "5"), "--n-draft 5", "--use-mtp"))


def test_positions_never_reached_are_not_nan(good):
    result = chat(good, "--use-mtp", "--n-draft", "8", "--max-tokens", "3")
    assert result.returncode == 0 and "nan" not in result.stderr, result.stderr


@pytest.mark.parametrize("call", ["qmtp.load(123)", "qmtp.load(GOOD, dtype='float16')", "qmtp.load(GOOD, head='yes')",
                                  "qmtp.load(GOOD, dtype=mx.int32)", "qmtp.load(GOOD / 'config.json')"])
def test_load_validates_its_arguments(good, call):
    import mlx.core as mx  # noqa: F401 - used by the calls

    with pytest.raises(QmtpError) as info:
        eval(call, {"qmtp": qmtp, "GOOD": good, "mx": mx})  # noqa: S307 - a fixed table of calls
    assert "\n" not in str(info.value)
    print(f"{call}: {type(info.value).__name__}: {info.value}")
