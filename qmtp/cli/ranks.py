"""Commands on several ranks (`--ranks N`, `--hostfile FILE`): the first process starts the ranks through
`qmtp.launch`, each of which runs the same command again with the experts spread over the group."""

from __future__ import annotations

import os

from ..errors import UsageError


def ranked(args) -> bool:
    """True in this process when it is to start ranks rather than be one: --ranks N > 1 or --hostfile, and not
    already started by `qmtp.launch`."""
    from .. import launch

    return (args.hostfile is not None or (args.ranks or 1) > 1) and not os.environ.get(launch.RANKS_ENV)


def start_ranks(args) -> int:
    from .. import launch

    if args.hostfile is not None and args.ranks is not None:
        raise UsageError("give --ranks N (this host) or --hostfile FILE (its hosts), not both")
    if args.hostfile is not None and not args.hostfile.is_file():
        raise UsageError(f"--hostfile {args.hostfile}: no such file")
    return launch.run(["-m", "qmtp", *args.argv], args.ranks, args.hostfile, args.timeout,
                      relay_stdin=getattr(args, "prompt", "") is None)


def rank_group():
    """The distributed group of this rank when `qmtp.launch` started it, else None (one process)."""
    from .. import launch

    if not os.environ.get(launch.RANKS_ENV):
        return None
    import mlx.core as mx

    return mx.distributed.init(strict=True)


def shared_prompts(group, prompts):
    """Rank 0's prompts (from `prompts`, its stdin) on every rank: each rank runs every generation together."""
    import mlx.core as mx

    from .. import parallel

    source = iter(prompts) if group.rank() == 0 else None
    while True:
        line = next(source, None) if source is not None else None
        data = line.encode("utf-8") if line is not None else b""
        length = int(parallel.broadcast([len(data) if line is not None else -1], group)[0])
        if length < 0:
            return
        sent = mx.array(list(data) if group.rank() == 0 else [0] * length, dtype=mx.int32)
        yield bytes(mx.distributed.all_sum(sent, group=group).tolist()).decode("utf-8")
