"""The command line under hostile and unlucky use (issue 32's third and fifth classes, issue 33's sixth item): flags
that would end the ranks at once or never, hostfiles and rank counts refused before any process starts, ranks
that end when their launcher or their time does, a ^C that ends cleanly, stdin relayed byte for byte, blank
lines, escaped stop strings, UTF-8 under a C locale, a model without a chat template, errors in one line."""

import contextlib
import io
import json
import os
import pty
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import one_line_error

from qmtp import cli, launch
from qmtp.errors import QmtpError, UsageError
from qmtp.loading import BUNDLED_MODEL

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
ENV.pop("QMTP_MODEL", None)


def qmtp_cli(*argv, input=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qmtp", *map(os.fsencode, map(str, argv))], capture_output=True,
                          input=input, env=env or ENV, timeout=timeout)


def in_process(capsys, *argv) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def no_launch(monkeypatch):
    """Any rank started would be an error: every refusal must come before the launcher runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


# ---- flags, hostfiles and rank counts: refused before any rank starts ------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_must_be_a_finite_number_of_seconds_above_0(value, capsys, no_launch):
    status, _, err = in_process(capsys, "chat", "--ranks", "2", f"--timeout={value}", "--prompt", "hi")
    assert status == 2
    one_line_error(err, "--timeout", value)
    with pytest.raises(UsageError, match="seconds above 0"):
        launch.run(["x.py"], ranks=2, timeout=float(value) if value != "soon" else value)


@pytest.mark.parametrize("content, fragment", [
    ("[]", "names no hosts"),
    ('[{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]', "names 1 host"),
    ('{"hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}]}', "names 1 host"),
    ("[{", "not valid JSON"),
    ('{"backend": "ring"}', "expected a JSON list of hosts"),
    ('[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]', 'host 1 (b) has no "ips"'),
    ('[{"ssh": "a", "ips": ["10.0.0.1"]}, "b"]', "host 1 is not an object"),
])
def test_a_hostfile_that_cannot_make_a_ring_is_one_line(content, fragment, tmp_path, capsys, no_launch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(content)
    status, _, err = in_process(capsys, "chat", "--hostfile", hostfile, "--prompt", "hi")
    assert status == 2
    one_line_error(err, "--hostfile", fragment)


def test_rank_counts_the_model_or_this_host_cannot_take_are_refused_first(capsys, monkeypatch, no_launch):
    for ranks in (1000, 3):  # the bundled model has 256 experts per layer
        status, _, err = in_process(capsys, "chat", "--ranks", ranks, "--prompt", "hi")
        assert status == 2
        one_line_error(err, "256 routed experts", f"do not split evenly over {ranks} ranks")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    status, _, err = in_process(capsys, "chat", "--ranks", 4, "--prompt", "hi")
    assert status == 2
    one_line_error(err, "--ranks 4", "2 cores")
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 1 if name == "SC_PHYS_PAGES" else real(name))
    status, _, err = in_process(capsys, "chat", "--ranks", 2, "--prompt", "hi")
    assert status == 2
    one_line_error(err, "--ranks 2", "more than its")


def test_a_missing_model_is_named_before_the_ranks_start(tmp_path, capsys, no_launch):
    status, _, err = in_process(capsys, "chat", tmp_path / "absent", "--ranks", 2, "--prompt", "hi")
    assert status == 2
    one_line_error(err, "absent", "no such model directory")


# ---- the relayed input: every byte of a line arrives, and the end is the relay's alone ---------------------------
LINES = [b"hello", b"\x04", b".", b"", b"   ", b"=aGk=", b"+", b"a\x03b\x1a\x00c", "h\u00e9llo \u2603".encode(),
         b"\xff\xfe not utf-8", b"x" * 5000, b"\r"]


def test_relayed_lines_come_back_byte_for_byte_through_a_terminal():
    records = b"".join(launch.relayed_line(line) for line in LINES) + launch.END_OF_INPUT + b"never-read\n"
    for record in records.splitlines():
        # printable and short: a terminal on another host (ssh -tt) neither acts on a byte nor cuts the line
        assert all(0x20 < b < 0x7F for b in record) and len(record) < 4096
    assert list(launch.relayed_lines(io.BytesIO(records))) == LINES


def test_the_relay_sends_each_line_then_the_end(tmp_path):
    source_r, source_w = os.pipe()
    sink_r, sink_w = os.pipe()
    os.write(source_w, b"one\n\x04\ntwo\nlast without newline")
    os.close(source_w)
    launch._relay(source_r, sink_w)
    os.close(sink_w)
    with os.fdopen(sink_r, "rb") as sink:
        assert list(launch.relayed_lines(sink)) == [b"one", b"\x04", b"two", b"last without newline"]


def test_a_rank_refuses_input_that_was_not_relayed():
    with pytest.raises(UsageError, match="not relayed by qmtp.launch"):
        list(launch.relayed_lines(io.BytesIO(b"hello\n")))


# ---- a rank's own watchdog ---------------------------------------------------------------------------------------
RANK = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    from qmtp import launch
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank inside a collective: SIGTERM does nothing
    launch.watch_this_rank()
    print(os.getpid(), flush=True)
    while True:
        time.sleep(1)
""")


