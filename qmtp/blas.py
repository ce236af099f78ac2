"""Which BLAS multiplies MLX's float32 matrices on a Linux CPU, and an optimised one when the machine has it.

The `mlx[cpu]` wheel for Linux carries netlib's reference BLAS, a plain triple loop: a [T, 64] x [64, 1024]
product costs T times a [1, 64] one, about a nanosecond per multiply-add. A decode pass multiplies one row per
layer, a verify pass n rows, so on that BLAS every drafted token costs the trunk almost a whole extra pass of
matrix products, and speculative decoding gains little however well the head drafts. OpenBLAS does the same
products several times faster, and rows batch well.

MLX's library finds `cblas_sgemm` in the process's global symbols before its own bundled copy, so loading
an optimised BLAS with RTLD_GLOBAL before `mlx.core` is imported makes MLX use it; the products are the same
up to rounding. `QMTP_BLAS` chooses: unset, the first OpenBLAS found in the usual Debian, Ubuntu and Fedora
places; a path, that library; `bundled`, the wheel's own. Each OpenBLAS thread would compete with MLX's own
threads for the cores, so it runs on one unless OPENBLAS_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

OPENBLAS_PLACES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

loaded: str | None = None  # the library loaded for MLX, or None for the wheel's own
reason = "not tried"


def use_optimised() -> None:
    """Load the BLAS `QMTP_BLAS` names (or the first OpenBLAS found) for MLX, once, before MLX is imported."""
    global loaded, reason
    if reason != "not tried":
        return
    choice = os.environ.get("QMTP_BLAS", "")
    if platform.system() != "Linux":
        reason = "not Linux: MLX uses the platform's BLAS"
    elif choice == "bundled":
        reason = "QMTP_BLAS=bundled"
    elif "mlx.core" in sys.modules:
        reason = "mlx.core was imported before qmtp: it keeps the BLAS it found"
    else:
        candidates = [choice] if choice else [p for p in OPENBLAS_PLACES if Path(p).exists()]
        if not candidates:
            reason = "no OpenBLAS on this machine (Debian/Ubuntu: apt install libopenblas0-pthread)"
        for path in candidates:
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                reason = f"cannot load {path}: {e}"
                continue
            loaded, reason = path, "loaded"
            break


def describe() -> str:
    """One line for reports: which BLAS MLX multiplies with."""
    if loaded:
        return f"OpenBLAS ({loaded})" if "openblas" in loaded.lower() else loaded
    return f"the MLX wheel's own ({reason})"
