"""`python -m qmtp COMMAND`: chat, convert, doctor, bench.

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
from pathlib import Path

import numpy as np

from .conventions import BITS, GROUP_SIZES, is_unquantized, parse_width, width_text
from .errors import QmtpError, UsageError, user_path


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


def _n_draft(text: str):
    """--n-draft: a whole number, or "auto" (the width chosen per step)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None


def positive_int(text: str) -> int:
    """A count that must be 1 or more (repeats, prompts, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


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


def _rank_options(parser) -> None:
    parser.add_argument("--ranks", type=positive_int, default=None, metavar="N",
                        help="spread the routed experts over N ranks on this host (mlx.launch, ring backend, a free port)")
    parser.add_argument("--hostfile", type=Path, default=None, metavar="FILE",
                        help="spread them over the hosts of an mlx.launch hostfile instead")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="with --ranks or --hostfile: end every rank after S seconds (a rank that hangs)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m qmtp", description="Qwen3.6-35B-A3B and its MTP head on MLX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    chat = commands.add_parser("chat", help="generate text, plainly or with the MTP head drafting")
    chat.add_argument("model", nargs="?", help="checkpoint directory (default: $QMTP_MODEL, else the bundled tiny model)")
    chat.add_argument("--use-mtp", nargs="?", const=True, default=False, type=parse_bool, metavar="BOOL",
                      help="draft with the MTP head (--use-mtp, --use-mtp=true, --use-mtp=false)")
    chat.add_argument("--n-draft", type=_n_draft, default=None, metavar="N|auto",
                      help="tokens per trunk pass counting the trunk's own (2 = one head draft; auto: chosen per "
                           "step); needs --use-mtp")
    chat.add_argument("--temperature", type=float, default=None,
                      help="0: greedy (default: the model's generation_config.json, else greedy)")
    # The sampler: the model's generation_config.json settings unless these override them
    chat.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    chat.add_argument("--top-p", type=float, default=None, help="keep the most likely tokens up to this mass")
    chat.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the most likely")
    chat.add_argument("--presence-penalty", type=float, default=None, help="per token generated before")
    chat.add_argument("--frequency-penalty", type=float, default=None, help="per time a token was generated")
    chat.add_argument("--repetition-penalty", type=float, default=None,
                      help="on tokens of the prompt and the generated text (1: none)")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--seed", type=int, default=0,
                      help="random seed when sampling (turn n of a conversation, from 0, uses seed + n)")
    chat.add_argument("--prompt", help="generate once for this prompt (default: read prompts from stdin, each line a "
                                       "turn of one conversation; a line /reset starts a new one)")
    chat.add_argument("--raw", action="store_true",
                      help="feed the prompt as plain text, without the chat template (each line on its own)")
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    chat.add_argument("--thinking", nargs="?", const=True, default=None, type=parse_bool, metavar="BOOL",
                      help="--thinking=false asks the template for an answer without thinking (default: the "
                           "template's, on for Qwen)")
    chat.add_argument("--hide-thinking", action="store_true",
                      help="print the answer only (the thinking is otherwise shown on stderr, apart from it)")
    chat.add_argument("--preserve-thinking", action="store_true",
                      help="keep earlier turns' thinking in the conversation (Qwen3.6's preserve_thinking)")
    chat.add_argument("--stop", action="append", metavar="TEXT",
                      help="end the reply where this text appears (repeat for several)")
    _rank_options(chat)
    convert = commands.add_parser("convert", help="quantize a checkpoint into one file holding trunk and MTP head")
    convert.add_argument("src", help="checkpoint directory in a released layout (config.json + safetensors)")
    convert.add_argument("dst", help="directory to write (refused if it exists, unless --force)")
    convert.add_argument("--bits", type=int, default=8, choices=BITS, help="trunk width (default 8)")
    convert.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES, help="quantization group (default 64)")
    convert.add_argument("--mtp-bits", type=_width, default="bf16", metavar="bf16|N",
                         help="MTP head width (default bf16: unquantized)")
    convert.add_argument("--router-bits", type=_width, default=8, metavar="N|bf16",
                         help="router and shared-expert gate width, groups of 64 (default 8)")
    convert.add_argument("--lm-head-bits", type=_width, default=None, metavar="N|bf16",
                         help="lm_head width (default --bits)")
    convert.add_argument("--shards", type=int, default=None, metavar="N", help="write N files and an index")
    convert.add_argument("--force", action="store_true", help="replace DST if it exists")
    convert.add_argument("--allow-incomplete-head", action="store_true",
                         help="convert a head that lacks its routed experts (it drafts far worse)")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    synth = commands.add_parser("synthetic", help="write a random checkpoint in the released layout")
    synth.add_argument("dir", type=Path, help="directory to create (refused if it exists)")
    synth.add_argument("--preset", required=True, choices=("qwen3.6-35b-a3b", "qwen3.6-35b-a3b-reduced"),
                       help="qwen3.6-35b-a3b: the release's names, shapes, dtypes and 26 shards; -reduced: "
                            "the same widths with 4 layers and 16 experts")
    synth.add_argument("--sparse", action="store_true",
                       help="routed experts and other big tensors as holes (zeros, no disk); small ones seeded")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--quiet", action="store_true", help="no progress bar")
    doctor = commands.add_parser("doctor", help="check the MLX backend and, given a model, the checkpoint")
    doctor.add_argument("model", nargs="?", help="checkpoint directory to check (default: the backend only)")
    doctor.add_argument("--scan", action="store_true", help="also read every tensor and look for NaN/Inf")
    bench = commands.add_parser("bench", help="benchmarks that print tables and write JSON")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    mtp = benches.add_parser("mtp", help="plain vs MTP decoding for n_draft 1 to 5, interleaved in one run")
    mtp.add_argument("model", nargs="?", help="checkpoint directory (default: $QMTP_MODEL, else the bundled tiny model)")
    mtp.add_argument("--max-tokens", type=positive_int, default=64)
    mtp.add_argument("--repeats", type=positive_int, default=3)
    mtp.add_argument("--prompts-per-register", type=positive_int, default=2)
    mtp.add_argument("--prompts", type=positive_int, help="only the first N prompts (a full-size model: 1)")
    mtp.add_argument("--n-draft-max", type=positive_int, default=5)
    mtp.add_argument("--json", type=json_destination, help="also write the results here")
    _rank_options(mtp)
    mtp.add_argument("--peer", choices=("mlx-vlm",), help="also run this engine's own MTP decoding on the same checkpoint")
    mtp.add_argument("--ablate", type=positive_int, nargs="+", default=(), metavar="N",
                     help="also run the loop at these n_drafts without queueing ahead, and eagerly: what each buys")
    decode = benches.add_parser("decode", help="plain greedy decoding, qmtp against mlx-lm, interleaved in one run")
    decode.add_argument("model", nargs="?", help="checkpoint directory (default: $QMTP_MODEL, else the bundled tiny model)")
    decode.add_argument("--scaled", type=Path, metavar="DIR",
                        help="instead of MODEL: a synthetic model of the real layer widths (4 layers, 64 experts, "
                             "4-bit), written to DIR on first use")
    decode.add_argument("--max-tokens", type=positive_int, help="tokens per prompt (default 64; 16 with --scaled)")
    decode.add_argument("--repeats", type=positive_int, help="interleaved rounds (default 5; 3 with --scaled)")
    decode.add_argument("--prompts", type=positive_int, help="how many prompts (default 5, one per register; 2 with --scaled)")
    decode.add_argument("--json", type=json_destination, help="also write the results here")
    _rank_options(decode)
    conv = benches.add_parser("convert", help="qmtp convert against mlx_lm.convert and cp on a synthetic checkpoint")
    conv.add_argument("--workdir", type=Path, metavar="DIR",
                      help="keep the synthetic source here and reuse it (default: a temporary folder, removed)")
    conv.add_argument("--gb", type=float, default=4.0, help="size of the bf16 source, at least (default 4)")
    conv.add_argument("--preset", choices=("qwen3.6-35b-a3b", "qwen3.6-35b-a3b-reduced"),
                      help="instead of --gb: this synthetic preset, experts sparse (full size: 71 GB apparent)")
    conv.add_argument("--bits", type=int, default=4, choices=BITS, help="trunk width (default 4)")
    conv.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES)
    conv.add_argument("--rounds", type=int, default=2, help="rounds of the three commands (default 2)")
    conv.add_argument("--json", type=json_destination, help="also write the results here")
    return parser


def _width(text: str):
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


def convert(args) -> int:
    from .convert import convert as run

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning about the source, even one seen before in this process
        result = run(args.src, args.dst, bits=args.bits, group_size=args.group_size, mtp_bits=args.mtp_bits,
                     router_bits=args.router_bits, lm_head_bits=args.lm_head_bits, shards=args.shards,
                     force=args.force, allow_incomplete_head=args.allow_incomplete_head, progress=not args.quiet)
    head = width_text(parse_width(args.mtp_bits, "mtp_bits"))
    print(f"wrote {result} [trunk {args.bits}-bit, group {args.group_size}, head {head}, fixes {', '.join(result.fixes)}]")
    return 0


def _warn_line(message, category, filename, lineno, file=None, line=None):
    print(f"qmtp: warning: {one_line(str(message))}", file=sys.stderr, flush=True)


def doctor(args) -> int:
    import mlx.core as mx

    from . import __version__
    from .quant import check_backend, report

    print(f"qmtp {__version__}, mlx {mx.__version__}, default device {mx.default_device()}")
    checks = check_backend()
    print(report(checks))
    problems = []
    bad = [c.bits for c in checks if not c.ok]
    if bad:
        problems.append(f"the installed MLX computes quantized matmul wrongly at {', '.join(map(str, bad))} bits")
    if args.model is not None:
        problems += _doctor_model(user_path(args.model, "model directory"), args.scan)
    if problems:
        raise QmtpError("; ".join(problems))
    return 0


def _doctor_model(path: Path, scan: bool) -> list[str]:
    """Print what the checkpoint at `path` holds; return its problems (empty: complete and finite)."""
    from . import fixes as fixes_mod
    from . import layout
    from .source import HEAD_FULL, HEAD_MISSING, HEAD_NOT_DECLARED, Source

    if not path.exists():
        raise UsageError(f"{path}: no such model directory")
    source = Source.open(path)
    config, ckpt = source.config, source.ckpt
    print(f"\n{ckpt!r}")
    plan, widths = source.plan, source.widths
    problems = []

    expected = layout.expected_shapes(config, head=False)
    missing = source.missing_trunk()
    undeclared = source.undeclared()
    print(f"trunk: {len(expected) - len(missing)} of {len(expected)} tensors"
          + (f", MISSING {missing[0]} and {len(missing) - 1} more" if missing else ", complete")
          + (f"; MORE LAYERS STORED THAN config.json DECLARES ({len(plan.beyond)} tensors, e.g. {plan.beyond[0]})"
             if undeclared else ""))
    if missing:
        problems.append(f"{path}: trunk tensor {missing[0]} is missing ({len(missing)} in all)")
    if undeclared:
        problems.append(undeclared)
    try:
        status = source.head_status()
    except QmtpError as err:
        print(f"MTP head: INCOMPLETE ({err})")
        problems.append(str(err))
    else:
        if status == HEAD_NOT_DECLARED:
            print("MTP head: none declared in config.json")
        elif status == HEAD_MISSING:
            print("MTP head: MISSING (config.json declares one, no mtp.* tensors are stored)")
            problems.append(f"{path}: no MTP head tensors (mtp.*), though config.json declares a head")
        elif status == HEAD_FULL:
            print("MTP head: complete, with its routed experts")
        else:
            print("MTP head: INCOMPLETE, no routed experts (it would draft with its shared expert alone)")
            problems.append(f"{path}: the MTP head has no routed experts (mtp.layers.0.mlp.experts.*)")
    from .tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.check_dir(path, config.vocab_size)
    except QmtpError as err:
        print(f"tokenizer: UNUSABLE ({err})")
        problems.append(str(err))
    else:
        print(f"tokenizer: {tokenizer.vocab_size} ids" if tokenizer else "tokenizer: none (chat needs tokenizer.json)")
        if tokenizer is not None:
            problems += _doctor_template(tokenizer)
    if plan.unknown or plan.skipped:
        print(f"not used: {len(plan.unknown)} unmapped tensors, {len(plan.skipped)} vision tensors")

    # One NaN in a norm, A_log, dt_bias, conv kernel or router changes every token (and a norm's would make the
    # fixes record look contradicted): these few MB are always read, every tensor only with --scan.
    small = source.nonfinite_small()
    print(f"small tensors (norms, A_log, dt_bias, conv kernels, routers): {len(source.small_critical())} read, "
          + (f"{len(small)} with NaN/Inf: {', '.join(small[:5])}" if small else "all finite"))
    if small:
        problems.append(str(source.nonfinite_error(small[0], f"{len(small)} small tensors in all" if len(small) > 1
                                                   else "")))
    recorded, carried = source.recorded, source.carried
    try:
        source.check_carried()
    except QmtpError as err:
        print(f"fixes: RECORD AND TENSORS DISAGREE ({err})")
        problems.append(str(err))
    origin = "recorded in the file" if recorded is not None else "inferred from the conv layout (no record)"
    print(f"fixes in the weights: {', '.join(carried) or 'none'} ({origin}); qmtp.load applies: "
          f"{', '.join(fixes_mod.still_needed(carried, source.has_conv)) or 'nothing'}")
    if widths:
        counts: dict = {}
        for bits, group in widths.values():
            counts[(bits, group)] = counts.get((bits, group), 0) + 1
        text = ", ".join(f"{n} at {b}-bit/{g}" for (b, g), n in sorted(counts.items()))
        print(f"quantized weights: {text}")
    else:
        print("quantized weights: none")
    if "qmtp.source_digest" in ckpt.metadata:
        print(f"converted by qmtp {ckpt.metadata.get('qmtp.version', '?')} from source "
              f"{ckpt.metadata['qmtp.source_digest'][:16]}...")

    if scan:
        bad = _scan(ckpt)
        print(f"scan: {len(ckpt)} tensors read, " + (f"{len(bad)} with NaN/Inf: {', '.join(bad[:5])}" if bad else "all finite"))
        if bad:
            problems.append(f"{path}: {len(bad)} tensors hold NaN or Inf (first: {bad[0]})")
    source.check_unchanged()  # what was reported is one checkpoint, not two conversions mixed
    return problems


def _doctor_template(tokenizer) -> list[str]:
    """Say whether the model has a chat template and whether it compiles; return its problem, if any."""
    from .chat import compile_template

    if tokenizer.chat_template is None:
        print("chat template: none (chat needs --raw; generate takes text or ids, not messages)")
        return []
    try:
        compile_template(tokenizer.chat_template)
    except QmtpError as err:
        print(f"chat template: BROKEN ({err})")
        return [f"{tokenizer.source}: {err}"]
    print(f"chat template: {len(tokenizer.chat_template)} characters, compiles")
    return []


def _scan(ckpt) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an Inf, reading one tensor at a time."""
    import mlx.core as mx

    from tqdm import tqdm

    bad = []
    for name in tqdm(ckpt.names(), desc="scan", unit="tensor", leave=False, disable=None):  # bar on a terminal only
        w = ckpt.load(name)
        if mx.issubdtype(w.dtype, mx.floating) and not mx.all(mx.isfinite(w)).item():
            bad.append(name)
    return bad


