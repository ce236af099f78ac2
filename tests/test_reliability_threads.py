"""Reliability, third round (issue 25): threads, clean one-line errors for odd arguments, and no leftovers.

Threads: MLX keeps streams and compiled traces per thread, and a thread's traces used to be freed by the C++
runtime after Python had let the thread go, racing the interpreter's finalization: a generation in a worker
thread returned the right tokens and the process then aborted (SIGABRT). So every case here runs in a fresh
process and checks its exit status as well as its tokens.
"""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import helpers
import qmtp

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"


def python(code: str, timeout=240, env=None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    environment.pop("QMTP_MODEL", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environment, timeout=timeout)


@pytest.fixture(scope="module")
def model():
    return qmtp.load()


@pytest.fixture(scope="module")
def reference(model):
    """Tokens of main-thread runs, by n_draft."""
    return {n: qmtp.generate(model, PROMPT, max_tokens=12, n_draft=n).tokens for n in (1, 2, 3)}


def _tokens(result) -> dict:
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "terminate called" not in result.stderr, result.stderr
    line = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(line) == 1, result.stdout
    return eval(line[0][len("TOKENS "):])  # noqa: S307 - our own script's repr of a dict of lists


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("n_draft", [1, 2])
def test_one_worker_thread_exits_normally(reference, n_draft, compiled):
    result = python(f"""
        import threading, qmtp
        model = qmtp.load()
        out = {{}}
        def work():
            out[{n_draft}] = qmtp.generate(model, {PROMPT!r}, max_tokens=12, n_draft={n_draft},
                                           engine=qmtp.Engine(compiled={compiled})).tokens
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        print("TOKENS", out)
    """)
    assert _tokens(result) == {n_draft: reference[n_draft]}


def test_several_threads_share_one_model(reference):
    result = python(f"""
        import threading, qmtp
        model = qmtp.load()
        out, errors = {{}}, []
        def work(i):
            try:
                for n in (1, 2, 3):
                    n = 1 + (n + i) % 3
                    out.setdefault(n, set()).add(tuple(qmtp.generate(model, {PROMPT!r}, max_tokens=12,
                                                                     n_draft=n).tokens))
            except Exception as err:
                errors.append(repr(err))
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        print("TOKENS", {{n: [list(t) for t in sorted(v)] for n, v in out.items()}})
    """)
    assert _tokens(result) == {n: [tokens] for n, tokens in reference.items()}


def test_a_thread_pool_and_a_split_lm_head_made_on_another_thread():
    """lm_head in row blocks runs on streams made at load time, by the loading thread: they must serve the
    decoding thread too (MLX binds an ordinary stream to its thread); a pool's threads end at exit."""
    result = python(f"""
        import concurrent.futures, qmtp
        from qmtp import cores
        model = qmtp.load()
        model._lm_head_split = cores.RowSplitLinear(model.lm_head, 2)
        here = qmtp.generate(model, {PROMPT!r}, max_tokens=12, n_draft=2).tokens
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            there = list(pool.map(lambda n: qmtp.generate(model, {PROMPT!r}, max_tokens=12, n_draft=n).tokens,
                                  [2, 2, 2]))
        assert there == [here] * 3, (here, there)
        print("TOKENS", {{2: here}})
    """)
    assert 2 in _tokens(result)


def test_a_generation_left_early_in_a_thread_exits_normally():
    """A callback that raises leaves the next pass queued (mx.async_eval) on the thread's stream."""
    result = python(f"""
        import threading, qmtp
        model = qmtp.load()
        def stop(tokens):
            raise RuntimeError("enough")
        def work():
            try:
                qmtp.generate(model, {PROMPT!r}, max_tokens=40, n_draft=2, on_tokens=stop)
            except RuntimeError:
                pass
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        print("TOKENS", {{}})
    """)
    assert _tokens(result) == {}


def test_the_model_lock_is_reentrant_for_a_callback(model, reference):
    inner = []

    def again(tokens):
        if not inner:
            inner.append(qmtp.generate(model, PROMPT, max_tokens=12, n_draft=1).tokens)

    assert qmtp.generate(model, PROMPT, max_tokens=12, n_draft=2, on_tokens=again).tokens == reference[2]
    assert inner == [reference[1]]


# ---- class 6: odd arguments end in one line ------------------------------------------------------------------
def run(*argv, env=None, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    environment.pop("QMTP_MODEL", None)
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "qmtp", *map(str, argv)], capture_output=True, text=True,
                          env=environment, timeout=timeout, **kwargs)


