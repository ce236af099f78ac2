"""`python -m qmtp convert SRC DST`: quantize a checkpoint into one file holding trunk and MTP head."""

from __future__ import annotations

import warnings

from ..conventions import BITS, GROUP_SIZES, parse_width, width_text
from . import options


def register(commands) -> None:
    convert = commands.add_parser("convert", help="quantize a checkpoint into one file holding trunk and MTP head")
    convert.add_argument("src", help="checkpoint directory in a released layout (config.json + safetensors)")
    convert.add_argument("dst", help="directory to write (refused if it exists, unless --force)")
    convert.add_argument("--bits", type=int, default=8, choices=BITS, help="trunk width (default 8)")
    convert.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES, help="quantization group (default 64)")
    convert.add_argument("--mtp-bits", type=options.width, default="bf16", metavar="bf16|N",
                         help="MTP head width (default bf16: unquantized)")
    convert.add_argument("--router-bits", type=options.width, default=8, metavar="N|bf16",
                         help="router and shared-expert gate width, groups of 64 (default 8)")
    convert.add_argument("--lm-head-bits", type=options.width, default=None, metavar="N|bf16",
                         help="lm_head width (default --bits)")
    convert.add_argument("--shards", type=int, default=None, metavar="N", help="write N files and an index")
    convert.add_argument("--force", action="store_true", help="replace DST if it exists")
    convert.add_argument("--allow-incomplete-head", action="store_true",
                         help="convert a head that lacks its routed experts (it drafts far worse)")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(run=run)


def run(args) -> int:
    from ..convert import convert

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning about the source, even one seen before in this process
        result = convert(args.src, args.dst, bits=args.bits, group_size=args.group_size, mtp_bits=args.mtp_bits,
                         router_bits=args.router_bits, lm_head_bits=args.lm_head_bits, shards=args.shards,
                         force=args.force, allow_incomplete_head=args.allow_incomplete_head, progress=not args.quiet)
    head = width_text(parse_width(args.mtp_bits, "mtp_bits"))
    print(f"wrote {result} [trunk {args.bits}-bit, group {args.group_size}, head {head}, fixes {', '.join(result.fixes)}]")
    return 0