def bench(args) -> int:
    from .book import bench as benchmarks
    from .loading import load

    if args.bench == "convert":
        from .book import bench_convert

        _require_mlx_lm("bench convert")
        report = bench_convert.run(args.workdir, args.gb, args.bits, args.group_size, args.rounds,
                                   progress=lambda line: print(line, flush=True), preset=args.preset)
        print(bench_convert.table(report))
        benchmarks.write_json(report, args.json)
        return 0
    if args.bench == "decode":
        scaled = args.scaled is not None
        if scaled and args.model is not None:
            raise UsageError("bench decode: give MODEL or --scaled DIR, not both")
        _require_mlx_lm("bench decode")
        if scaled:  # about a third of a second per token on a small CPU: fewer, shorter runs by default
            print(f"synthetic model of the real layer widths in {args.scaled} (written on first use) ...", flush=True)
            args.model = benchmarks.scaled_checkpoint(args.scaled)
        args.max_tokens = args.max_tokens or (16 if scaled else 64)
        args.repeats = args.repeats or (3 if scaled else 5)
    if args.bench == "mtp" and args.peer and (args.ranks or args.hostfile):
        raise UsageError("bench mtp --peer runs mlx-vlm on the whole model: not with --ranks or --hostfile")
    if _ranked(args):
        return _start_ranks(args)
    group = _rank_group()
    if group is not None and group.rank():  # only rank 0 prints and writes the JSON
        sys.stdout = open(os.devnull, "w")
        args.json = None
    model = load(args.model, group=group)
    if args.bench == "mtp":
        from .speculative import MAX_N_DRAFT

        if args.n_draft_max > MAX_N_DRAFT:
            raise UsageError(f"--n-draft-max {args.n_draft_max} is out of range: use 1 to {MAX_N_DRAFT}")
        model.require_head()
        prompts = _bench_prompts(model, args.prompts, per_register=args.prompts_per_register)
    else:
        prompts = _bench_prompts(model, args.prompts or (2 if scaled else 5))
    if args.bench == "decode":
        report = benchmarks.decode(model, prompts, args.max_tokens, args.repeats)
        print(f"{model.path}: {len(prompts)} prompts x {args.max_tokens} tokens, {args.repeats} interleaved rounds, "
              f"{report['dtype']}")
        print(benchmarks.decode_table(report))
    else:
        peer = _peer_engine(model.path) if args.peer else None
        report = benchmarks.mtp(model, prompts, args.max_tokens, tuple(range(1, args.n_draft_max + 1)), args.repeats,
                                peer=peer, ablate=tuple(args.ablate))
        print(f"{model.path}: {len(prompts)} prompts x {args.max_tokens} tokens, {args.repeats} interleaved repeats")
        print(benchmarks.mtp_table(report))
    benchmarks.write_json(report, args.json)
    return 0


