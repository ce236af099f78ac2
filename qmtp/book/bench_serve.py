"""`python -m qmtp bench serve --clients 1,4,16`: `qmtp serve` under concurrent streaming clients, drafting
off and on, beside `mlx_lm.server` on the same checkpoint.

Each server runs as its own process on a free port of 127.0.0.1. For each number of clients, that many
threads each stream one completion at once (temperature 0, `max_tokens` new tokens, `ignore_eos` where the
server honours it); a request's time to first token is from sending it to its first text, its tokens/s the
tokens after the first over the time from the first to the last; the aggregate is every token over the
round's wall time. Every server is started (and warmed up) before the first round and waits idle while another
is loaded; each client count runs on every server in turn, the order reversed each repeat, and a cell is the
median of its repeats (`--repeats`). The server's resident memory is read after its warm-up request and after
the last round.

mlx_lm.server on the CPU cannot run a bfloat16 mixture of experts (MLX's CPU gather_mm computes float32
only), and has no dtype option: it is given a float32 copy of the checkpoint (the dtype qmtp computes in on
the CPU too). It serves the model plain (no MTP head), as it serves this model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import UsageError
from ..options import DRAFTING_N_DRAFT
from . import machine

PROMPTS = ("Once upon a time", "The old dog", "In a small town", "The moon was", "A little girl",
           "Every morning the", "The river", "Long ago")
START_SECONDS = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


@contextmanager
def _server(command: list[str], port: int, ready_path: str):
    """A server process, once `ready_path` answers; stopped on leaving."""
    import httpx

    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise UsageError(f"{command[2]} did not start: {(process.stderr.read() or '')[-500:]}")
            time.sleep(0.3)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _stream(base: str, prompt: str, max_tokens: int, tokenizer) -> dict:
    """One streamed completion: time to first text, tokens, tokens/s after the first."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    text, usage = [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            piece = "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if piece:
                last = time.perf_counter()
                first = first or last
                text.append(piece)
    tokens = usage["completion_tokens"] if usage else len(tokenizer.encode("".join(text)))
    span = (last - first) if first is not None else 0.0
    return {"ttft": (first or time.perf_counter()) - sent, "tokens": tokens,
            "tokens_per_second": (tokens - 1) / span if span > 0 else float("nan")}


def _round(base: str, clients: int, max_tokens: int, tokenizer) -> dict:
    results: list[dict] = [None] * clients

    def client(i):
        results[i] = _stream(base, PROMPTS[i % len(PROMPTS)], max_tokens, tokenizer)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ttfts = sorted(r["ttft"] for r in results)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    return {"clients": clients, "ttft_p50": statistics.median(ttfts), "ttft_p99": p99,
            "tokens_per_stream": statistics.mean(r["tokens_per_second"] for r in results),
            "aggregate": sum(r["tokens"] for r in results) / wall,
            "tokens_per_request": statistics.mean(r["tokens"] for r in results)}


def _median_round(rounds: list[dict]) -> dict:
    """One cell from the same round repeated: each field's median."""
    return {key: rounds[0][key] if key == "clients" else statistics.median(r[key] for r in rounds)
            for key in rounds[0]}


def float32_copy(path: Path, workdir: Path) -> Path:
    """The checkpoint with its floating-point weights as float32 (for mlx_lm.server on the CPU)."""
    import mlx.core as mx

    out = workdir / f"{path.name}-float32"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in path.iterdir():
        if item.suffix == ".safetensors":
            arrays = mx.load(str(item))
            mx.save_safetensors(str(out / item.name), {k: v.astype(mx.float32) if mx.issubdtype(
                v.dtype, mx.floating) else v for k, v in arrays.items()})
        elif item.is_file():
            shutil.copy2(item, out / item.name)
    return out


