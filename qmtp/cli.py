"""`python -m qmtp COMMAND`: chat, bench (and, as they land, convert and doctor).

Every failure the user can cause (a bad flag, a missing file, a model without a head) ends in one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .errors import QmtpError, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2
        raise UsageError(f"{self.prog}: {message}")


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m qmtp", description="Qwen3.6-35B-A3B and its MTP head on MLX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    chat = commands.add_parser("chat", help="generate text, plainly or with the MTP head drafting")
    chat.add_argument("model", nargs="?", help="checkpoint directory (default: $QMTP_MODEL, else the bundled tiny model)")
    chat.add_argument("--use-mtp", nargs="?", const=True, default=False, type=parse_bool, metavar="BOOL",
                      help="draft with the MTP head (--use-mtp, --use-mtp=true, --use-mtp=false)")
    chat.add_argument("--n-draft", type=int, default=2,
                      help="tokens per trunk pass counting the trunk's own (2 = one head draft); needs --use-mtp")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--prompt", help="generate once for this prompt (default: read prompts from stdin)")
    bench = commands.add_parser("bench", help="benchmarks that print tables and write JSON")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    mtp = benches.add_parser("mtp", help="plain vs MTP decoding for n_draft 1 to 5, interleaved in one run")
    mtp.add_argument("model", nargs="?", help="checkpoint directory (default: $QMTP_MODEL, else the bundled tiny model)")
    mtp.add_argument("--max-tokens", type=int, default=64)
    mtp.add_argument("--repeats", type=int, default=3)
    mtp.add_argument("--prompts-per-register", type=int, default=2)
    mtp.add_argument("--n-draft-max", type=int, default=5)
    mtp.add_argument("--json", type=Path, help="also write the results here")
    return parser


def bench(args) -> int:
    from . import bench as benchmarks
    from .evaluate import heldout_by_register, prompts_from
    from .model import load

    model = load(args.model)
    model.require_head()
    if model.tokenizer is not None:
        texts = heldout_by_register(args.prompts_per_register)
        prompts = [p for docs in texts.values() for p in prompts_from(docs, model)]
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, model.config.vocab_size, 8).tolist() for _ in range(5 * args.prompts_per_register)]
    report = benchmarks.mtp(model, prompts, args.max_tokens, tuple(range(1, args.n_draft_max + 1)), args.repeats)
    print(f"{model.path}: {len(prompts)} prompts x {args.max_tokens} tokens, {args.repeats} interleaved repeats")
    print(benchmarks.mtp_table(report))
    benchmarks.write_json(report, args.json)
    return 0


def chat(args) -> int:
    from .model import load
    from .speculative import generate

    n_draft = args.n_draft if args.use_mtp else 1
    if args.use_mtp and n_draft < 2:
        raise UsageError(f"--n-draft {n_draft} with --use-mtp: drafting needs --n-draft 2 or more")
    model = load(args.model)
    if args.use_mtp:
        model.require_head()
    if model.tokenizer is None:
        raise UsageError(f"{model.path}: no tokenizer.json, so there is no text to chat with")
    prompts = [args.prompt] if args.prompt is not None else _stdin_prompts()
    for prompt in prompts:
        g = generate(model, prompt, max_tokens=args.max_tokens, n_draft=n_draft,
                     temperature=args.temperature, seed=args.seed)
        print(prompt + g.text, flush=True)
        s = g.stats
        line = f"[{s.generated} tokens, {s.tokens_per_second:.1f} tok/s"
        if n_draft > 1:
            per_position = ", ".join(f"{a:.2f}" for a in s.acceptance)
            line += f", acceptance {s.acceptance_rate:.2f} (per position {per_position}), {s.tokens_per_trunk_pass:.2f} tokens per trunk pass"
        print(line + "]", file=sys.stderr, flush=True)
    return 0


def _stdin_prompts():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        line = line.rstrip("\n")
        if line:
            yield line


COMMANDS = {"chat": chat, "bench": bench}


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except QmtpError as err:
        print(f"qmtp: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