def _peer_engine(path):
    """mlx-vlm on the same checkpoint, or None with one line saying why not (the bench goes on without it)."""
    from .book import peer

    reason = peer.available()
    if reason:
        print(f"--peer mlx-vlm: skipped, {reason}", flush=True)
        return None
    return peer.MlxVlmEngine(path)


def _bench_prompts(model, n_prompts: int | None, per_register: int = 1) -> list[list[int]]:
    """The first `n_prompts` (default: `per_register` of each register) held-out text prompts when the model has
    a tokenizer, else as many random token ids (fixed seed)."""
    from .book.evaluate import heldout_prompts
    from .tiny.corpus import REGISTERS

    if n_prompts is not None:
        per_register = -(-n_prompts // len(REGISTERS))
    count = n_prompts or per_register * len(REGISTERS)
    if model.tokenizer is not None:
        return heldout_prompts(model, per_register)[:count]
    rng = np.random.default_rng(0)
    return [rng.integers(0, model.config.vocab_size, 8).tolist() for _ in range(count)]


def _require_mlx_lm(what: str) -> None:
    import importlib.util

    if importlib.util.find_spec("mlx_lm") is None:
        raise UsageError(f"{what} compares with mlx-lm, which is not installed (pip install mlx-lm)")


def _check_n_draft(args, most: int) -> None:
    if args.n_draft is not None and args.n_draft > 1 and not args.use_mtp:
        raise UsageError(f"--n-draft {args.n_draft} drafts with the MTP head, which needs --use-mtp; add --use-mtp "
                         f"(or leave --n-draft out for plain decoding)")
    if args.n_draft is None:
        args.n_draft = 2 if args.use_mtp else 1
    if not 1 <= args.n_draft <= most:
        raise UsageError(f"--n-draft {args.n_draft} is out of range: use 1 (plain decoding) to {most}, or auto")
    if args.use_mtp and args.n_draft < 2:
        raise UsageError(f"--n-draft {args.n_draft} with --use-mtp: drafting needs --n-draft 2 or more")


def _ranked(args) -> bool:
    """True in this process when it is to start ranks rather than be one: --ranks N > 1 or --hostfile, and not
    already started by `qmtp.launch`."""
    from . import launch

    return (args.hostfile is not None or (args.ranks or 1) > 1) and not os.environ.get(launch.RANKS_ENV)


def _start_ranks(args) -> int:
    from . import launch

    if args.hostfile is not None and args.ranks is not None:
        raise UsageError("give --ranks N (this host) or --hostfile FILE (its hosts), not both")
    if args.hostfile is not None and not args.hostfile.is_file():
        raise UsageError(f"--hostfile {args.hostfile}: no such file")
    return launch.run(["-m", "qmtp", *args.argv], args.ranks, args.hostfile, args.timeout,
                      relay_stdin=getattr(args, "prompt", "") is None)


def _rank_group():
    """The distributed group of this rank when `qmtp.launch` started it, else None (one process)."""
    from . import launch

    if not os.environ.get(launch.RANKS_ENV):
        return None
    import mlx.core as mx

    return mx.distributed.init(strict=True)


def _shared_prompts(group, prompts):
    """Rank 0's prompts (from `prompts`, its stdin) on every rank: each rank runs every generation together."""
    import mlx.core as mx

    from . import parallel

    source = iter(prompts) if group.rank() == 0 else None
    while True:
        line = next(source, None) if source is not None else None
        data = line.encode("utf-8") if line is not None else b""
        length = int(parallel.broadcast([len(data) if line is not None else -1], group)[0])
        if length < 0:
            return
        sent = mx.array(list(data) if group.rank() == 0 else [0] * length, dtype=mx.int32)
        yield bytes(mx.distributed.all_sum(sent, group=group).tolist()).decode("utf-8")


def _check_chat_flags(args) -> None:
    """The template's flags make no sense with --raw; text flags must be UTF-8 and stop strings non-empty."""
    if args.raw:
        used = [flag for flag, on in (("--system", args.system is not None), ("--thinking", args.thinking is not None),
                                      ("--hide-thinking", args.hide_thinking),
                                      ("--preserve-thinking", args.preserve_thinking)) if on]
        if used:
            raise UsageError(f"{used[0]} shapes the chat template's conversation, which --raw leaves out; drop one of "
                             f"them")
    if args.system is not None:
        _utf8_argument(args.system, "--system")
    for stop in args.stop or ():
        if not stop:
            raise UsageError("--stop: give non-empty text to stop at")
        _utf8_argument(stop, "--stop")


def _describe_sampling(settings) -> str:
    """The settings that differ from greedy decoding without penalties, as name=value."""
    from dataclasses import fields

    from .sampling import Sampling

    default = Sampling()
    return ", ".join(f"{f.name}={getattr(settings, f.name):g}" for f in fields(settings)
                     if getattr(settings, f.name) != getattr(default, f.name))


def chat(args) -> int:
    from . import chat as chat_mod
    from .conversation import Conversation
    from .loading import load
    from .sampling import Sampling
    from .sampling import resolve as resolve_sampling
    from .speculative import MAX_N_DRAFT, generate

    # Flags and prompt first: loading the real model takes a minute, and its warnings should not come first.
    if args.n_draft == "auto":
        if not args.use_mtp:
            raise UsageError("--n-draft auto drafts with the MTP head, which needs --use-mtp")
    else:
        _check_n_draft(args, MAX_N_DRAFT)
    if args.prompt is not None and not args.prompt:
        raise UsageError("the prompt is empty: give at least one token of text")
    if args.seed >= 2**64:  # MLX's random key takes 64 bits (a negative seed: generate says so)
        raise UsageError(f"--seed {args.seed}: give a whole number below 2**64")
    _check_chat_flags(args)
    flags = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                 repetition_penalty=args.repetition_penalty)
    Sampling(**{k: v for k, v in flags.items() if v is not None})  # a bad flag is refused before the load
    n_draft = args.n_draft if args.use_mtp else 1
    if _ranked(args):
        return _start_ranks(args)
    group = _rank_group()
    if group is not None and group.rank():  # only rank 0 prints (text, thinking, statistics); every rank computes
        sys.stdout = sys.stderr = open(os.devnull, "w")  # every token; main() still reports this rank's errors
    model = load(args.model, group=group)
    if args.use_mtp:
        model.require_head()
    if model.tokenizer is None:
        raise UsageError(f"{model.path}: no tokenizer.json, so there is no text to chat with")
    if not args.raw and model.tokenizer.chat_template is None:
        raise UsageError(f"{model.path}: the model has no chat template (no chat_template.jinja, no chat_template in "
                         f"tokenizer_config.json); add --raw to feed the prompt as plain text")
    ends = chat_mod.end_ids(model)
    stops = tuple(args.stop or ())
    sampling = resolve_sampling(model, "model", **flags)
    prompts = [_utf8_argument(args.prompt, "--prompt")] if args.prompt is not None else _stdin_prompts()
    if group is not None and args.prompt is None:  # rank 0 reads them, every rank runs each turn
        prompts = _shared_prompts(group, prompts)
    settings = dict(max_tokens=args.max_tokens, n_draft=n_draft, sampling=sampling, seed=args.seed,
                    stop=stops or None)
    if args.raw:
        for prompt in prompts:
            print(prompt, end="", flush=True)
            text = TextStream(model.tokenizer, ends, stops)
            g = _streamed(lambda: generate(model, prompt, on_tokens=text.add, **settings))
            text.finish(g.text)
            _report(g, n_draft, sampling)
        return 0
    # The conversation: each turn renders the whole history (its earlier thinking dropped or kept by the template)
    # and prefills only what differs from the decoding state the last turn left
    conversation = Conversation(model, args.system, enable_thinking=args.thinking,
                                chat_template_kwargs={"preserve_thinking": True} if args.preserve_thinking else None,
                                **settings)
    for prompt in prompts:
        if prompt.strip() == "/reset" and args.prompt is None:
            conversation.reset()
            print("[a new conversation]", file=sys.stderr, flush=True)
            continue
        opened = chat_mod.opens_thinking(conversation.next_prompt(prompt))
        stream = ChatStream(model.tokenizer, ends, stops, opened, args.hide_thinking)
        g = _streamed(lambda: conversation.send(prompt, on_tokens=stream.add))
        stream.finish(g.text)
        _report(g, n_draft, sampling)
    return 0