def run(model_path=None, clients=(1, 4, 16), max_tokens: int = 64, n_drafts=(1, DRAFTING_N_DRAFT), mlx_lm: bool = True,
        workdir=None, repeats: int = 3) -> dict:
    """The load table's rows: qmtp serve at each n_draft, then mlx_lm.server, each at every client count.

    Every server is started first and warmed up; then each client count is run on every server in turn,
    the order reversed from one repeat to the next, and each cell is the median of its `repeats` rounds:
    this machine's speed drifts by tens of percent from minute to minute, and one server measured after
    another would carry that drift into their ratios."""
    import tempfile
    from contextlib import ExitStack

    from ..loading import resolve_path
    from ..tokenizer import Tokenizer

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"repeats={repeats!r:.40} must be an integer >= 1")
    path = Path(resolve_path(model_path))
    tokenizer = Tokenizer.from_dir(path)
    commands = []
    for n_draft in n_drafts:
        port = _free_port()
        commands.append((f"qmtp serve, n_draft {n_draft}", port, "/health",
                         [sys.executable, "-m", "qmtp.serve", str(path), "--port", str(port), "--n-draft",
                          str(n_draft), "--max-queue", str(max(64, max(clients))), "--log-level", "warning"]))
    with ExitStack() as stack:
        if mlx_lm:
            import mlx.core as mx

            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=workdir)))
            copy = float32_copy(path, scratch) if mx.default_device() == mx.cpu else path
            port = _free_port()
            commands.append(("mlx_lm.server (float32 copy, plain)", port, "/v1/models",
                             [sys.executable, "-m", "mlx_lm", "server", "--model", str(copy), "--port", str(port)]))
        servers = []
        for name, port, ready, command in commands:
            process = stack.enter_context(_server(command, port, ready))
            base = f"http://127.0.0.1:{port}"
            _stream(base, PROMPTS[0], 8, tokenizer)  # warm-up: compiled steps, first allocations
            servers.append({"server": name, "base": base, "process": process,
                            "memory_before_mib": _rss_mib(process.pid), "runs": {c: [] for c in clients}})
        for repeat in range(repeats):
            for count in clients:
                for server in servers if repeat % 2 == 0 else servers[::-1]:
                    server["runs"][count].append(_round(server["base"], count, max_tokens, tokenizer))
        for server in servers:
            server["memory_after_mib"] = _rss_mib(server["process"].pid)
    return {"model": str(path), "max_tokens": max_tokens, "clients": list(clients), "repeats": repeats,
            "servers": [{"server": s["server"], "memory_before_mib": s["memory_before_mib"],
                         "memory_after_mib": s["memory_after_mib"],
                         "rounds": [_median_round(s["runs"][c]) for c in clients]} for s in servers]}


def table(report: dict) -> str:
    lines = [f"{report['model']}: {report['max_tokens']} new tokens per request, temperature 0, each cell the median "
             f"of {report.get('repeats', 1)} rounds",
             f"{'server':<38} {'clients':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s/stream':>12} "
             f"{'tok/s all':>9} {'tok/req':>7}"]
    for server in report["servers"]:
        for r in server["rounds"]:
            lines.append(f"{server['server']:<38} {r['clients']:>7} {r['ttft_p50'] * 1000:>7.0f}ms "
                         f"{r['ttft_p99'] * 1000:>7.0f}ms {r['tokens_per_stream']:>12.1f} {r['aggregate']:>9.1f} "
                         f"{r['tokens_per_request']:>7.1f}")
        lines.append(f"{'':<38} memory {server['memory_before_mib']:.0f} MiB after warm-up, "
                     f"{server['memory_after_mib']:.0f} MiB after the load")
    return "\n".join(lines)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every number must be at least 1")
    return values


def _widths(text: str) -> tuple:
    """--n-draft: widths separated by commas, each as `qmtp serve --n-draft` takes it (a number or auto)."""
    from ..cli.options import n_draft

    return tuple(n_draft(v) for v in text.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qmtp bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--clients", type=_counts, default=(1, 4, 16), help="concurrent clients per round: 1,4,16")
    p.add_argument("--n-draft", type=_widths, default=(1, DRAFTING_N_DRAFT),
                   help=f"qmtp serve's --n-draft, one server each (default 1,{DRAFTING_N_DRAFT}: plain and its default)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    p.add_argument("--repeats", type=int, default=3, help="rounds per cell, servers interleaved; the median kept")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    report = run(args.model, args.clients, args.max_tokens, args.n_draft, not args.no_mlx_lm, repeats=args.repeats)
    report.update(machine.where_and_when())
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
