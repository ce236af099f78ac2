"""`python -m qmtp bench mtp|decode|convert`: benchmarks that print tables and write JSON (`qmtp.book.bench`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from ..conventions import BITS, GROUP_SIZES
from ..errors import UsageError
from . import options, ranks
from .synthetic import PRESETS


def register(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print tables and write JSON")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=options.Parser)
    _register_mtp(benches)
    _register_decode(benches)
    _register_convert(benches)
    # run by their own modules (qmtp.cli.serve.FORWARDED): listed here for --help
    benches.add_parser("batch", add_help=False, help="batched decoding, rows x n_draft, against single runs and "
                       "mlx-lm (python -m qmtp bench batch --help)")
    benches.add_parser("serve", add_help=False, help="qmtp serve under 1..N clients, drafting on and off, against "
                       "mlx_lm.server (python -m qmtp bench serve --help)")
    bench.set_defaults(run=run)


def _register_mtp(benches) -> None:
    mtp = benches.add_parser("mtp", help="plain vs MTP decoding for n_draft 1 to 5, interleaved in one run")
    options.add_model(mtp)
    mtp.add_argument("--max-tokens", type=options.positive_int, default=64)
    mtp.add_argument("--repeats", type=options.positive_int, default=3)
    mtp.add_argument("--prompts-per-register", type=options.positive_int, default=2)
    mtp.add_argument("--prompts", type=options.positive_int, help="only the first N prompts (a full-size model: 1)")
    mtp.add_argument("--n-draft-max", type=options.positive_int, default=5)
    mtp.add_argument("--json", type=options.json_destination, help="also write the results here")
    options.add_rank_options(mtp)
    mtp.add_argument("--peer", choices=("mlx-vlm",), help="also run this engine's own MTP decoding on the same checkpoint")
    mtp.add_argument("--ablate", type=options.positive_int, nargs="+", default=(), metavar="N",
                     help="also run the loop at these n_drafts without queueing ahead, and eagerly: what each buys")


def _register_decode(benches) -> None:
    decode = benches.add_parser("decode", help="plain greedy decoding, qmtp against mlx-lm, interleaved in one run")
    options.add_model(decode)
    decode.add_argument("--scaled", type=Path, metavar="DIR",
                        help="instead of MODEL: a synthetic model of the real layer widths (4 layers, 64 experts, "
                             "4-bit), written to DIR on first use")
    decode.add_argument("--max-tokens", type=options.positive_int, help="tokens per prompt (default 64; 16 with --scaled)")
    decode.add_argument("--repeats", type=options.positive_int, help="interleaved rounds (default 5; 3 with --scaled)")
    decode.add_argument("--prompts", type=options.positive_int,
                        help="how many prompts (default 5, one per register; 2 with --scaled)")
    decode.add_argument("--json", type=options.json_destination, help="also write the results here")
    options.add_rank_options(decode)


def _register_convert(benches) -> None:
    conv = benches.add_parser("convert", help="qmtp convert against mlx_lm.convert and cp on a synthetic checkpoint")
    conv.add_argument("--workdir", type=Path, metavar="DIR",
                      help="keep the synthetic source here and reuse it (default: a temporary folder, removed)")
    conv.add_argument("--gb", type=float, default=4.0, help="size of the bf16 source, at least (default 4)")
    conv.add_argument("--preset", choices=PRESETS,
                      help="instead of --gb: this synthetic preset, experts sparse (full size: 71 GB apparent)")
    conv.add_argument("--bits", type=int, default=4, choices=BITS, help="trunk width (default 4)")
    conv.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES)
    conv.add_argument("--rounds", type=int, default=2, help="rounds of the three commands (default 2)")
    conv.add_argument("--json", type=options.json_destination, help="also write the results here")


def run(args) -> int:
    from ..book import bench as benchmarks
    from ..loading import load

    if args.bench == "convert":
        from ..book import bench_convert

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
    if ranks.ranked(args):
        return ranks.start_ranks(args)
    group = ranks.rank_group()
    if group is not None and group.rank():  # only rank 0 prints and writes the JSON
        sys.stdout = open(os.devnull, "w")
        args.json = None
    model = load(args.model, group=group)
    if args.bench == "mtp":
        from ..options import MAX_N_DRAFT

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
    from ..book import peer

    reason = peer.available()
    if reason:
        print(f"--peer mlx-vlm: skipped, {reason}", flush=True)
        return None
    return peer.MlxVlmEngine(path)


def _bench_prompts(model, n_prompts: int | None, per_register: int = 1) -> list[list[int]]:
    """The first `n_prompts` (default: `per_register` of each register) held-out text prompts when the model has
    a tokenizer, else as many random token ids (fixed seed)."""
    from ..book.evaluate import heldout_prompts
    from ..tiny.corpus import REGISTERS

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
