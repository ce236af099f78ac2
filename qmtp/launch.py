"""Starting a qmtp command on N ranks through `mlx.launch` (MLX's own launcher: ring backend over TCP).

`python -m qmtp chat MODEL --ranks 2` re-runs itself as `mlx.launch -n 2 --backend ring --starting-port P
python -m qmtp chat MODEL` with P a free port (the ring takes P .. P + N - 1 on localhost), or with
`--hostfile FILE` across the machines that file names, as `mlx.launch --hostfile` does. Every rank loads the
model expert-parallel (`qmtp.parallel`); rank 0 prints.

When one rank exits with an error, `mlx.launch` stops the others; the ones still inside a collective learn
it as "[ring] connection to a peer was lost" (and some dozen lines of socket noise before it). `run` keeps
the ranks' output but that noise, and ends with one line saying which rank failed first and why. A rank that
hangs cannot be told from a slow one, so `timeout` (seconds for the whole run) ends every rank when it is past:
the launcher's process group (this host's ranks) politely, then with SIGKILL, and each rank, wherever it runs,
is also watched by its own `qmtp.watchdog` process (`watch_this_rank`), which ends it when its launcher is gone
or its time is up.

`mlx.launch` copies its stdin to every rank; on another host that is a terminal (`ssh -tt`), which would take a
control byte (^D, ^C) for a command and cut long lines. So `run` relays each line as printable records
(`relayed_line`), ended by one that says the input ended (`END_OF_INPUT`), and a rank reads them back with
`relayed_lines`: any byte of a user's line arrives as it was typed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .errors import UsageError

# Set by `run` in each rank's environment: the rank is one of several started by qmtp (its commands load
# expert-parallel and only rank 0 prints).
RANKS_ENV = "QMTP_RANKS"
# Set by `run` when it has a timeout: the seconds each rank's own watchdog gives it (`watch_this_rank`)
TIMEOUT_ENV = "QMTP_RANK_TIMEOUT"
# A rank's watchdog ends it this long after the launcher's own deadline would have (the launcher says why), and
# waits this long between SIGTERM and SIGKILL, as the launcher does
WATCHDOG_MARGIN_S = 2.0
GRACE_S = 5.0
# Lines of the ring backend's own report of a lost peer: one per failed send or receive
NOISE = ("[ring] Socket", "[ring] Too many send/recv errors")
# The records of relayed input, one a line: a piece of a line (more follows), a line's last piece, the end
PIECE, LAST_PIECE, END_OF_INPUT = b"+", b"=", b".\n"
PIECE_BYTES = 768  # base64 of it stays under a terminal's 4096-byte line
EXITED = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
LAUNCHER = re.compile(r"\x1b\[33m\[WARN\]|[ \t]*Node with rank \d+ (exited with code -?\d+|was killed)[ \t]*|"
                      r"[ \t]*\x1b\[0m")


def launcher() -> str:
    """The `mlx.launch` beside this Python (a virtual environment's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mlx.launch"
    if beside.exists():
        return str(beside)
    found = shutil.which("mlx.launch")
    if found is None:
        raise UsageError("mlx.launch not found: it comes with MLX (pip install 'mlx[cpu]' or mlx)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """A port P such that P .. P + count - 1 are free on localhost now (the ring's ranks listen on them)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count < 65536 and all(_port_free(port + i) for i in range(1, count)):
            return port
    raise UsageError(f"no {count} consecutive free ports on localhost for the ranks")


def hostfile_hosts(hostfile) -> int:
    """How many hosts an mlx.launch hostfile names (a list of {"ssh": ..., "ips": [...]}, or {"hosts": that list});
    UsageError unless it is readable JSON naming two or more hosts, each with the IP the ring listens on."""
    path = Path(hostfile)
    try:
        data = json.loads(path.read_bytes())
    except OSError as err:
        raise UsageError(f"--hostfile {path}: {err.strerror or err}") from None
    except (ValueError, RecursionError) as err:
        raise UsageError(f"--hostfile {path}: not valid JSON ({str(err).splitlines()[0][:120]})") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list):
        raise UsageError(f"--hostfile {path}: expected a JSON list of hosts (or an object with \"hosts\": [...])")
    for i, host in enumerate(hosts):
        if not (isinstance(host, dict) and isinstance(host.get("ssh"), str) and host["ssh"]):
            raise UsageError(f"--hostfile {path}: host {i} is not an object with \"ssh\": a host name")
        ips = host.get("ips")
        if not (isinstance(ips, list) and ips and all(isinstance(ip, str) and ip for ip in ips)):
            raise UsageError(f"--hostfile {path}: host {i} ({host['ssh']}) has no \"ips\": the ring backend listens "
                             f"on an IP address, e.g. \"ips\": [\"192.168.1.2\"]")
    if len(hosts) < 2:
        raise UsageError(f"--hostfile {path}: names {len(hosts) or 'no'} host{'' if len(hosts) == 1 else 's'}; "
                         f"spreading the experts needs 2 or more (one host: leave --hostfile out)")
    return len(hosts)


def check_timeout(timeout) -> None:
    if timeout is not None and not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"timeout={timeout!r}: give a number of seconds above 0 (or None for no limit)")


def command(argv: list[str], ranks: int | None = None, hostfile=None, port: int | None = None,
            timeout: float | None = None) -> list[str]:
    """The `mlx.launch` command line running `python argv...` on `ranks` local ranks or on `hostfile`'s hosts."""
    cmd = [launcher(), "--backend", "ring", "--python", sys.executable, "--env", f"{RANKS_ENV}=1"]
    if "PYTHONPATH" in os.environ:  # a checkout run in place: every rank imports the same qmtp
        cmd += ["--env", f"PYTHONPATH={os.environ['PYTHONPATH']}"]
    if timeout is not None:
        cmd += ["--env", f"{TIMEOUT_ENV}={timeout + WATCHDOG_MARGIN_S:g}"]
    if hostfile is not None:
        hostfile_hosts(hostfile)
        cmd += ["--hostfile", str(hostfile)]
    else:
        if ranks is None or ranks < 1:
            raise UsageError(f"ranks={ranks}: give a number of ranks >= 1")
        cmd += ["-n", str(ranks), "--starting-port", str(port or free_ports(ranks))]
    return cmd + ["--", *argv]


class _Output:
    """The ranks' output as it comes from mlx.launch, less the ring's lost-peer noise; what mlx.launch says of
    each rank (exited, killed) kept for one line at the end."""

    def __init__(self, out, err):
        self.out, self.err = out, err
        self.failures: list[tuple[int, int]] = []  # (rank, exit code), in the order mlx.launch reported them
        self.reported = []  # a rank's own one-line "qmtp: error: ...": the summary line would repeat it

    def pump(self, stream, is_err: bool) -> None:
        sink = self.err if is_err else self.out
        for line in stream:
            if is_err:
                # mlx.launch's own reports ("[WARN] Node with rank R exited with code C", or "was killed"), kept
                # for the one line at the end; printed from its threads piece by piece, they can land in the
                # middle of a rank's lines
                self.failures.extend((int(r), int(c)) for r, c in EXITED.findall(line))
                line = LAUNCHER.sub("", line)
                if not line.strip():
                    continue
            if line.startswith(NOISE):
                continue
            if is_err and line.startswith("qmtp: error:"):
                self.reported.append(line)
            sink.write(line)
            sink.flush()

    def status(self, returncode: int) -> int:
        """0 when every rank finished; else one line on `err` (unless a rank said why itself) and a code."""
        # mlx.launch itself exits 0 when a rank failed: its own report of the rank is what says so
        if not (returncode or self.failures):
            return 0
        if not self.reported:
            # Every failed rank, not only the first mlx.launch saw: a rank waiting on one that died fails
            # itself ("connection to a peer was lost"), sometimes before the launcher notices the first.
            failed = ", ".join(f"rank {r} exited with code {c}" for r, c in sorted(set(self.failures)))
            self.err.write(f"qmtp: error: {failed or f'mlx.launch exited with code {returncode}'}; the other "
                           f"ranks were stopped\n")
        # the status of a rank that exited by itself (its own error), before that of one stopped by a signal
        codes = [c for _, c in sorted(set(self.failures))]
        own = next((c for c in codes if c > 0), None)
        return own or next((128 - c for c in codes if c < 0), None) or returncode or 1


def run(argv: list[str], ranks: int | None = None, hostfile=None, timeout: float | None = None,
        out=None, err=None, relay_stdin: bool = False, port: int | None = None) -> int:
    """Run `python argv...` on the ranks; their output goes to `out` / `err` (default this process's), the
    ring's lost-peer noise left out. Returns 0 when every rank did; else one line on `err` and a non-zero code:
    124 past `timeout` seconds, 130 on ^C, every rank ended either way."""
    check_timeout(timeout)
    output = _Output(out or sys.stdout, err or sys.stderr)
    cmd = command(argv, ranks, hostfile, port, timeout)
    # Its own process group: on a timeout or ^C, the launcher and every rank it started here are ended together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.PIPE if relay_stdin else subprocess.DEVNULL, text=True,
                            errors="replace", start_new_session=True)
    pumps = [threading.Thread(target=output.pump, args=(proc.stdout, False), daemon=True),
             threading.Thread(target=output.pump, args=(proc.stderr, True), daemon=True)]
    for t in pumps:
        t.start()
    if relay_stdin:
        threading.Thread(target=_relay, args=(sys.stdin.fileno(), proc.stdin.fileno()), daemon=True).start()
    started = time.monotonic()
    try:
        while proc.poll() is None:
            if timeout is not None and time.monotonic() - started > timeout:
                _end(proc, pumps)
                output.err.write(f"qmtp: error: the {ranks or 'hostfile'} ranks did not finish within {timeout:g} s "
                                 f"(a rank hung or is too slow); every rank was stopped\n")
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _end(proc, pumps)
        return 130
    except BaseException:  # SIGTERM or SIGHUP raised in this thread (`qmtp.cli` does): the ranks end with it
        _end(proc, pumps)
        raise
    for t in pumps:
        t.join(5)
    return output.status(proc.returncode)


