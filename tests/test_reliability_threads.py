"""Reliability, third round (issue 25): threads, clean one-line errors for odd arguments, and no leftovers.

Threads: MLX keeps streams and compiled traces per thread, and a thread's traces used to be freed by the C++
runtime after Python had let the thread go, racing the interpreter's finalization: a generation in a worker
thread returned the right tokens and the process then aborted (SIGABRT). So every case here runs in a fresh
process and checks its exit status as well as its tokens.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
                                           compiled={compiled}).tokens
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