def start_rank(tmp_path, timeout: float | None, under_launcher: bool):
    """A stand-in rank (optionally under a stand-in launcher that can be killed); (launcher or None, rank pid)."""
    env = dict(ENV, **{launch.RANKS_ENV: "1"})
    if timeout is not None:
        env[launch.TIMEOUT_ENV] = str(timeout)
    (tmp_path / "rank.py").write_text(RANK.format(repo=str(REPO)))
    rank = [sys.executable, str(tmp_path / "rank.py")]
    if under_launcher:
        code = f"import subprocess, sys, time; subprocess.Popen({rank!r}); time.sleep(600)"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    else:
        proc = subprocess.Popen(rank, stdout=subprocess.PIPE, env=env, text=True)
    return proc, int(proc.stdout.readline())


def gone_within(pid: int, seconds: float) -> bool:
    import psutil

    stop = time.monotonic() + seconds
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > stop:
            return False
        time.sleep(0.05)


def test_a_rank_whose_launcher_is_gone_is_ended_by_its_watchdog(tmp_path):
    launcher, rank = start_rank(tmp_path, None, under_launcher=True)
    try:
        os.kill(rank, signal.SIGSTOP)  # stopped, too: no code of its own runs
        launcher.kill()
        launcher.wait()
        assert gone_within(rank, 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)


def test_a_stopped_rank_that_ignores_sigterm_is_killed_at_its_deadline(tmp_path):
    proc, rank = start_rank(tmp_path, 1.0, under_launcher=False)
    try:
        os.kill(rank, signal.SIGSTOP)
        started = time.monotonic()
        assert gone_within(rank, 1.0 + launch.GRACE_S + 5)
        assert time.monotonic() - started > 1.0  # not before its time
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        proc.kill()


def test_no_watchdog_outside_a_rank(monkeypatch):
    monkeypatch.delenv(launch.RANKS_ENV, raising=False)
    assert launch.watch_this_rank() is None


