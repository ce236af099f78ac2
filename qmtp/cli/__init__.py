"""`python -m qmtp COMMAND`: chat, convert, synthetic, doctor, bench, serve.

One module per command, each with `register(commands)` (its parser, `set_defaults(run=...)`) and `run(args)`;
the flags several commands share are parsed in `options`. A new command is one module and one line in COMMANDS.
Every failure the user can cause (a bad flag, a missing file, a model without a head) ends in one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings

from ..errors import QmtpError
from . import bench, chat, convert, doctor, serve, synthetic
from .options import Parser, json_destination, parse_bool, positive_int
from .streams import ChatStream, TextStream

# In the order `python -m qmtp --help` lists them
COMMANDS = (chat, convert, synthetic, doctor, bench, serve)

__all__ = ["COMMANDS", "ChatStream", "Parser", "TextStream", "build_parser", "json_destination", "main", "one_line",
           "parse_bool", "positive_int"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m qmtp", description="Qwen3.6-35B-A3B and its MTP head on MLX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(commands)
    return parser


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C's KeyboardInterrupt, so the same cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def one_line(text: str) -> str:
    """A message on one line whatever it quotes: a path with a newline in it keeps the newline escaped."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _warn_line(message, category, filename, lineno, file=None, line=None):
    print(f"qmtp: warning: {one_line(str(message))}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _one_line_warnings():
    """Show each Python warning as one line, "qmtp: warning: ...", not as file:line plus a line of source."""
    with warnings.catch_warnings():
        warnings.showwarning = _warn_line
        yield


def main(argv=None) -> int:
    import threading

    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _raise_terminated)
    # Text the terminal's encoding cannot show (PYTHONIOENCODING=ascii, a C locale) is escaped, not fatal; in a
    # C locale Python's stdout escapes surrogates only, and the text printed here holds none, but other characters
    if getattr(sys.stdout, "errors", None) in ("strict", "surrogateescape") and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        if serve.forwarded(words):  # a server or benchmark that parses its own flags
            return serve.forward(words)
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what a rank started by --ranks runs again
        with _one_line_warnings():
            return args.run(args)
    except QmtpError as err:
        from ..parallel import DistributedError

        rank = int(os.environ.get("MLX_RANK", 0) or 0)
        if not (rank and isinstance(err, DistributedError)):  # every rank raises it alike: rank 0 says it
            print(f"qmtp: error: {'' if not rank else f'rank {rank}: '}{one_line(str(err))}",
                  file=sys.__stderr__ if rank else sys.stderr)  # a rank past 0 silenced its stderr
        return 2
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except RuntimeError as err:
        from ..launch import RANKS_ENV

        # A rank whose peer died learns it in its next collective: quietly, since the launcher's one line names
        # every rank that failed, and the one that died first has said why
        if os.environ.get(RANKS_ENV) and "[ring]" in str(err):
            return 1
        raise
    except OSError as err:  # a file the checks above could not foresee (permissions changed, a disk error)
        where = f"{err.filename}: " if err.filename else ""
        print(f"qmtp: error: {one_line(where + (err.strerror or str(err)))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated as stop:
        return 128 + stop.signum


def _quiet_broken_pipe() -> int:
    """The reader went away (`| head -1`): stop quietly, as a shell tool does, with 128 + SIGPIPE; stdout now
    points at /dev/null so Python's flush at exit does not complain about the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141