def _streamed(run):
    """`run()`; damaged weights stop it mid-text: then the line streamed so far is ended before the error."""
    try:
        return run()
    except QmtpError:
        print(flush=True)
        raise


def _report(g, n_draft, sampling) -> None:
    """The generation's statistics, and the sampling settings that are not greedy's, one line on stderr."""
    from .sampling import Sampling

    s = g.stats
    kept = s.prompt_tokens - s.prefilled_tokens  # held by the decoding state the last turn left
    line = (f"[{s.generated} tokens, {s.tokens_per_second:.1f} tok/s, "
            + (f"{kept} tokens kept from the last turn, " if kept else "") + f"after a prompt of {s.prompt_tokens}")
    if n_draft != 1:
        # a position never proposed (every earlier draft rejected) has no rate: say so, not "nan"
        per_position = ", ".join("never reached" if d == 0 else f"{a:.2f}" for a, d in zip(s.acceptance, s.drafted))
        line += f", acceptance {s.acceptance_rate:.2f} (per position {per_position}), {s.tokens_per_trunk_pass:.2f} tokens per trunk pass"
        if s.nonfinite_drafts:  # rejected or not, the tokens are the trunk's: say why drafting fails
            line += (f", {s.nonfinite_drafts} drafts from NaN/Inf head logits (the MTP head's weights are "
                     f"damaged: `python -m qmtp doctor MODEL --scan`)")
    if sampling != Sampling():  # from generation_config.json, or the flags: say which were used
        line += f", sampling {_describe_sampling(sampling)}"
    print(line + "]", file=sys.stderr, flush=True)