def relayed_line(line: bytes) -> bytes:
    """`line` (its newline left out) as the records `relayed_lines` reads back: printable, each short."""
    pieces = [line[i:i + PIECE_BYTES] for i in range(0, len(line), PIECE_BYTES)] or [b""]
    return b"".join((LAST_PIECE if i == len(pieces) - 1 else PIECE) + base64.b64encode(piece) + b"\n"
                    for i, piece in enumerate(pieces))


def relayed_lines(stream):
    """The lines `run` relayed (bytes, without their newline), read from `stream` (a rank's stdin) up to the end
    of the input; a record that is not one of `relayed_line`'s is a UsageError."""
    line = b""
    for record in iter(stream.readline, b""):
        record = record.rstrip(b"\r\n")
        if record + b"\n" == END_OF_INPUT:
            return
        kind, data = record[:1], record[1:]
        try:
            line += base64.b64decode(data, validate=True)
        except ValueError:
            kind = b""
        if kind not in (PIECE, LAST_PIECE):
            raise UsageError("stdin: this rank's input was not relayed by qmtp.launch (started by mlx.launch "
                             "directly?)")
        if kind == LAST_PIECE:
            yield line
            line = b""


def _relay(source: int, sink: int) -> None:
    """This process's stdin, line by line, to mlx.launch (which copies it to every rank), then END_OF_INPUT.
    Raw file descriptors, no Python file object: a thread blocked here holds no lock that this process, ending
    on a ^C, would wait for ("Fatal Python error ... daemon threads")."""
    pending = b""

    def send(data: bytes) -> None:
        while data:
            data = data[os.write(sink, data):]

    try:
        while chunk := os.read(source, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            send(b"".join(relayed_line(line) for line in lines))
        send((relayed_line(pending) if pending else b"") + END_OF_INPUT)
    except OSError:  # the ranks ended first
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def _end(proc, pumps=()) -> None:
    """End the launcher and its ranks on this host (one process group): SIGTERM, then SIGKILL to whatever of the
    group is left after GRACE_S. mlx.launch itself exits at once on SIGTERM, while a rank stopped or waiting in
    a collective does not (no Python code runs there): the group, not the launcher, decides when to escalate."""
    with _no_interrupt():
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            stop = time.monotonic() + GRACE_S
            while time.monotonic() < stop:
                proc.poll()  # reaps the launcher: a zombie still counts in its group
                if not _group_alive(proc.pid):
                    break
                time.sleep(0.05)
            else:
                continue
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(GRACE_S)
        for t in pumps:  # their lines printed now, not by a thread still writing while this process exits
            t.join(GRACE_S)


@contextlib.contextmanager
def _no_interrupt():
    """A second ^C while the ranks are being ended would leave them running: hold it until they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def watch_this_rank() -> subprocess.Popen | None:
    """In a rank `run` started: start its watchdog (`qmtp.watchdog`), which ends this process when its launcher
    is gone, or TIMEOUT_ENV seconds from now. None outside such a rank."""
    if not os.environ.get(RANKS_ENV):
        return None
    seconds = os.environ.get(TIMEOUT_ENV) or "0"
    script = Path(__file__).with_name("watchdog.py")
    # -I: the standard library only; its own stdin and stdout, so it never holds the ranks' pipes open
    return subprocess.Popen([sys.executable, "-I", str(script), str(os.getpid()), str(os.getppid()), seconds,
                             f"{GRACE_S:g}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
