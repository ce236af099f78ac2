"""Starting a qmtp command on N ranks through `mlx.launch` (MLX's own launcher: ring backend over TCP).

`python -m qmtp chat MODEL --ranks 2` re-runs itself as `mlx.launch -n 2 --backend ring --starting-port P
python -m qmtp chat MODEL` with P a free port (the ring takes P .. P + N - 1 on localhost), or with
`--hostfile FILE` across the machines that file names, as `mlx.launch --hostfile` does. Every rank loads the
model expert-parallel (`qmtp.parallel`); rank 0 prints.

When one rank exits with an error, `mlx.launch` stops the others; the ones still inside a collective learn
it as "[ring] connection to a peer was lost" (and some dozen lines of socket noise before it). `run` keeps
the ranks' output but that noise, and ends with one line saying which rank failed first and why. A rank that
hangs cannot be told from a slow one, so `timeout` (seconds for the whole run) ends every rank when it is past.
"""

from __future__ import annotations

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
# Lines of the ring backend's own report of a lost peer: one per failed send or receive
NOISE = ("[ring] Socket", "[ring] Too many send/recv errors")
# mlx.launch relays its stdin to the ranks but never closes theirs: `run` sends this line when its own input
# ends, and a rank reading prompts stops at it (`qmtp.cli.chat`)
END_OF_INPUT = b"\x04"
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


def command(argv: list[str], ranks: int | None = None, hostfile=None, port: int | None = None) -> list[str]:
    """The `mlx.launch` command line running `python argv...` on `ranks` local ranks or on `hostfile`'s hosts."""
    cmd = [launcher(), "--backend", "ring", "--python", sys.executable, "--env", f"{RANKS_ENV}=1"]
    if "PYTHONPATH" in os.environ:  # a checkout run in place: every rank imports the same qmtp
        cmd += ["--env", f"PYTHONPATH={os.environ['PYTHONPATH']}"]
    if hostfile is not None:
        cmd += ["--hostfile", str(hostfile)]
    else:
        if ranks is None or ranks < 1:
            raise UsageError(f"ranks={ranks}: give a number of ranks >= 1")
        cmd += ["-n", str(ranks), "--starting-port", str(port or free_ports(ranks))]
    return cmd + ["--", *argv]


def run(argv: list[str], ranks: int | None = None, hostfile=None, timeout: float | None = None,
        out=None, err=None, relay_stdin: bool = False) -> int:
    """Run `python argv...` on the ranks; their output goes to `out` / `err` (default this process's), the
    ring's lost-peer noise left out. Returns 0 when every rank did; else one line on `err` and a non-zero code."""
    out, err = out or sys.stdout, err or sys.stderr
    cmd = command(argv, ranks, hostfile)
    # Its own process group: on a timeout or ^C, the launcher and every rank it started are ended together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.PIPE if relay_stdin else subprocess.DEVNULL, text=True,
                            errors="replace", start_new_session=True)
    failures: list[tuple[int, int]] = []  # (rank, exit code), in the order mlx.launch reported them
    reported = []  # a rank's own one-line "qmtp: error: ..." came through: the summary line would repeat it

    def pump(stream, sink, is_err):
        for line in stream:
            if is_err:
                # mlx.launch's own reports ("[WARN] Node with rank R exited with code C", or "was killed"), kept
                # for the one line at the end; printed from its threads piece by piece, they can land in the
                # middle of a rank's lines
                failures.extend((int(r), int(c)) for r, c in EXITED.findall(line))
                line = LAUNCHER.sub("", line)
                if not line.strip():
                    continue
            if line.startswith(NOISE):
                continue
            if is_err and line.startswith("qmtp: error:"):
                reported.append(line)
            sink.write(line)
            sink.flush()

    threads = [threading.Thread(target=pump, args=(proc.stdout, out, False), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err, True), daemon=True)]
    if relay_stdin:
        threads.append(threading.Thread(target=_relay, args=(proc.stdin,), daemon=True))
    for t in threads:
        t.start()
    started = time.monotonic()
    try:
        while proc.poll() is None:
            if timeout is not None and time.monotonic() - started > timeout:
                _end(proc)
                for t in threads:
                    t.join(5)
                err.write(f"qmtp: error: the {ranks or 'hostfile'} ranks did not finish within {timeout:g} s "
                          f"(a rank hung or is too slow); every rank was stopped\n")
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _end(proc)
        return 130
    for t in threads:
        t.join(5)
    # mlx.launch itself exits 0 when a rank failed: its own report of the rank is what says so
    if proc.returncode or failures:
        if not reported:
            # Every failed rank, not only the first mlx.launch saw: a rank waiting on one that died fails
            # itself ("connection to a peer was lost"), sometimes before the launcher notices the first.
            failed = ", ".join(f"rank {r} exited with code {c}" for r, c in sorted(set(failures)))
            err.write(f"qmtp: error: {failed or f'mlx.launch exited with code {proc.returncode}'}; the other "
                      f"ranks were stopped\n")
        # the status of a rank that exited by itself (its own error), before that of one stopped by a signal
        codes = [c for _, c in sorted(set(failures))]
        own = next((c for c in codes if c > 0), None)
        return own or next((128 - c for c in codes if c < 0), None) or proc.returncode or 1
    return 0


def _relay(pipe) -> None:
    """This process's stdin, line by line, to mlx.launch (which copies it to every rank), then END_OF_INPUT."""
    try:
        for line in sys.stdin.buffer:
            pipe.buffer.write(line)
            pipe.flush()
        pipe.buffer.write(END_OF_INPUT + b"\n")
        pipe.flush()
    except (BrokenPipeError, ValueError, OSError):  # the ranks ended first
        pass


def _end(proc) -> None:
    """End the launcher and its ranks (one process group): politely, then for good after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