def _held_back(text: str, stops) -> str:
    """`text` as far as it can be shown before the generation ends: cut at a stop string, and without an end
    that may be the start of one (the next step may complete it)."""
    from .speculative import _find_stop

    cut = _find_stop(text, tuple(stops)) if stops else -1
    if cut >= 0:
        return text[:cut]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


def _print_delta(shown: str, text: str, file) -> None:
    """Print what `text` adds to `shown`; if decoding changed what was shown (rare), the rest from where the two part."""
    common = len(shown) if text.startswith(shown) else len(os.path.commonprefix([text, shown]))
    print(text[common:], end="", file=file, flush=True)


class TextStream:
    """Prints a generation's text as its tokens arrive (a step of the real model can take seconds). Text is
    decoded from all tokens so far, since a character can span tokens; an incomplete one (decoded as U+FFFD)
    waits for the next step, and so does an end that may be the start of a stop string."""

    def __init__(self, tokenizer, ends=None, stops=()):
        self.tokenizer, self.tokens, self.shown = tokenizer, [], ""
        self.ends = frozenset(ends) if ends is not None else tokenizer.end_ids
        self.stops = tuple(stops)

    def add(self, tokens: list[int]) -> None:
        self.tokens.extend(t for t in tokens if t not in self.ends)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return
        self._show(_held_back(text, self.stops))

    def finish(self, text: str) -> None:
        self._show(text)
        print(flush=True)

    def _show(self, text: str) -> None:
        _print_delta(self.shown, text, sys.stdout)
        self.shown = text


