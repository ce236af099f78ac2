"""`python -m qmtp bench convert`: the cost of a conversion, qmtp against mlx-lm's and against a plain copy.

The source is a synthetic checkpoint in the released layout at the real layer widths (hidden 2048, expert
intermediate 512, 4 layers, vocabulary cut to 32768), with as many routed experts as it takes to reach the
size asked for (`--gb`, at least 4 GB by default), plus the bundled tokenizer files (mlx-lm's loader wants
a tokenizer). Three commands run on it, each in its own process, in the same rounds, their order turned
round from one round to the next:

* `cp -R SOURCE OUT`: what moving the bytes costs;
* `python -m qmtp convert SOURCE OUT --bits B` (head kept in bf16);
* `python -m mlx_lm convert --hf-path SOURCE --mlx-path OUT -q --q-bits B` (mlx-lm drops the head).

`versions` adds qmtp as another checkout has it (`{"before": "/tmp/qmtp-at-COMMIT"}`: that folder's `qmtp`
package, imported through PYTHONPATH), timed in the same rounds, so that two commits compare on one loaded
machine; `tools` keeps only some of the commands (the full-size source takes minutes a conversion).

Time is the process's wall time plus a `sync` that puts what it wrote on the disk (qmtp fsyncs its files
before renaming them; the others leave that to the kernel, so the sync is counted for all three). Peak
memory is the process's maximum resident set size, from `os.wait4`. The source is read once, untimed,
before the first round, so that every command reads it from the page cache.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UsageError

TOOLS = ("cp", "qmtp", "mlx-lm")
MAX_EXPERTS = 256


def source_config(gb: float):
    """The real widths, 4 layers, vocabulary 32768, and the fewest routed experts (a multiple of 8, at most
    256) that make the bf16 checkpoint at least `gb` GB."""
    from .bench import SCALED_REAL_WIDTHS
    from ..config import QWEN36_35B_A3B
    from ..sizes import UNQUANTIZED, sizes

    base = QWEN36_35B_A3B.replace(**SCALED_REAL_WIDTHS)  # bench decode's widths; the experts are set below
    for experts in range(8, MAX_EXPERTS + 1, 8):
        config = base.replace(num_experts=experts)
        if sizes(config, bits=UNQUANTIZED).total_bytes >= gb * 1e9:
            return config
    most = sizes(base.replace(num_experts=MAX_EXPERTS), bits=UNQUANTIZED).total_bytes / 1e9
    raise UsageError(f"--gb {gb}: the synthetic source holds at most {most:.1f} GB (4 layers of 256 experts)")


def write_source(directory, config) -> Path:
    """The synthetic bf16 checkpoint of `config` with the bundled tokenizer files; kept and reused when the
    directory already holds this config."""
    from ..config import ModelConfig
    from ..errors import QmtpError
    from ..loading import BUNDLED_MODEL
    from ..tiny.synthetic import write_checkpoint
    from ..tokenizer import CONFIG_FILE, TOKENIZER_FILE

    directory = Path(directory)
    if (directory / "model.safetensors").is_file():
        try:
            if ModelConfig.from_file(directory) == config:
                return directory
        except QmtpError:
            pass
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_checkpoint(partial, config, dtype="BF16")
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        shutil.copyfile(BUNDLED_MODEL / name, partial / name)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(partial, directory)
    return directory


def write_preset_source(directory, preset: str) -> Path:
    """`synthetic --preset PRESET --sparse` into `directory`, kept and reused when it is already there."""
    from ..config import ModelConfig
    from ..errors import QmtpError
    from ..tiny.synthetic import PRESETS, write_preset

    directory = Path(directory)
    if (directory / "config.json").is_file():
        try:
            if ModelConfig.from_file(directory) == PRESETS[preset]["config"]:
                return directory
        except QmtpError:
            pass
        raise UsageError(f"{directory}: holds another checkpoint; remove it or give another --workdir")
    return write_preset(directory, preset, sparse=True, progress=False)


def _in_fresh_process(function, *args):
    """Run `function(*args)` in a spawned interpreter. Peak memory is inherited across fork and exec, so
    the process that launches the timed commands must stay small: writing the source in it would raise
    every command's measured peak to the writer's."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def commands(source: Path, out: Path, bits: int, group_size: int, versions=None) -> dict[str, list[str]]:
    qmtp = [sys.executable, "-m", "qmtp", "convert", str(source), str(out), "--bits", str(bits),
            "--group-size", str(group_size), "--quiet"]
    return {
        "cp": ["cp", "-R", str(source), str(out)],
        "qmtp": qmtp,
        "mlx-lm": [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(source), "--mlx-path", str(out),
                   "-q", "--q-bits", str(bits), "--q-group-size", str(group_size)],
        **{f"qmtp@{label}": qmtp for label in (versions or {})},
    }