def one_line_error(result, *fragments) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    return helpers.one_line_error(result.stderr, *fragments)


CALLS = {
    "no model": ("qmtp.generate(None, PROMPT)", "model: give a qmtp Model"),
    "a path for a model": ("qmtp.generate(str(MODEL.path), PROMPT)", "qmtp.load(path)"),
    "a Path for a model": ("qmtp.generate(MODEL.path, PROMPT)", "qmtp.load(path)"),
    "on_tokens not callable": ("qmtp.generate(MODEL, PROMPT, on_tokens=5)", "on_tokens=5"),
    "head a string": ("qmtp.generate(MODEL, PROMPT, n_draft=2, engine=qmtp.Engine(head='mtp'))", "head: give an MTP head"),
    "head the model": ("qmtp.generate(MODEL, PROMPT, n_draft=2, engine=qmtp.Engine(head=MODEL))", "not Model"),
    "a prompt of booleans": ("qmtp.generate(MODEL, [True, False, True])", "not booleans"),
    "an iterator with a boolean": ("qmtp.generate(MODEL, iter([1, True]))", "not booleans"),
    "a numpy boolean array": ("qmtp.generate(MODEL, np.array([True, False]))", "not booleans"),
    "a dict prompt": ("qmtp.generate(MODEL, {1: 2, 3: 4})", "not a dict"),
    "a set prompt": ("qmtp.generate(MODEL, {1, 2})", "not a set"),
    "seed 2**64": ("qmtp.generate(MODEL, PROMPT, seed=2**64)", "seed=18446744073709551616"),
    "seed 2**64 sampling": ("qmtp.generate(MODEL, PROMPT, seed=2**70, temperature=1.0)", "below 2**64"),
    "a 5,000-character path": ("qmtp.load('a' * 5000)", "5000 characters", "too long"),
    "a 5,000-character nested path": ("qmtp.load('/tmp/' + 'a/' * 2500)", "characters", "too long"),
    "~nosuchuser": ("qmtp.load('~nosuchuser/model')", "~nosuchuser", "no home directory"),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_unchecked_api_arguments_are_one_line(model, case):
    call, *fragments = CALLS[case]
    names = {"qmtp": qmtp, "np": np, "MODEL": model, "PROMPT": PROMPT}
    message = helpers.expect(qmtp.UsageError, lambda: eval(call, names), *fragments)  # noqa: S307 - a fixed table
    print(f"{case}: {message}")


def test_on_tokens_is_checked_before_the_prefill(model, monkeypatch):
    from qmtp import continuous

    monkeypatch.setattr(continuous, "_prefill_row", lambda *a, **k: pytest.fail("prefilled before checking"))
    helpers.expect(qmtp.UsageError, lambda: qmtp.generate(model, PROMPT, on_tokens="print"), "on_tokens")


@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint8, np.uint64])
def test_numpy_integers_are_integers(model, reference, kind):
    out = qmtp.generate(model, PROMPT, max_tokens=kind(12), n_draft=kind(2), seed=kind(0))
    assert out.tokens == reference[2]
    assert qmtp.generate(model, np.array(out.prompt_tokens), max_tokens=kind(12)).tokens == reference[1]


def test_a_seed_of_2_to_the_64_on_the_command_line():
    result = run("chat", "--raw", "--prompt", PROMPT, "--max-tokens", "2", "--seed", str(2**64))
    one_line_error(result, "--seed 18446744073709551616")
    assert result.stdout == ""  # refused before the prompt is echoed
    assert run("chat", "--raw", "--prompt", PROMPT, "--max-tokens", "2", "--seed", str(2**64 - 1)).returncode == 0