class ChatStream(TextStream):
    """Prints a reply as its tokens arrive, the thinking apart from the answer: the thinking on stderr between
    lines `[thinking]` and `[/thinking]` (or not at all, `hide`), the answer on stdout. `opened`: the prompt left
    the reply inside a think block (thinking on); a reply may also open one itself."""

    def __init__(self, tokenizer, ends, stops, opened: bool, hide: bool = False):
        super().__init__(tokenizer, ends, stops)
        self.opened, self.hide = opened, hide
        self.thinking, self.state = "", "before"  # state: before, thinking (its block open), after

    def _show(self, text: str, final: bool = False) -> None:
        from .chat import END_THINK, THINK, split_thinking

        if not final and not self.opened and THINK.startswith(text.lstrip()):
            return  # the reply may be opening a think block itself: wait and see
        thinks = self.opened or text.lstrip().startswith(THINK)
        done = END_THINK in text or not thinks
        if not done and not final:  # an end that may be the start of </think> waits for the next step
            text = _held_back(text, (END_THINK,))
        thinking, answer = split_thinking(text, self.opened)
        if thinks and not self.hide and (thinking or done) and self.state == "before":
            print("[thinking]", file=sys.stderr, flush=True)
            self.state = "thinking"
        if self.state == "thinking":
            _print_delta(self.thinking, thinking, sys.stderr)
            if done or final:
                print("\n[/thinking]", file=sys.stderr, flush=True)
                self.state = "after"
        self.thinking = thinking
        _print_delta(self.shown, answer, sys.stdout)
        self.shown = answer

    def finish(self, text: str) -> tuple[str, str]:
        """Show the rest of the reply (`text`, the generation's); return its (thinking, answer)."""
        from .chat import split_thinking

        self._show(text, final=True)
        print(flush=True)
        return split_thinking(text, self.opened)


