"""How much memory this process may still take, and a refusal in one line when a model will not fit.

Loading past the limit is never a clean failure: the kernel's OOM killer ends the process, or under an
address-space limit (`ulimit -v`) an allocation inside MLX fails and the process dies with a segmentation
fault. So the bytes a load needs are compared beforehand with the smallest of three ceilings: the memory
the kernel can give without swapping (MemAvailable), the cgroup's limit, and the address space left.
"""

from __future__ import annotations

import resource
from pathlib import Path

from .errors import QmtpError

# What a process holds besides the weights (MLX's kernels and buffers, Python, the tokenizer): measured as
# about 0.3 GB on the CPU; the rest is room for the first forward pass's activations.
OVERHEAD_BYTES = 1 << 30


class NotEnoughMemoryError(QmtpError):
    """A model needs more memory than this process can have."""


def _meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max minus memory.current, when the cgroup has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _address_space_room() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = _meminfo_bytes("VmSize", "/proc/self/status") or 0
    return soft - used


def room() -> dict[str, int]:
    """Each ceiling that applies, in bytes: {"available memory": ..., "cgroup": ..., "address space": ...}."""
    ceilings = {"available memory": _meminfo_bytes("MemAvailable"), "cgroup limit": _cgroup_room(),
                "address-space limit (ulimit -v)": _address_space_room()}
    return {name: value for name, value in ceilings.items() if value is not None}


def check_fits(needed: int, what: str) -> None:
    """Refuse with one line if `needed` bytes (plus OVERHEAD_BYTES) exceed any ceiling in `room()`."""
    total = needed + OVERHEAD_BYTES
    for name, value in room().items():
        if total > value:
            raise NotEnoughMemoryError(
                f"{what} needs {total / 2**30:.1f} GiB of memory ({needed / 2**30:.1f} GiB of weights) but the "
                f"{name} leaves {max(value, 0) / 2**30:.1f} GiB; free memory, raise the limit, or convert to "
                f"fewer bits")
