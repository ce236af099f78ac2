"""The machine a build ran on, in one line: every page that times something names it.

A timing says little without its machine: the CPU (model and the cores this process may use), the operating
system, the memory, MLX's version and the device it computes on, and the BLAS that multiplies its float32
matrices (`qmtp.blas`). Everything is read from the running process and the operating system, nothing is typed.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from .. import blas


def cpu_model() -> str:
    """The processor's name as the operating system reports it ("unknown CPU" where it says nothing)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "Hardware"):
                return " ".join(line.split(":", 1)[1].split())
    if platform.system() == "Darwin":
        try:
            done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip()
        except OSError:
            pass
    return platform.processor() or "unknown CPU"


def cores() -> dict[str, int]:
    """Logical cores of the machine, and those this process may run on (a container or affinity mask)."""
    total = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return {"machine": total, "usable": usable}


def memory_bytes() -> int | None:
    """Total physical memory, or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def operating_system() -> str:
    """The OS and its release: the distribution's name on Linux (from /etc/os-release), else platform's."""
    if platform.system() == "Linux":
        release = Path("/etc/os-release")
        if release.is_file():
            fields = dict(line.split("=", 1) for line in release.read_text().splitlines() if "=" in line)
            name = fields.get("PRETTY_NAME", "").strip('"')
            if name:
                return f"{name} (Linux {platform.release()})"
        return f"Linux {platform.release()}"
    if platform.system() == "Darwin":
        return f"macOS {platform.mac_ver()[0]}"
    return f"{platform.system()} {platform.release()}"


def mlx_device() -> dict[str, str]:
    """MLX's version, the device it computes on by default, and which backend that is."""
    import mlx.core as mx

    device = mx.default_device()
    backend = "CPU"
    if device.type == mx.gpu:
        if mx.metal.is_available():
            backend = "Metal"
        elif getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            backend = "CUDA"
        else:
            backend = "GPU"
    kind = "cpu" if device.type == mx.cpu else "gpu"
    return {"version": mx.__version__, "device": kind, "backend": backend}


def describe() -> dict:
    """Everything above, as plain values (JSON-able, for `qmtp.book.results`)."""
    count = cores()
    mlx = mlx_device()
    return {"cpu": cpu_model(), "cores": count["usable"], "machine_cores": count["machine"],
            "memory_gib": None if memory_bytes() is None else memory_bytes() / 2**30, "os": operating_system(),
            "python": platform.python_version(), "mlx": mlx["version"], "device": mlx["device"],
            "backend": mlx["backend"], "blas": blas.describe()}


def line(info: dict | None = None) -> str:
    """The machine in one line: CPU (cores, memory); OS; MLX version, backend and device; BLAS."""
    info = info or describe()
    cores_text = (f"{info['cores']} cores" if info["cores"] == info["machine_cores"]
                  else f"{info['cores']} of its {info['machine_cores']} cores")
    memory = "" if info["memory_gib"] is None else f", {info['memory_gib']:.0f} GiB of memory"
    return (f"{info['cpu']} ({cores_text}{memory}); {info['os']}; MLX {info['mlx']}, {info['backend']} backend "
            f"(default device: {info['device']}); BLAS: {info['blas']}")


def where_and_when() -> dict:
    """Where and when a run outside the build ran, saved with its report for the page that reads it."""
    from datetime import datetime, timezone

    return {"where": line(), "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