# ---- ^C or SIGTERM while ranks run -----------------------------------------------------------------------------------
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_launcher_stopped_while_ranks_read_a_terminal_ends_them_cleanly(signum, status, tmp_path):
    """The relay once read stdin through Python's buffered file: a ^C then ended the launcher with "Fatal Python
    error: ... daemon threads" (and SIGABRT) whenever stdin was a terminal. SIGTERM (raised as an exception, as
    `qmtp.cli` does) once left the ranks and mlx.launch running."""
    import psutil

    echo = tmp_path / "echo.py"
    echo.write_text("import sys\nfor line in sys.stdin:\n    print('got', line.strip(), flush=True)\n")
    code = (f"import signal, sys; sys.path.insert(0, {str(REPO)!r}); from qmtp import launch\n"
            f"def stop(signum, frame): raise SystemExit(128 + signum)\n"
            f"signal.signal(signal.SIGTERM, stop)\n"
            # as at a terminal: a job a non-interactive shell starts in the background inherits SIGINT ignored
            f"signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"sys.exit(launch.run([{str(echo)!r}], ranks=2, relay_stdin=True, timeout=120))")
    terminal, its_side = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=its_side, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ranks, seen = [], []
    try:
        os.write(terminal, b"hello\n")
        assert proc.stdout.readline().startswith("got ")
        # on a busy machine rank 0 can answer before rank 1 has started, and a rank forked but not yet
        # started shows its launcher's command line and environment
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(psutil.Error):
                ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if str(echo) in p.cmdline()]
                seen = sorted(p.environ().get("MLX_RANK", "launcher") for p in ranks)
            if seen == ["0", "1", "launcher"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert seen == ["0", "1", "launcher"]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == status, err
        assert "Fatal Python error" not in err and err == ""
        assert all(gone_within(r.pid, launch.GRACE_S) for r in ranks)
    finally:
        proc.kill()
        for r in ranks:
            with contextlib.suppress(psutil.Error):
                r.kill()
        os.close(terminal)
        os.close(its_side)


# ---- chat's input and flags ----------------------------------------------------------------------------------------
def test_a_stdin_line_of_spaces_is_skipped_not_the_end_of_the_chat():
    result = qmtp_cli("chat", "--thinking=false", "--max-tokens", "2", input=b"hello\n   \n\t\nthere\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr.decode().count("tok/s") == 2  # two turns, the blank lines skipped


@pytest.mark.parametrize("given, meant", [
    ("\\n\\n", "\n\n"), ("a\\tb", "a\tb"), ("\\\\n", "\\n"), ("\\u2603", "\u2603"), ("\\x41", "A"),
    ("C:\\path", "C:\\path"), ("plain", "plain"), ("\\", "\\"),
])
def test_stop_strings_are_unescaped(given, meant):
    assert cli.build_parser().parse_args(["chat", "--stop", given]).stop == [meant]


def test_an_escape_past_the_last_character_is_one_line(capsys):
    status, _, err = in_process(capsys, "chat", "--stop", "\\U00110000")
    assert status == 2
    one_line_error(err, "--stop", "U+10FFFF")


def test_an_escaped_stop_string_reaches_the_generation():
    # greedy, the bundled model continues "Once upon a time" with ", a little hedgehog": \x2c is that comma
    result = qmtp_cli("chat", "--raw", "--temperature", "0", "--max-tokens", "20", "--stop", "\\x2c",
                      "--prompt", "Once upon a time")
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"Once upon a time\n"


C_LOCALE = dict(ENV, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")


def test_utf8_in_argv_is_accepted_under_a_c_locale():
    result = qmtp_cli("chat", "--raw", "--max-tokens", "1", "--prompt", "h\u00e9llo", "--stop", "\u2603",
                      env=C_LOCALE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("h\u00e9llo".encode("ascii", "backslashreplace"))
    bad = subprocess.run([sys.executable, "-m", "qmtp", "chat", "--raw", "--prompt", b"h\xffllo"],
                         capture_output=True, text=True, env=C_LOCALE, timeout=300)
    assert bad.returncode == 2
    one_line_error(bad.stderr, "--prompt", "not valid UTF-8")


def without_template(tmp_path: Path) -> Path:
    for f in BUNDLED_MODEL.iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            (tmp_path / f.name).symlink_to(f)
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    return tmp_path


def test_a_model_without_a_chat_template_is_continued_raw_said_once(tmp_path):
    path = without_template(tmp_path)
    result = qmtp_cli("chat", path, "--temperature", "0", "--max-tokens", "3", input=b"Once upon\nThe dog\n")
    raw = qmtp_cli("chat", path, "--raw", "--temperature", "0", "--max-tokens", "3", input=b"Once upon\nThe dog\n")
    assert result.returncode == 0 == raw.returncode, result.stderr
    assert result.stdout == raw.stdout and result.stdout.startswith(b"Once upon")
    notes = [line for line in result.stderr.decode().splitlines() if line.startswith("qmtp: ")]
    assert len(notes) == 1 and "has no chat template" in notes[0] and "plain text" in notes[0]
    assert "has no chat template" not in raw.stderr.decode()  # --raw asked for it: nothing to say
    flagged = qmtp_cli("chat", path, "--system", "Be brief.", "--prompt", "hi")
    assert flagged.returncode == 2
    one_line_error(flagged.stderr.decode(), "--system", "no chat template")


def test_a_damaged_generation_config_is_one_line(tmp_path):
    for f in BUNDLED_MODEL.iterdir():
        if f.is_file() and f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.5,')
    result = qmtp_cli("chat", tmp_path, "--prompt", "hi", "--max-tokens", "2")
    assert result.returncode == 2
    one_line_error(result.stderr.decode(), "generation_config.json")


def test_an_error_in_a_later_turn_is_one_line_after_the_earlier_replies(monkeypatch, capsys):
    """Whatever the API raises as a QmtpError mid-conversation (a template's error, damaged weights) ends chat
    with its one line and status 2, the replies before it printed whole."""
    import qmtp.conversation

    send = qmtp.conversation.Conversation.send
    turns = []

    def failing_second(self, prompt, **kwargs):
        turns.append(prompt)
        if len(turns) == 2:
            raise QmtpError("chat_template.jinja: the template raised an error in turn 2")
        return send(self, prompt, **kwargs)

    monkeypatch.setattr(qmtp.conversation.Conversation, "send", failing_second)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\nagain\nnever\n")))
    status, out, err = in_process(capsys, "chat", "--thinking=false", "--max-tokens", "2")
    assert status == 2 and turns == ["hello", "again"]
    assert out.endswith("\n") and out.count("\n") >= 1
    one_line_error("\n".join(line for line in err.splitlines() if "tok/s" not in line), "template raised an error")


# ---- several ranks, for real (slow) ----------------------------------------------------------------------------------
def rank_processes(launcher_pid: int):
    import psutil

    found = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "-m qmtp" in " ".join(child.cmdline()) and "MLX_RANK" in child.environ():
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_a_timeout_ends_every_rank_even_one_stopped_and_one_inside_a_collective():
    """Rank 0 stopped while rank 1 waits for it in a collective (where no Python code runs, so SIGTERM stays
    pending): once stopped "every rank" at the timeout, none may be left, both in well under a minute."""
    import psutil

    timeout = 30
    proc = subprocess.Popen([sys.executable, "-m", "qmtp", "chat", "--raw", "--max-tokens", "2", "--ranks", "2",
                             "--timeout", str(timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    ranks = []
    try:
        proc.stdin.write(b"Once upon a time\n")
        proc.stdin.flush()
        assert proc.stdout.readline()  # the first reply: both ranks now wait for the next line, rank 1 in a collective
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 2
        next(r for r in ranks if r.environ()["MLX_RANK"] == "0").suspend()
        assert proc.wait(timeout + launch.GRACE_S * 3) == 124
        assert "every rank was stopped" in proc.stderr.read().decode()
        assert all(gone_within(r.pid, launch.GRACE_S) for r in ranks)
    finally:
        proc.kill()
        for r in ranks:
            with contextlib.suppress(psutil.Error):
                r.kill()


@pytest.mark.slow
def test_a_ring_port_taken_meanwhile_is_named_by_the_rank(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = io.StringIO()
        code = launch.run(["-m", "qmtp", "chat", "--raw", "--prompt", "hi", "--max-tokens", "2"], ranks=2, port=port,
                          timeout=120, out=io.StringIO(), err=err)
    assert code == 2
    line = one_line_error(err.getvalue(), "could not join the ring")
    assert "Address already in use" in line or "error: 48" in line, line
