"""The flags several commands share, and the checks of flag values: parsed and refused in one place, before a
command loads anything (loading the real model takes a minute)."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from ..conventions import BITS, is_unquantized
from ..errors import UsageError

MODEL_HELP = "checkpoint directory (default: $QMTP_MODEL, else the bundled tiny model)"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 2 (a UsageError), never usage text."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def n_draft(text: str):
    """--n-draft: a whole number, or "auto" (the width chosen per step), checked as `generate` checks it."""
    from ..options import check_n_draft

    if text != "auto":
        try:
            text = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None
    try:
        return check_n_draft(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("n_draft=")) from None


def positive_int(text: str) -> int:
    """A count that must be 1 or more (repeats, prompts, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def seconds(text: str) -> float:
    """--timeout S: a finite number of seconds above 0 (0, a negative number or nan would end the ranks at once
    or never)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0")
    return value


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
ESCAPE = re.compile(r"\\(?:([ntr\\])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def unescaped(text: str) -> str:
    """--stop TEXT: backslash escapes unescaped, so `--stop "\\n\\n"` (a shell passes backslash-n) stops at a
    blank line: \\n, \\t, \\r, \\\\ (a backslash), \\xHH, \\uHHHH, \\UHHHHHHHH; any other backslash is kept."""
    def one(found) -> str:
        simple, *codes = found.groups()
        if simple:
            return ESCAPES[simple]
        code = int(next(c for c in codes if c), 16)
        if code > 0x10FFFF:
            raise argparse.ArgumentTypeError(f"{found.group(0)} in {text!r} is past the last character, U+10FFFF")
        return chr(code)

    return ESCAPE.sub(one, text)


def json_destination(text: str) -> Path:
    """--json FILE: checked before the run (a benchmark takes minutes), not after it."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name to write the results to")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{str(parent)!r}, the folder of {text!r}, does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{str(parent)!r} is not writable")
    return path


def width(text: str):
    """--mtp-bits and friends: "bf16" (unquantized: bf16, none or 16) or a width MLX quantizes to."""
    if is_unquantized(text) or text == "16":
        return "bf16"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bf16 or a number of bits, got {text!r}") from None
    if value not in BITS:
        raise argparse.ArgumentTypeError(f"{value} bits: choose from {', '.join(map(str, BITS))} (or bf16)")
    return value


def add_model(parser) -> None:
    """The optional MODEL argument of the commands that decode."""
    parser.add_argument("model", nargs="?", help=MODEL_HELP)


def add_rank_options(parser) -> None:
    """--ranks, --hostfile, --timeout: the commands that can spread the experts over ranks (`qmtp.cli.ranks`)."""
    parser.add_argument("--ranks", type=positive_int, default=None, metavar="N",
                        help="spread the routed experts over N ranks on this host (mlx.launch, ring backend, a free port)")
    parser.add_argument("--hostfile", type=Path, default=None, metavar="FILE",
                        help="spread them over the hosts of an mlx.launch hostfile instead")
    parser.add_argument("--timeout", type=seconds, default=None, metavar="S",
                        help="with --ranks or --hostfile: end every rank after S seconds (a rank that hangs)")


def drafting_width(args) -> None:
    """--n-draft against --use-mtp: a width above 1 (or auto) drafts, so it needs the head; left out, it is
    `qmtp.options.DRAFTING_N_DRAFT` with --use-mtp and 1 (plain) without."""
    from ..options import DRAFTING_N_DRAFT

    if args.n_draft not in (None, 1) and not args.use_mtp:
        raise UsageError(f"--n-draft {args.n_draft} drafts with the MTP head, which needs --use-mtp; add --use-mtp "
                         f"(or leave --n-draft out for plain decoding)")
    if args.n_draft is None:
        args.n_draft = DRAFTING_N_DRAFT if args.use_mtp else 1
    if args.use_mtp and args.n_draft == 1:
        raise UsageError(f"--n-draft {args.n_draft} with --use-mtp: drafting needs --n-draft 2 or more, or auto")


def utf8_argument(text: str, flag: str) -> str:
    """`text` as the UTF-8 it was typed in. Python decodes argv with the locale's encoding, the bytes it cannot
    decode kept as lone surrogates (PEP 383): under LC_ALL=C (ASCII) valid UTF-8 arrives that way, and is
    recovered from them here; bytes that are not UTF-8 are refused in one line (the tokenizer would raise)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:  # a surrogate that is no escaped byte: not from argv's bytes
        raise UsageError(f"{flag}: not valid UTF-8 (character {err.start}); give UTF-8 text") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag}: not valid UTF-8 (byte {err.start}); give UTF-8 text") from None
