"""`python -m qmtp serve`, `bench batch` and `bench serve`: commands whose parsers live with their code.

The server (`qmtp.serve.main`) and the two benchmarks (`qmtp.book.bench_batch`, `qmtp.book.bench_serve`) parse
their own flags; the command line lists them and hands them the rest of the arguments unchanged, so their
`--help` is theirs.
"""

from __future__ import annotations

import argparse
import importlib

# the words that name a forwarded command -> the module whose main(argv) runs it
FORWARDED = {("serve",): "qmtp.serve.main", ("bench", "batch"): "qmtp.book.bench_batch",
             ("bench", "serve"): "qmtp.book.bench_serve"}


def register(commands) -> None:
    serve = commands.add_parser("serve", add_help=False, help="the model behind an OpenAI-compatible server "
                                "(python -m qmtp serve --help)")
    serve.add_argument("rest", nargs=argparse.REMAINDER)
    serve.set_defaults(run=run)


def forwarded(argv: list[str]) -> str | None:
    """The module that runs `argv`, if its first words name a forwarded command."""
    for words, module in FORWARDED.items():
        if tuple(argv[: len(words)]) == words:
            return module
    return None


def forward(argv: list[str]) -> int:
    module = forwarded(argv)
    words = next(w for w, m in FORWARDED.items() if m == module)
    return importlib.import_module(module).main(argv[len(words):])


def run(args) -> int:
    """What `serve` runs once parsed (main forwards it before parsing; this is for a caller of build_parser)."""
    return forward(["serve", *args.rest])
