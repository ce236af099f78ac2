"""A rank's own watchdog: a small process beside a rank that ends it when its launcher is gone or its time is up.

`qmtp.launch.run` can end the ranks on its own host (one process group), but not those `mlx.launch` started on
other hosts over ssh, nor one that no signal handler can reach: a rank stopped (SIGSTOP) or waiting inside a
collective does not run Python code, so SIGTERM stays pending there. Each rank therefore starts this file as its
own process (`qmtp.launch.watch_this_rank`), which needs nothing but the standard library (it starts in
milliseconds, without MLX or qmtp), and which

- ends the rank with SIGKILL as soon as the rank's parent (the launcher, or the ssh session that started it on
  another host) is gone: no one is left to read its output or to stop it;
- at the deadline, sends the rank SIGTERM (its own cleanup runs if it can), then SIGKILL after a grace period;
- exits by itself when the rank exits (the watchdog's parent changes).

Run as `python watchdog.py RANK_PID PARENT_PID SECONDS GRACE` (SECONDS 0: no deadline).
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number: ours is gone
        return False
    return True


def parent_of(pid: int) -> int | None:
    """`pid`'s parent from /proc (Linux), else None: then only whether the parent's number is alive is known."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])  # the name, in parentheses, may hold spaces


def launcher_gone(rank: int, launcher: int) -> bool:
    """The rank's parent has exited: on Linux the rank was handed to another parent; elsewhere its number is free."""
    parent = parent_of(rank)
    return parent != launcher if parent is not None else not alive(launcher)


def watch(rank: int, launcher: int, seconds: float, grace: float) -> None:
    deadline = time.monotonic() + seconds if seconds > 0 else None
    while os.getppid() == rank:  # the rank exited: this process was handed to another parent
        if launcher_gone(rank, launcher):
            os.kill(rank, signal.SIGKILL)
            return
        if deadline is not None and time.monotonic() > deadline:
            os.kill(rank, signal.SIGTERM)
            stop = time.monotonic() + grace
            while os.getppid() == rank and time.monotonic() < stop:
                time.sleep(POLL_S)
            if os.getppid() == rank:
                os.kill(rank, signal.SIGKILL)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C meant for the rank is the rank's to handle
    try:
        watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
    except ProcessLookupError:  # the rank ended between the check and the signal
        pass
