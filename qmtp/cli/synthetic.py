"""`python -m qmtp synthetic DIR --preset P`: a random checkpoint in the released layout (`qmtp.tiny.synthetic`)."""

from __future__ import annotations

from pathlib import Path

PRESETS = ("qwen3.6-35b-a3b", "qwen3.6-35b-a3b-reduced")


def register(commands) -> None:
    synth = commands.add_parser("synthetic", help="write a random checkpoint in the released layout")
    synth.add_argument("dir", type=Path, help="directory to create (refused if it exists)")
    synth.add_argument("--preset", required=True, choices=PRESETS,
                       help="qwen3.6-35b-a3b: the release's names, shapes, dtypes and 26 shards; -reduced: "
                            "the same widths with 4 layers and 16 experts")
    synth.add_argument("--sparse", action="store_true",
                       help="routed experts and other big tensors as holes (zeros, no disk); small ones seeded")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--quiet", action="store_true", help="no progress bar")
    synth.set_defaults(run=run)


def run(args) -> int:
    from ..tiny.synthetic import write_preset

    path = write_preset(args.dir, args.preset, sparse=args.sparse, seed=args.seed, progress=not args.quiet)
    files = sorted(path.glob("*.safetensors"))
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    print(f"wrote {path}: {args.preset}, {len(files)} safetensors files, {apparent / 1e9:.1f} GB "
          f"({on_disk / 1e9:.2f} GB on disk)")
    return 0
