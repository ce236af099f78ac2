"""Commands on several ranks (`--ranks N`, `--hostfile FILE`): the first process starts the ranks through
`qmtp.launch`, each of which runs the same command again with the experts spread over the group."""

from __future__ import annotations

import errno
import os
import re

from ..errors import QmtpError, UsageError


def ranked(args) -> bool:
    """True in this process when it is to start ranks rather than be one: --ranks N > 1 or --hostfile, and not
    already started by `qmtp.launch`."""
    from .. import launch

    return (args.hostfile is not None or (args.ranks or 1) > 1) and not os.environ.get(launch.RANKS_ENV)


def start_ranks(args) -> int:
    """Start the ranks (each runs this command again), once every check that needs no rank has passed."""
    from .. import launch

    if args.hostfile is not None and args.ranks is not None:
        raise UsageError("give --ranks N (this host) or --hostfile FILE (its hosts), not both")
    if args.hostfile is not None and not args.hostfile.is_file():
        raise UsageError(f"--hostfile {args.hostfile}: no such file")
    count = args.ranks if args.hostfile is None else launch.hostfile_hosts(args.hostfile)
    check_rank_count(args.model, count, local=args.hostfile is None)
    return launch.run(["-m", "qmtp", *args.argv], args.ranks, args.hostfile, args.timeout,
                      relay_stdin=getattr(args, "prompt", "") is None)


def rank_group():
    """The distributed group of this rank when `qmtp.launch` started it, else None (one process). The rank's own
    watchdog starts first: it ends the rank if its launcher goes, or past --timeout, wherever the rank runs."""
    from .. import launch

    if not os.environ.get(launch.RANKS_ENV):
        return None
    import mlx.core as mx

    launch.watch_this_rank()
    try:
        return mx.distributed.init(strict=True)
    except RuntimeError as err:  # a port taken meanwhile, a host unreachable: the ring's own words, and the rank
        raise QmtpError(f"could not join the ring: {_ring_error(err)}") from None


def _ring_error(err: RuntimeError) -> str:
    """MLX's message with its errno spelled out: "[ring] Couldn't bind socket (error: 98)" says little alone."""
    text = str(err)
    found = re.search(r"\(error: (\d+)\)", text)
    if found:
        text = f"{text} ({os.strerror(int(found.group(1)))})"
    if found and int(found.group(1)) == errno.EADDRINUSE:
        text += "; another program took the port after it was chosen: run again"
    return text


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


def check_rank_count(model, count: int, local: bool) -> None:
    """Refuse, before any process starts, a number of ranks the model or this host cannot take: the routed
    experts must split evenly, and ranks on this host must fit its cores and memory (each holds its own copy of
    everything but its experts). A hostfile's model path may exist only on its hosts: then the ranks check."""
    from ..checkpoint import Checkpoint
    from ..config import ModelConfig
    from ..loading import resolve_path
    from ..parallel import ROUTED_EXPERTS

    try:
        path = resolve_path(model)
    except QmtpError:
        if not local:
            return
        raise
    experts = ModelConfig.from_file(path).num_experts
    if experts % count:
        raise UsageError(f"the model has {experts} routed experts per layer, which do not split evenly over {count} "
                         f"ranks: run on a number of ranks that divides {experts}")
    if not local:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if count > cores:
        raise UsageError(f"--ranks {count}: this host has {cores} cores for them; more ranks than cores only wait "
                         f"on each other (use at most {cores})")
    infos = Checkpoint(path).infos
    routed = sum(info.nbytes for name, info in infos.items() if ROUTED_EXPERTS in name)
    shared = sum(info.nbytes for info in infos.values()) - routed
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if count * shared + routed > memory:
        raise UsageError(f"--ranks {count}: {count} ranks on this host would hold {(count * shared + routed) / 1e9:.1f} "
                         f"GB ({shared / 1e9:.1f} GB each outside the experts), more than its {memory / 1e9:.1f} GB")