def environment(tool: str, versions=None) -> dict | None:
    """The environment of `tool`'s process: PYTHONPATH at the checkout of a `versions` entry, else inherited."""
    label = tool.partition("@")[2]
    if not label:
        return None
    return dict(os.environ, PYTHONPATH=str(Path(versions[label]).resolve()))


def measure(command: list[str], out: Path, log: Path, env: dict | None = None) -> dict:
    """Run `command` (which writes `out`), then sync; its wall time, peak RSS and the bytes it wrote."""
    started = time.perf_counter()
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    os.sync()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(command[:4])} ... failed with status {process.returncode}: {tail[0]}")
    peak = _rss_bytes(usage.ru_maxrss)
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"seconds": seconds, "peak_rss_bytes": peak, "output_bytes": written}


def launcher_peak_bytes() -> int:
    """This process's own peak RSS: the floor under every command's measured peak (see _in_fresh_process)."""
    import resource

    return _rss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _rss_bytes(maxrss: int) -> int:
    """ru_maxrss in bytes: the kernel reports kilobytes on Linux, bytes on macOS."""
    return maxrss * (1 if sys.platform == "darwin" else 1024)


def run(workdir=None, gb: float = 4.0, bits: int = 4, group_size: int = 64, rounds: int = 2, config=None,
        progress=None, preset: str | None = None, versions: dict | None = None, tools=TOOLS) -> dict:
    """Write (or reuse) the source in `workdir` and time the three tools on it, `rounds` times each.

    Without `workdir` everything goes into a temporary folder that is removed at the end. `config` replaces
    the synthetic source's config (tests use a small one). `preset` (a `synthetic.PRESETS` name) makes the
    source that preset with sparse experts instead: the release's full size (cp then copies only the data
    blocks, since GNU cp keeps holes holes; qmtp and mlx-lm read every byte).
    """
    from ..tiny.synthetic import PRESETS

    if preset is not None and preset not in PRESETS:
        raise UsageError(f"--preset {preset}: choose one of {', '.join(PRESETS)}")
    if rounds < 1:
        raise UsageError(f"--rounds {rounds}: give 1 or more")
    if not set(tools) <= set(TOOLS) or "cp" not in tools:
        raise UsageError(f"tools={tools!r}: choose among {', '.join(TOOLS)}, cp included (times are read against it)")
    tools = tuple(tools) + tuple(f"qmtp@{label}" for label in (versions or {}))
    if not gb > 0:
        raise UsageError(f"--gb {gb}: give a size in GB above 0")
    progress = progress or (lambda line: print(line, flush=True))
    owned = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="qmtp-bench-convert-") if owned else workdir).expanduser()
    try:
        config = PRESETS[preset]["config"] if preset else (config or source_config(gb))
        workdir.mkdir(parents=True, exist_ok=True)
        source_dir = workdir / (f"source-{preset}" if preset else "source")
        progress(f"source: synthetic bf16 checkpoint, released layout, {config.num_experts} experts x "
                 f"{config.num_hidden_layers} layers + MTP head{', sparse' if preset else ''}, in {source_dir} "
                 f"(written on first use) ...")
        if preset:
            source = _in_fresh_process(write_preset_source, source_dir, preset)
        else:
            source = _in_fresh_process(write_source, source_dir, config)
        source_bytes = sum(f.stat().st_size for f in source.iterdir() if f.is_file())
        free = shutil.disk_usage(workdir).free
        if preset:  # the largest output: qmtp's, which keeps the head
            from ..sizes import sizes

            needed = 1.1 * sizes(config, bits=bits, group_size=group_size).total_bytes
            if free < needed:
                raise UsageError(f"{workdir}: {free / 1e9:.1f} GB free, the {bits}-bit output needs {needed / 1e9:.1f} GB")
        elif free < 1.2 * source_bytes:
            raise UsageError(f"{workdir}: {free / 1e9:.1f} GB free, the copy alone needs {source_bytes / 1e9:.1f} GB")
        for file in source.iterdir():  # untimed: every tool then reads the source from the page cache
            with open(file, "rb") as f:
                while f.read(64 << 20):
                    pass
        runs: dict[str, list[dict]] = {tool: [] for tool in tools}
        for r in range(rounds):
            order = tools if r % 2 == 0 else tools[::-1]
            for tool in order:
                out = workdir / f"out-{tool}"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                result = measure(commands(source, out, bits, group_size, versions)[tool], out, workdir / f"{tool}.log",
                                 environment(tool, versions))
                shutil.rmtree(out, ignore_errors=True)
                runs[tool].append(result)
                progress(f"round {r + 1}/{rounds} {tool:7s} {result['seconds']:7.1f} s  "
                         f"peak {result['peak_rss_bytes'] / 1e6:7.0f} MB")
        return summarise(runs, source_bytes, bits, group_size, config) | {"launcher_peak_bytes": launcher_peak_bytes()}
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)