@pytest.mark.parametrize("where", ["argument", "QMTP_MODEL", "convert destination", "convert source"])
def test_a_home_of_no_such_user_is_one_line(where, tmp_path):
    missing = "~nosuchuser-qmtp/model"
    if where == "argument":
        result = run("chat", "--raw", missing, "--prompt", PROMPT)
    elif where == "QMTP_MODEL":
        result = run("chat", "--raw", "--prompt", PROMPT, env={"QMTP_MODEL": missing})
    elif where == "convert destination":
        result = run("convert", REPO / "qmtp/assets/tiny", missing)
    else:
        result = run("convert", missing, tmp_path / "out")
    one_line_error(result, "~nosuchuser-qmtp", "no home directory")


@pytest.mark.parametrize("command", ["chat", "convert", "doctor"])
def test_a_5000_character_path_is_one_line(command, tmp_path):
    long = "a" * 5000
    argv = {"chat": ("chat", long, "--raw", "--prompt", PROMPT), "convert": ("convert", REPO / "qmtp/assets/tiny", long),
            "doctor": ("doctor", long)}[command]
    line = one_line_error(run(*argv))
    assert len(line) < 400, line


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_prompt_the_terminal_cannot_encode_is_escaped(encoding):
    prompt = "Once upon a time, caf\u00e9 \u2615 \U0001f600"
    result = run("chat", "--raw", "--prompt", prompt, "--max-tokens", "3", env={"PYTHONIOENCODING": encoding},
                 encoding=encoding)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stdout.startswith("Once upon a time, caf")
    assert "\\u2615" in result.stdout


def test_a_prompt_line_ended_by_crlf_loses_the_cr():
    plain = run("chat", "--raw", "--max-tokens", "4", input=f"{PROMPT}\n")
    crlf = run("chat", "--raw", "--max-tokens", "4", input=f"{PROMPT}\r\n")
    assert plain.returncode == crlf.returncode == 0, crlf.stderr
    assert "\r" not in crlf.stdout
    assert crlf.stdout == plain.stdout


# ---- class 7: leftovers and wrong messages --------------------------------------------------------------------
TINY = REPO / "qmtp" / "assets" / "tiny"


def _synthetic(directory: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qmtp", "synthetic", str(directory), "--preset",
                             "qwen3.6-35b-a3b-reduced", "--sparse", "--quiet"],
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _partials(directory: Path) -> list[Path]:
    return sorted(directory.parent.glob(f".{directory.name}.partial-*"))


def _wait_for_a_partial_with_files(directory: Path, process) -> Path:
    for _ in range(600):
        found = _partials(directory)
        if found and any(found[0].iterdir()):
            return found[0]
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    raise AssertionError("no partial folder appeared")


def test_a_killed_synthetic_run_leaves_a_partial_folder_the_next_run_removes(tmp_path):
    target = tmp_path / "model"
    killed = _synthetic(target)
    stale = _wait_for_a_partial_with_files(target, killed)
    killed.kill()
    killed.wait()
    assert stale.exists()  # SIGKILL: nothing could clean up
    # a live run writing the same folder keeps its partial folder while a second run starts and is refused
    live = _synthetic(target)
    try:
        mine = [p for p in _partials(target) if p != stale]
        for _ in range(600):
            mine = [p for p in _partials(target) if p != stale]
            if mine:
                break
            time.sleep(0.05)
        assert not stale.exists(), "the next run left the killed run's partial folder"
        target.mkdir()  # so that the next run only cleans up and stops
        one_line_error(run("synthetic", target, "--preset", "qwen3.6-35b-a3b-reduced", "--sparse"), "already exists")
        assert mine and all(p.exists() for p in mine), "a run removed the partial folder of a run still writing"
    finally:
        live.kill()
        live.wait()
    one_line_error(run("synthetic", target, "--preset", "qwen3.6-35b-a3b-reduced", "--sparse"), "already exists")
    assert _partials(target) == []


@pytest.mark.parametrize("length", [241, 255])
def test_a_long_destination_name_converts(tmp_path, length):
    dst = tmp_path / ("d" * length)
    result = run("convert", TINY, dst, "--bits", "4", "--quiet")
    assert result.returncode == 0, result.stderr
    assert qmtp.load(dst).config.vocab_size
    assert [p.name for p in tmp_path.iterdir()] == [dst.name]  # lock and partial folder gone
    # a second run finds the lock and leftovers of the first under the same hashed names
    assert run("convert", TINY, dst, "--bits", "4", "--quiet", "--force").returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == [dst.name]