def _utf8_argument(text: str, flag: str) -> str:
    """Undecodable bytes in argv arrive as lone surrogates (PEP 383), which the tokenizer refuses with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UsageError(f"{flag}: not valid UTF-8 (byte {err.start}); give UTF-8 text") from None
    return text


def _stdin_prompts():
    from .launch import END_OF_INPUT, RANKS_ENV

    interactive = sys.stdin.isatty()
    relayed = bool(os.environ.get(RANKS_ENV))  # a rank's stdin, relayed by mlx.launch, never ends by itself
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline()
        if not raw or (relayed and raw.rstrip(b"\r\n") == END_OF_INPUT):
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UsageError(f"stdin: a prompt line is not valid UTF-8 ({err.reason} at byte {err.start}); give "
                             f"UTF-8 text") from None
        line = line.rstrip("\n")
        line = line[:-1] if line.endswith("\r") else line  # a line ended by \r\n (Windows, a network tool)
        if line:
            yield line


@contextlib.contextmanager
def _one_line_warnings():
    """Show each Python warning as one line, "qmtp: warning: ...", not as file:line plus a line of source."""
    with warnings.catch_warnings():
        warnings.showwarning = _warn_line
        yield


def synthetic(args) -> int:
    from .tiny.synthetic import write_preset

    path = write_preset(args.dir, args.preset, sparse=args.sparse, seed=args.seed, progress=not args.quiet)
    files = sorted(path.glob("*.safetensors"))
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    print(f"wrote {path}: {args.preset}, {len(files)} safetensors files, {apparent / 1e9:.1f} GB "
          f"({on_disk / 1e9:.2f} GB on disk)")
    return 0


COMMANDS = {"chat": chat, "convert": convert, "doctor": doctor, "bench": bench, "synthetic": synthetic}


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


def main(argv=None) -> int:
    import threading

    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _raise_terminated)
    # Text the terminal's encoding cannot show (PYTHONIOENCODING=ascii, a C locale) is escaped, not fatal
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what a rank started by --ranks runs again
        with _one_line_warnings():
            return COMMANDS[args.command](args)
    except QmtpError as err:
        from .parallel import DistributedError

        rank = int(os.environ.get("MLX_RANK", 0) or 0)
        if not (rank and isinstance(err, DistributedError)):  # every rank raises it alike: rank 0 says it
            print(f"qmtp: error: {'' if not rank else f'rank {rank}: '}{one_line(str(err))}",
                  file=sys.__stderr__ if rank else sys.stderr)  # a rank past 0 silenced its stderr
        return 2
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except RuntimeError as err:
        from .launch import RANKS_ENV

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