def summarise(runs: dict, source_bytes: int, bits: int, group_size: int, config) -> dict:
    tools = {}
    for tool, results in runs.items():
        seconds = [r["seconds"] for r in results]
        median = statistics.median(seconds)
        tools[tool] = {
            "seconds": median, "seconds_min": min(seconds), "seconds_max": max(seconds),
            "source_mb_per_second": source_bytes / 1e6 / median,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "output_bytes": results[-1]["output_bytes"],
            "runs": results,
        }
    return {
        "source_bytes": source_bytes, "bits": bits, "group_size": group_size,
        "num_experts": config.num_experts, "num_hidden_layers": config.num_hidden_layers,
        "rounds": len(runs["cp"]), "tools": tools,
        **_ratios(tools),
    }


def _ratios(tools: dict) -> dict:
    """Times over cp's, qmtp's peak over mlx-lm's, and qmtp's time over each other version's, for the tools run."""
    ratios = {}
    if "qmtp" in tools:
        ratios["qmtp_time_over_cp"] = tools["qmtp"]["seconds"] / tools["cp"]["seconds"]
    if "mlx-lm" in tools:
        ratios["mlx_lm_time_over_cp"] = tools["mlx-lm"]["seconds"] / tools["cp"]["seconds"]
    if "qmtp" in tools and "mlx-lm" in tools:
        ratios["qmtp_peak_over_mlx_lm"] = tools["qmtp"]["peak_rss_bytes"] / tools["mlx-lm"]["peak_rss_bytes"]
    for tool in tools:
        if "qmtp" in tools and tool.startswith("qmtp@"):
            ratios[f"qmtp_time_over_{tool}"] = tools["qmtp"]["seconds"] / tools[tool]["seconds"]
            # the same rounds paired: each round's ratio, against the load of that moment
            ratios[f"qmtp_time_over_{tool}_per_round"] = [a["seconds"] / b["seconds"] for a, b in
                                                          zip(tools["qmtp"]["runs"], tools[tool]["runs"])]
    return ratios


def table(report: dict) -> str:
    lines = [
        f"source {report['source_bytes'] / 1e9:.2f} GB bf16 ({report['num_experts']} experts x "
        f"{report['num_hidden_layers']} layers + head), {report['bits']}-bit, group {report['group_size']}, "
        f"{report['rounds']} rounds; times include a sync",
        "",
        "| tool | seconds (median) | min-max | source MB/s | peak RSS MB | output GB | time / cp |",
        "|---|---|---|---|---|---|---|",
    ]
    cp = report["tools"]["cp"]["seconds"]
    for tool, t in report["tools"].items():
        lines.append(f"| {tool} | {t['seconds']:.1f} | {t['seconds_min']:.1f}-{t['seconds_max']:.1f} | "
                     f"{t['source_mb_per_second']:.0f} | {t['peak_rss_bytes'] / 1e6:.0f} | "
                     f"{t['output_bytes'] / 1e9:.2f} | {t['seconds'] / cp:.2f} |")
    lines += ["", f"(peaks include the launching process's {report['launcher_peak_bytes'] / 1e6:.0f} MB, inherited at fork)"]
    ratios = [f"{key.replace('_', ' ')}: {value:.2f}" for key, value in report.items()
              if "_over_" in key and isinstance(value, float)]
    lines.append("; ".join(ratios))
    return "\n".join(lines)