def test_side_names_of_distinct_long_destinations_differ():
    from qmtp.convert import side_stem

    a, b = "x" * 250, "x" * 249 + "y"
    assert side_stem("short") == "short"
    assert side_stem(a) != side_stem(b)
    accented = "\u00e9" * 127  # 254 bytes in UTF-8
    assert len(os.fsencode(f".{side_stem(accented)}.qmtp-partial-12345678")) <= 255


@pytest.mark.parametrize("n_draft", [1, 2, 4])
def test_a_prompt_filling_the_context_says_the_prompt_is_too_long(model, n_draft):
    limit = model.config.max_position_embeddings
    prompt = [5] * (limit - n_draft + 1)  # one position short of the prompt, its drafts and one new token
    message = helpers.expect(qmtp.UsageError, lambda: qmtp.generate(model, prompt, max_tokens=1, n_draft=n_draft),
                             f"prompt of {len(prompt)} tokens is too long", f"at most {limit - n_draft} tokens")
    assert "new tokens" not in message and "-" not in message.split("at most")[1]
    with pytest.raises(qmtp.UsageError, match="ask for at most 1 new tokens"):
        qmtp.generate(model, prompt[1:], max_tokens=2, n_draft=n_draft)


@pytest.fixture
def copy_of_tiny(tmp_path):
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(TINY, copy)
    return copy


@pytest.mark.parametrize("damage", ["truncated", "not a tokenizer", "dangling link"])
def test_a_damaged_tokenizer_fails_doctor_and_convert_and_chat(copy_of_tiny, tmp_path, damage):
    tok = copy_of_tiny / "tokenizer.json"
    if damage == "truncated":
        tok.write_bytes(tok.read_bytes()[:1000])
        fragment = "cannot load tokenizer"
    elif damage == "not a tokenizer":
        tok.write_text('{"version": "1.0", "model": {"type": "nothing"}}')
        fragment = "cannot load tokenizer"
    else:
        tok.unlink()
        tok.symlink_to(tmp_path / "elsewhere" / "tokenizer.json")
        fragment = f"dangling symbolic link to {tmp_path / 'elsewhere' / 'tokenizer.json'}"
    doctor = run("doctor", copy_of_tiny)
    assert doctor.returncode == 2 and "Traceback" not in doctor.stderr, doctor.stderr
    assert "tokenizer: UNUSABLE" in doctor.stdout and fragment in doctor.stderr
    one_line_error(run("convert", copy_of_tiny, tmp_path / "out", "--quiet"), "tokenizer.json", fragment)
    assert not (tmp_path / "out").exists()
    one_line_error(run("chat", "--raw", copy_of_tiny, "--prompt", PROMPT), fragment)


def test_doctor_names_the_tokenizer_it_checked():
    result = run("doctor", TINY)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^tokenizer: \d+ ids$", result.stdout, re.M), result.stdout


@pytest.mark.parametrize("run", range(4))  # the abort was a race at exit, in about half the runs
def test_loading_in_worker_threads_exits_normally_and_reads_the_same_weights(model, run):
    """qmtp.load on a worker thread, then a full load on the next worker (which usually gets the first one's
    thread id back): the process exits 0 (it aborted when a loading thread kept its MLX streams, and when the
    first load's unread lazy arrays outlived it in a cache keyed by thread id), and the second model's weights
    equal a main-thread load's."""
    result = python("""
        import threading, qmtp
        import mlx.core as mx
        from mlx.utils import tree_flatten
        sums = {}
        def work(layers):
            loaded = qmtp.load(layers=layers)
            mx.eval(loaded.parameters())
            for name, w in tree_flatten(loaded.parameters()):
                sums[name] = float(mx.sum(w.astype(mx.float32)).item())
        for layers in (1, None):
            thread = threading.Thread(target=work, args=(layers,))
            thread.start()
            thread.join()
        print("TOKENS", repr(sums))
    """)
    sums = _tokens(result)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    expected = {name: float(mx.sum(w.astype(mx.float32)).item()) for name, w in tree_flatten(model.parameters())}
    assert sums == expected
