"""Chapter 9, "Beyond one machine": the experts spread over N ranks (`qmtp.parallel`), checked and priced.

Four things live here, so that the chapter only calls them:

* **The layout** (`layout_rows`, `member_rows`, `fit_table`): which experts each rank holds, the bytes each
  rank holds (`qmtp.sizes.per_rank_bytes`) for the 35B-A3B and the family's 122B-A10B and 397B-A17B (third-party
  configs, `published.THIRD_PARTY_CONFIGS`), and the fewest ranks whose share fits machines of a given memory,
  all arithmetic over the configs.
* **The live check** (`run_live`): the bundled model decoded on two ranks of MLX's ring backend on this host,
  started by `mlx.launch` through `qmtp.launch.run` (bounded by a timeout), and once in a separate process
  without a group; each writes what it found (`worker`: tokens greedy and sampled at n_draft 1 and 3, the
  bytes of the weights it holds, its peak resident memory, and on the ranks the time of an all_sum per MoE
  layer) to a JSON file the chapter reads back. The chapter compares the ranks' tokens with those it decodes
  itself in one process.
* **The predictions** (`cluster_rows`, `scaling_rows`): the calibrated cost model of `qmtp.book.cost_model`
  (each machine's overhead from its published plain figure, c and the acceptance fitted on the published runs)
  with the experts spread over N machines: the busiest rank's bytes (`throughput.parallel_pass_seconds`), and
  one all_sum per MoE layer over a link that exists between such machines (`published.MACHINE_LINKS`), priced
  step by step as MLX's backend for that link sums (`all_sum_steps`).
* **The how-to** (`hostfile`, `jaccl_command`, `backends_here`): the hostfile and the commands for real machines.

    PYTHONPATH=. python -m qmtp.book.beyond OUT [--ranked]     # one worker (what `run_live` starts)
"""

from __future__ import annotations

import io
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT = "Once upon a time"
MAX_TOKENS = 24
SEED = 3
N_DRAFTS = (1, 3)
TEMPERATURES = (0.0, 0.8)  # greedy, and sampled with SEED
ALL_SUM_REPEATS = 20
GB = 1e9


# ---- the layout --------------------------------------------------------------------------------------------
def blocks(n_experts: int, ranks: int) -> list[tuple[int, int]]:
    """(first, last) expert of each rank's block, as `parallel.ExpertShard.rows` gives them (last included)."""
    if n_experts % ranks:
        raise ValueError(f"{n_experts} experts do not split over {ranks} ranks")
    held = n_experts // ranks
    return [(r * held, (r + 1) * held - 1) for r in range(ranks)]


def layout_rows(report, n_experts: int, ranks=(1, 2, 4, 8), unit: float = GB) -> list[dict]:
    """One row per N: the experts of each MoE layer rank 0 and the last rank hold, the bytes one rank holds
    (in `unit`), and that share of one process's bytes."""
    from ..sizes import per_rank_bytes

    whole = per_rank_bytes(report, 1)
    rows = []
    for n in ranks:
        (a, b), (c, d) = blocks(n_experts, n)[0], blocks(n_experts, n)[-1]
        rows.append({"ranks": n, "experts per rank": n_experts // n, "rank 0": f"{a}-{b}",
                     "last rank": f"{c}-{d}", "per rank": per_rank_bytes(report, n) / unit,
                     "of one process": per_rank_bytes(report, n) / whole})
    return rows


def fit_rows(config, machines_gb=(16, 32, 64, 128, 192), widths=(16, 8, 6, 4), ranks=(1, 2, 4, 8),
             runtime: bool = False) -> list[dict]:
    """The fewest ranks whose per-rank weights (`qmtp.sizes.per_rank_bytes`) fit each machine, one row per trunk
    width (16: bf16, the release), the head in bf16 as the book converts it (`qmtp.book.budget.stored_bytes`),
    router gates at 8 bits as mlx-lm converts. A machine of m "GB" holds m GiB and, with `runtime`, each rank
    also needs `budget.RUNTIME_GB` beside its weights: `budget.fits`'s semantics. None: not even 8."""
    from ..sizes import UNQUANTIZED, per_rank_bytes, sizes
    from .budget import fits

    rows = []
    for bits in widths:
        report = sizes(config, bits, mtp_bits=None, router_bits=UNQUANTIZED if bits == UNQUANTIZED else 8)
        row = {"width": "bf16" if bits == UNQUANTIZED else f"{bits}-bit", "whole GB": report.total_bytes / GB}
        for m in machines_gb:
            row[f"{m} GB"] = next((n for n in ranks if fits(per_rank_bytes(report, n), m, runtime)), None)
        rows.append(row)
    return rows


# ---- the live check --------------------------------------------------------------------------------------------
def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def generations(model) -> dict[str, list[int]]:
    """Tokens of every (n_draft, temperature) the chapter checks, keyed "n_draft/temperature"."""
    import qmtp

    return {f"{n}/{t}": qmtp.generate(model, PROMPT, max_tokens=MAX_TOKENS, n_draft=n, temperature=t,
                                      seed=SEED).tokens
            for n in N_DRAFTS for t in TEMPERATURES}


def all_sum_per_layer(model, group, repeats: int = ALL_SUM_REPEATS) -> dict[str, float]:
    """Seconds per MoE layer of a chain of all_sums of one token's [1, k, H] float32 expert outputs, one per
    MoE layer of the trunk and the head, as a decode step issues them: {"median": ..., "fastest": ...} over
    `repeats` chains. On a shared machine the median carries whatever else ran; the fastest chain is the
    closest it comes to the link's own latency."""
    import mlx.core as mx

    c = model.config
    x = mx.ones((1, c.num_experts_per_tok, c.hidden_size))
    layers = len(model.layers) + 1
    mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for i in range(repeats):
        y = x + i
        started = time.perf_counter()
        for _ in range(layers):
            y = mx.distributed.all_sum(y * 0.5, group=group)
        mx.eval(y)
        times.append((time.perf_counter() - started) / layers)
    return {"median": statistics.median(times), "fastest": min(times)}


def worker(out_dir: Path, ranked: bool) -> None:
    """What one process of the live check runs: load (expert-parallel on a group), decode, measure, write."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import qmtp
    from qmtp.loading import BUNDLED_MODEL

    group = mx.distributed.init(strict=True) if ranked else None
    model = qmtp.load(BUNDLED_MODEL, group=group)  # two copies on one host: always the tiny model
    found = {"rank": group.rank() if group else 0, "ranks": group.size() if group else 1,
             "held": model.layers[0].mlp.experts.gate_proj.weight.shape[0],
             "weights_bytes": sum(p.nbytes for _, p in tree_flatten(model.parameters())),
             "rss_after_load": peak_rss()}
    found["tokens"] = generations(model)
    # plain decoding timed once warm (the greedy n_draft=1 run above compiled its step): on ranks sharing this
    # host's cores, what it measures is their contention, not a network
    found["plain_tokens_per_second"] = qmtp.generate(model, PROMPT, max_tokens=MAX_TOKENS,
                                                      n_draft=1).stats.tokens_per_second
    if group is not None:
        found["all_sum_per_layer"] = all_sum_per_layer(model, group)
    found["peak_rss"] = peak_rss()
    (out_dir / f"rank{found['rank']}.json").write_text(json.dumps(found))


def run_live(ranks: int = 2, timeout: float = 120.0) -> dict:
    """The live check: `ranks` ranks through `mlx.launch` (ring, this host), then one process alone, each
    bounded by `timeout` seconds. Returns {"ranks": [rank 0's findings, ...], "alone": {...}, "seconds":
    {"ranks": wall time, "alone": wall time}}; a failure raises RuntimeError with the ranks' last lines."""
    from .. import launch

    env_path = str(Path(__file__).resolve().parents[2])
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path  # the ranks import this checkout's qmtp
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            argv = ["-m", "qmtp.book.beyond", str(out)]
            err = io.StringIO()
            started = time.perf_counter()
            code = launch.run([*argv, "--ranked"], ranks=ranks, timeout=timeout, out=io.StringIO(), err=err)
            ranked_s = time.perf_counter() - started
            if code:
                raise RuntimeError(f"the {ranks} ranks failed (code {code}):\n{err.getvalue()[-2000:]}")
            found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
            started = time.perf_counter()
            subprocess.run([sys.executable, *argv], check=True, timeout=timeout, capture_output=True,
                           env=dict(os.environ))
            alone_s = time.perf_counter() - started
            alone = json.loads((out / "rank0.json").read_text())
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return {"ranks": found, "alone": alone, "seconds": {"ranks": ranked_s, "alone": alone_s}}


def compare(live: dict, reference: dict[str, list[int]]) -> list[dict]:
    """One row per (n_draft, temperature): whether every rank's tokens equal `reference` (the chapter's own
    single-process run), token for token, and where the first difference is if not."""
    rows = []
    for key, want in reference.items():
        n, t = key.split("/")
        for found in live["ranks"]:
            got = found["tokens"][key]
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                         None if len(got) == len(want) else min(len(got), len(want)))
            rows.append({"n_draft": int(n), "sampling": "greedy" if float(t) == 0 else f"temperature {t}",
                         "rank": found["rank"], "tokens": len(got), "equal": got == want,
                         "first difference": "-" if first is None else first})
    return rows


def memory_rows(live: dict, unit: float = 2**20) -> list[dict]:
    """Weights held and peak resident memory of each rank beside the single process's, in `unit` (MiB)."""
    alone = live["alone"]
    rows = [{"process": "one process", "experts held": alone["held"], "weights": alone["weights_bytes"] / unit,
             "peak RSS": alone["peak_rss"] / unit, "weights / one": 1.0, "RSS / one": 1.0}]
    for f in live["ranks"]:
        rows.append({"process": f"rank {f['rank']} of {f['ranks']}", "experts held": f["held"],
                     "weights": f["weights_bytes"] / unit, "peak RSS": f["peak_rss"] / unit,
                     "weights / one": f["weights_bytes"] / alone["weights_bytes"],
                     "RSS / one": f["peak_rss"] / alone["peak_rss"]})
    return rows


# ---- the family's members, sized per rank and per width ------------------------------------------------------
def members() -> list[tuple[str, object, str]]:
    """(member, config, provenance) of every member the chapter sizes: the 35B-A3B from its release, the others
    from third-party copies (`published.THIRD_PARTY_CONFIGS`), the 397B-A17B's other shared-expert reading last."""
    from ..config import QWEN36_35B_A3B
    from .published import THIRD_PARTY_CONFIGS

    out = [("35B-A3B", QWEN36_35B_A3B, "Qwen's config.json (the release)")]
    for c in THIRD_PARTY_CONFIGS:
        out.append((c.member, c.config, "third-party copies"))
        if c.other is not None:
            out.append((f"{c.member}, shared expert {c.other.shared_expert_intermediate_size}", c.other,
                        "third-party, the other reading"))
    return out


def member_rows(bits: int = 4, ranks=(1, 2, 4, 8), unit: float = GB) -> list[dict]:
    """One row per member (`members`): parameters as its name gives them and as its config counts them (total,
    and used per token by the trunk), experts per layer, and the bytes one of N expert-parallel ranks holds at a
    `bits`-wide trunk with the head in bf16 (`qmtp.sizes.per_rank_bytes`), in `unit`."""
    from ..sizes import parameter_counts, per_rank_bytes, sizes
    from .published import THIRD_PARTY_CONFIGS
    from .throughput import HEAD_BITS

    named = {c.member: c.named for c in THIRD_PARTY_CONFIGS} | {"35B-A3B": (35, 3)}
    rows = []
    for member, config, provenance in members():
        counts = parameter_counts(config)
        report = sizes(config, bits, mtp_bits=HEAD_BITS)
        total, active = named[member.split(",")[0]]
        row = {"member": member, "config from": provenance, "named B": f"{total} / {active}",
               "counted B": f"{counts['total'] / 1e9:.1f} / {counts['active'] / 1e9:.1f}",
               "experts": f"{config.num_experts}, top-{config.num_experts_per_tok}"}
        row.update({f"{n} rank" + ("" if n == 1 else "s"): per_rank_bytes(report, n) / unit for n in ranks})
        rows.append(row)
    return rows


def fit_table(machines_gb=(16, 32, 64, 128, 256), widths=(16, 8, 4)) -> list[dict]:
    """`fit_rows` for every member of `members()`, one table: member, width, whole GB and, per machine, the
    fewest ranks whose share and the runtime fit (None: not even 8)."""
    rows = []
    for member, config, _ in members():
        for row in fit_rows(config, machines_gb, widths, runtime=True):
            rows.append({"member": member, **row})
    return rows


# ---- several machines, priced by the calibrated cost model (`qmtp.book.cost_model`) ----------------------------
# How MLX sums one small array over N ranks, per backend, read from MLX's source: the ring (TCP, every platform)
# runs a reduce-scatter and an all-gather around the ring, 2 (N - 1) steps each sending 1/N of the array
# (`mlx/distributed/ring/ring.cpp`); JACCL's mesh (RDMA over Thunderbolt, macOS only) sends the whole array to
# every peer at once over each pair's own cable, one step (`mlx/distributed/jaccl/mesh_impl.h`); MPI leaves it to
# the MPI library, assumed here to take log2 N steps of the whole array (recursive doubling).
BACKENDS = {
    "ring": "MLX's ring (TCP); what `python -m qmtp ... --hostfile` starts",
    "jaccl": "MLX's JACCL (RDMA over Thunderbolt 5, macOS 26.2 or later only); started by `mlx.launch --backend jaccl`",
    "mpi": "MLX's MPI, over an MPI library built for RoCE; started by `mlx.launch --backend mpi`; not checked here",
}
BACKEND_OF = {"rdma_thunderbolt5": "jaccl", "tcp_between_macs": "ring", "tcp_strix_halo_1gbe": "ring",
              "tcp_strix_halo_100gbe": "ring", "roce_strix_halo": "mpi"}


def all_sum_steps(backend: str, ranks: int) -> tuple[int, float]:
    """(steps, share of the array each step sends) of one all_sum over `ranks` ranks (`BACKENDS`)."""
    if ranks == 1:
        return 0, 0.0
    if backend == "ring":
        return 2 * (ranks - 1), 1.0 / ranks
    if backend == "jaccl":
        return 1, 1.0
    if backend == "mpi":
        return math.ceil(math.log2(ranks)), 1.0
    raise KeyError(f"no all_sum rule for backend {backend!r}: {sorted(BACKENDS)}")


def all_sum_seconds(link, ranks: int, message_bytes: float) -> float:
    """Seconds of one all_sum of `message_bytes` over `ranks` machines joined by `link` (a `published.Link`):
    each step pays the link's published latency and its share of the array over the link's published bandwidth
    (Thunderbolt 5's rate where the source gives none)."""
    from .published import THUNDERBOLT_5_BITS

    steps, share = all_sum_steps(BACKEND_OF[link.key], ranks)
    bits_per_second = link.bandwidth_bits or THUNDERBOLT_5_BITS
    return steps * (link.seconds + share * message_bytes * 8 / bits_per_second)


def expert_output_bytes(config, n_tokens: int, dtype_bytes: int = 2) -> float:
    """Bytes of the [n_tokens, k, H] expert outputs one MoE layer's all_sum carries (`qmtp.parallel`), bf16."""
    return n_tokens * config.num_experts_per_tok * config.hidden_size * dtype_bytes


@dataclass(frozen=True)
class MachineKind:
    """Machines of one kind, each calibrated by a published plain decoding figure (`calibrating`: the 35B-A3B's
    row; `own`: other members' rows on the same machine), the memory one holds, and the links between them."""

    name: str
    calibrating: str  # key of a `published.FIELD` row
    own: dict  # member -> key of its own published row on this machine
    memory_gb: int
    links: tuple[str, ...]  # keys of `published.MACHINE_LINKS`, measured between machines of this kind


KINDS = (
    MachineKind("Apple M3 Ultra", "vllm_mlx_m3_ultra", {"122B-A10B": "vllm_mlx_m3_ultra_122b"}, 256,
                ("tcp_between_macs", "rdma_thunderbolt5")),
    MachineKind("AMD Strix Halo", "rocm_vllm_strix_halo_128", {}, 128,
                ("tcp_strix_halo_1gbe", "tcp_strix_halo_100gbe", "roce_strix_halo")),
)


def _row(key: str):
    from .cost_model import rows

    return next(r for r in rows() if r.key == key)


def _link(key: str):
    from .published import MACHINE_LINKS

    return next(k for k in MACHINE_LINKS if k.key == key)


@dataclass(frozen=True)
class Calibrated:
    """One machine of a kind for one member: its bandwidth, the context of the run it is calibrated by, and its
    overhead per pass (seconds beyond the bytes), from that member's own plain figure when one is published,
    else the 35B-A3B's scaled by the member's layers over the 35B-A3B's (a pass launches the same kernels per
    layer)."""

    kind: MachineKind
    member: str
    config: object
    bandwidth: float
    context: int
    overhead: float
    by: str  # which published row calibrates it, and how

    @classmethod
    def of(cls, kind: MachineKind, member: str, config) -> "Calibrated":
        from .cost_model import calibrate

        base = _row(kind.calibrating)
        own = kind.own.get(member)
        if own:
            row = _row(own)
            return cls(kind, member, config, row.bandwidth, row.context, calibrate(row).overhead,
                       f"{row.engine}'s plain {row.plain_tps:g} tok/s of the {member}")
        scale = config.num_hidden_layers / _config_of(base).num_hidden_layers
        how = (f"{base.engine}'s plain {base.plain_tps:g} tok/s of the 35B-A3B"
               + ("" if scale == 1 else f", its overhead x {scale:.2f} (layers)"))
        return cls(kind, member, config, base.bandwidth, base.context, calibrate(base).overhead * scale, how)


def _config_of(row):
    from .published import member_config

    return member_config(row.member)


def step_seconds(cal: Calibrated, n_draft: int, ranks: int, link, extra_position: float, bits: int = 4) -> float:
    """One step at `n_draft` on `ranks` machines of `cal`'s kind over `link` (None on one machine): the busiest
    rank's bytes of the verify pass and the n_draft - 1 head drafts over the bandwidth
    (`throughput.parallel_pass_seconds`, `parallel_head_seconds`), the machine's overhead of which each extra
    position pays `extra_position` (`cost_model`'s c), and one all_sum per MoE layer of the trunk (carrying
    n_draft tokens) and of each head draft (one token) over the link."""
    from ..sizes import sizes
    from .throughput import HEAD_BITS, Machine, parallel_head_seconds, parallel_pass_seconds

    config = cal.config
    report = sizes(config, bits, mtp_bits=HEAD_BITS)
    machine = Machine(cal.bandwidth)
    trunk = parallel_pass_seconds(config, report, n_draft, ranks, machine, 0.0, cal.context)
    head = parallel_head_seconds(config, report, ranks, machine, 0.0, cal.context)
    seconds = trunk + (n_draft - 1) * head + cal.overhead * (1 + extra_position * (n_draft - 1))
    if ranks > 1:
        seconds += config.num_hidden_layers * all_sum_seconds(link, ranks, expert_output_bytes(config, n_draft))
        seconds += (n_draft - 1) * all_sum_seconds(link, ranks, expert_output_bytes(config, 1))
    return seconds


def speeds(cal: Calibrated, ranks: int, link, bits: int = 4) -> dict[int, float]:
    """Predicted tokens/s at every n_draft of `cost_model.WIDTHS`, with c and the acceptance fitted on every
    published source (the fitted acceptance of the 35B-A3B's head, for every member: no other member's head
    acceptance is published with its width)."""
    from .cost_model import WIDTHS, fitted_without

    c, fit = fitted_without(None)
    return {n: fit.tokens_per_pass(n) / step_seconds(cal, n, ranks, link, c, bits) for n in WIDTHS}


def validated_error(kind: MachineKind, member: str = "35B-A3B") -> dict:
    """The out-of-sample errors of the published MTP row that calibrates `kind` (for `member`): with its own
    acceptance and with the fitted one (`cost_model.validate`), and the model's agreement over every row."""
    from .cost_model import agreement, validate

    key = kind.own.get(member, kind.calibrating)
    v = next(v for v in validate() if v.row.key == key)
    a = agreement(strict=True)
    return {"row": key, "error": v.error, "strict error": v.strict_error, "within 15%": a["within"][0.15],
            "comparable": a["comparable"], "median": agreement()["median_abs_error"]}


def cluster_rows(kind: MachineKind, bits: int = 4, ranks=(1, 2, 4)) -> list[dict]:
    """One row per (member, N) whose share of the weights and the runtime fit N machines of `kind`
    (`budget.fits`): per link of `kind`, plain tok/s, the best n_draft and its tok/s, with the calibration and
    the out-of-sample error of the row that calibrates it."""
    from ..sizes import per_rank_bytes, sizes
    from .budget import fits
    from .throughput import HEAD_BITS

    out = []
    for member, config, provenance in members():
        if "shared expert" in member:
            continue
        report = sizes(config, bits, mtp_bits=HEAD_BITS)
        cal = Calibrated.of(kind, member, config)
        err = validated_error(kind, member if member in kind.own else "35B-A3B")
        for n in ranks:
            held = per_rank_bytes(report, n)
            if not fits(held, kind.memory_gb):
                continue
            scale = config.num_hidden_layers / _config_of(_row(kind.calibrating)).num_hidden_layers
            short = ("own run" if member in kind.own else "35B run" + ("" if scale == 1 else f" ×{scale:.2f}"))
            row = {"member": member, "machines": n, "GB each": held / GB, "calibrated by": cal.by,
                   "calibration": short, "error": err["strict error"],
                   "third party": provenance != "Qwen's config.json (the release)"}
            for key in (kind.links if n > 1 else (None,)):
                link = _link(key) if key else None
                s = speeds(cal, n, link, bits)
                best = max(s, key=s.get)
                row[key or "one machine"] = {"plain": s[1], "best": s[best], "n_draft": best}
            out.append(row)
    return out


SHORT = {"rdma_thunderbolt5": "RDMA, TB5 (jaccl)", "tcp_between_macs": "TCP, Thunderbolt (ring)",
         "tcp_strix_halo_1gbe": "TCP, 1 GbE (ring)", "tcp_strix_halo_100gbe": "TCP, 100 GbE (ring)",
         "roce_strix_halo": "RoCE v2 (mpi)", "one machine": "alone"}  # table headers


def cluster_table(rows: list[dict], kind: MachineKind) -> list[dict]:
    """`cluster_rows` as table cells: per link "plain → best (its n_draft)" in tokens/s."""
    out = []
    for r in rows:
        cell = {"member": r["member"] + ("†" if r["third party"] else ""),
                "N": r["machines"], "GB/rank": f"{r['GB each']:.0f}"}
        for key in ("one machine", *kind.links):
            v = r.get(key)
            cell[SHORT[key]] = "-" if v is None else f"{v['plain']:.0f} → {v['best']:.0f} ({v['n_draft']})"
        cell["calibration (error)"] = f"{r['calibration']} ({r['error']:+.0%})"
        out.append(cell)
    return out


def scaling_rows(kind: MachineKind, member: str = "35B-A3B", ranks=(1, 2, 4, 8), bits: int = 4) -> list[dict]:
    """Predicted plain and best tok/s of `member` on 1 to 8 machines of `kind`, one series per link (one machine
    alone starts each), in the rows `qmtp.book.plots.machines_scaling` draws."""
    config = next(c for m, c, _ in members() if m == member)
    cal = Calibrated.of(kind, member, config)
    out = []
    for key in kind.links:
        for n in ranks:
            s = speeds(cal, n, _link(key) if n > 1 else None, bits)
            best = max(s, key=s.get)
            out.append({"memory": kind.name, "link": SHORT[key], "ranks": n, "plain tok/s": s[1],
                        "best tok/s": s[best], "best n_draft": best})
    return out


def link_rows() -> list[dict]:
    """Every link chapter 9 prices: between which machines, the MLX backend that uses it, its published latency
    and bandwidth, and the time of one all_sum of one token's expert outputs (35B-A3B) on 2 and 4 machines."""
    from ..config import QWEN36_35B_A3B
    from .published import MACHINE_LINKS, THUNDERBOLT_5_BITS

    rows = []
    message = expert_output_bytes(QWEN36_35B_A3B, 1)
    for k in MACHINE_LINKS:
        between = "Macs" if k.measured_on == "M3 Ultra" else f"{k.measured_on} boxes"
        rows.append({"link": k.name, "between": between, "backend": BACKEND_OF[k.key],
                     "latency": f"{k.bound} {k.seconds * 1e6:.0f} µs" if k.seconds >= 1e-5
                     else f"{k.bound} {k.seconds * 1e6:.1f} µs",
                     "bandwidth": (f"{k.bandwidth_bits / 1e9:.1f} Gb/s" if k.bandwidth_bits
                                   else f"≤ {THUNDERBOLT_5_BITS / 1e9:.0f} Gb/s (TB5's rate)"),
                     "all_sum, 2 / 4": " / ".join(f"{all_sum_seconds(k, n, message) * 1e6:.0f} µs" for n in (2, 4)),
                     "source": "{cite:t}`%s`" % k.source})
    return rows


def overhead_transfer_check() -> dict:
    """The one published pair that tests the rule `Calibrated.of` uses for a member with no plain figure of its own:
    the 122B-A10B's plain tok/s on the M3 Ultra predicted from the 35B-A3B's overhead scaled by layers, and
    unscaled, against the published figure."""
    from .cost_model import calibrate

    base, own = _row("vllm_mlx_m3_ultra"), _row("vllm_mlx_m3_ultra_122b")
    bytes_s = calibrate(own).bytes_seconds
    scale = _config_of(own).num_hidden_layers / _config_of(base).num_hidden_layers
    scaled = 1 / (bytes_s + calibrate(base).overhead * scale)
    same = 1 / (bytes_s + calibrate(base).overhead)
    return {"published": own.plain_tps, "scaled": scaled, "scaled error": scaled / own.plain_tps - 1,
            "unscaled": same, "unscaled error": same / own.plain_tps - 1, "scale": scale}


def cluster_summary(rows: list[dict], kind: MachineKind) -> dict:
    """What a kind's rows say, for the prose: the fastest case of each member (its machines, link, tok/s and
    n_draft), and, for each member that fits one machine, whether any several-machine case beats it."""
    out = {}
    for member in dict.fromkeys(r["member"] for r in rows):
        mine = [r for r in rows if r["member"] == member]
        cases = [(r["machines"], key, v) for r in mine for key, v in r.items()
                 if isinstance(v, dict) and "best" in v]
        machines, key, best = max(cases, key=lambda t: t[2]["best"])
        one = next((v for m, k, v in cases if m == 1), None)
        out[member] = {"machines": machines, "link": key, "best": best["best"], "n_draft": best["n_draft"],
                       "plain": best["plain"], "one machine": one,
                       "fewest": min(r["machines"] for r in mine), "gain": best["best"] / best["plain"]}
    return out


RDMA = ("rdma_thunderbolt5", "roce_strix_halo")  # the links that bypass TCP


def verdicts(rows_by_kind: list[tuple[MachineKind, list[dict]]]) -> dict:
    """What every kind's `cluster_rows` say together, as the chapter's prose words them: whether over TCP a
    member that fits one machine is slower on several in every case (`tcp`), how much faster several machines
    over RDMA get at most against one (`rdma_ratio`) and whether that is within the error of the calibrating
    run (`rdma_within`), and the best widths on one machine or over RDMA (`fast_widths`) and over TCP
    (`tcp_widths`)."""
    tcp_slower, ratios, errors, fast, slow, faster = [], [], [], set(), set(), []
    for kind, rows in rows_by_kind:
        one = {r["member"]: r["one machine"]["best"] for r in rows if r["machines"] == 1}
        for r in rows:
            errors.append(abs(r["error"]))
            for key in ("one machine", *kind.links):
                v = r.get(key)
                if v is None:
                    continue
                (slow if key not in RDMA and key != "one machine" else fast).add(v["n_draft"])
                if r["machines"] > 1 and r["member"] in one:
                    if key in RDMA:
                        ratios.append(v["best"] / one[r["member"]])
                    else:
                        tcp_slower.append(v["best"] < one[r["member"]])
                        if not tcp_slower[-1]:
                            faster.append((f"the {r['member']} on {r['machines']} {kind.name} machines over "
                                           f"{SHORT[key]}, {v['best']:.1f} tokens/s against "
                                           f"{one[r['member']]:.1f} on one", v["best"] / one[r["member"]]))
    ratio = max(ratios)
    span = lambda ns: f"{min(ns)}" if len(ns) == 1 else f"{min(ns)} to {max(ns)}"  # noqa: E731
    return {"tcp": "is slower on several in every case" if all(tcp_slower) else "is not always slower on several",
            "tcp_except": "" if not faster else " (the exception" + ("s: " if len(faster) > 1 else ": ")
            + "; ".join(text for text, _ in faster)
            + (", within" if max(g for _, g in faster) - 1 <= max(errors) else ", beyond") + " the model's error)",
            "rdma_ratio": ratio, "rdma_within": "within" if ratio - 1 <= max(errors) else "beyond",
            "fast_widths": span(fast), "tcp_widths": span(slow)}


# ---- the how-to ------------------------------------------------------------------------------------------------
def hostfile(hosts: list[tuple[str, str]], rdma: list[list[str | None]] | None = None) -> dict:
    """An mlx.launch hostfile for `hosts` ((ssh name, IP the ranks listen on) each): for the ring, a list of
    {"ssh", "ips"}; with `rdma` (one list per host naming, for each other host, the Thunderbolt port's RDMA
    device that cables them, None for itself), JACCL's form with "backend": "jaccl"."""
    entries = [{"ssh": ssh, "ips": [ip]} for ssh, ip in hosts]
    if rdma is None:
        return {"hosts": entries}
    if len(rdma) != len(hosts) or any(len(r) != len(hosts) or r[i] is not None for i, r in enumerate(rdma)):
        raise ValueError("rdma: one list per host, one device per host, None at the host's own place")
    return {"backend": "jaccl", "hosts": [dict(e, rdma=r) for e, r in zip(entries, rdma)]}


def jaccl_command(model: str, hostfile_path: str, *chat_args: str, backend: str = "jaccl") -> list[str]:
    """The command that runs `python -m qmtp chat MODEL ...` on the Macs of a JACCL hostfile: `mlx.launch` itself
    (qmtp's `--hostfile` starts the ring only), with the variable by which a qmtp rank knows it is one
    (`qmtp.launch.RANKS_ENV`). The prompt goes in `--prompt`: stdin reaches such ranks unrelayed. `backend`
    and `hostfile_path` ("-n 2" style arguments instead, see `direct_launch_check`) as `mlx.launch` takes them."""
    from ..launch import RANKS_ENV, launcher

    where = ["--hostfile", hostfile_path] if hostfile_path else []
    return [launcher(), "--backend", backend, *where, "--python", sys.executable,
            "--env", f"{RANKS_ENV}=1", "--", "-m", "qmtp", "chat", model, *chat_args]


def direct_launch_check(ranks: int = 2, timeout: float = 120.0) -> dict:
    """`jaccl_command`'s route run here with the ring in place of JACCL: `ranks` ranks of the bundled model
    started by `mlx.launch` directly, greedy at n_draft 3, and the same `python -m qmtp chat` in one process;
    {"command": the ranks' command, "ranks": what rank 0 printed, "alone": what one process printed,
    "seconds": the ranks' wall time}. A failure raises RuntimeError with the ranks' last lines."""
    from ..launch import free_ports
    from ..loading import BUNDLED_MODEL

    chat = ["--raw", "--temperature", "0", "--use-mtp", "--n-draft", "3", "--prompt", PROMPT,
            "--max-tokens", str(MAX_TOKENS)]
    cmd = jaccl_command(str(BUNDLED_MODEL), "", *chat, backend="ring")
    at = cmd.index("--python")
    cmd[at:at] = ["-n", str(ranks), "--starting-port", str(free_ports(ranks))]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd[cmd.index("--"):cmd.index("--")] = ["--env", f"PYTHONPATH={env['PYTHONPATH']}"]
    started = time.perf_counter()
    ranked = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    seconds = time.perf_counter() - started
    if ranked.returncode or "exited with code" in ranked.stderr:
        raise RuntimeError(f"the ranks failed (code {ranked.returncode}):\n{ranked.stderr[-2000:]}")
    alone = subprocess.run([sys.executable, "-m", "qmtp", "chat", str(BUNDLED_MODEL), *chat], capture_output=True,
                           text=True, timeout=timeout, env=env, check=True)
    return {"command": cmd, "ranks": ranked.stdout.strip(), "alone": alone.stdout.strip(), "seconds": seconds}


def backends_here() -> dict[str, bool]:
    """Which of MLX's distributed backends this MLX build can start (`mx.distributed.is_available`)."""
    import mlx.core as mx

    return {b: bool(mx.distributed.is_available(b)) for b in ("ring", "jaccl", "mpi", "nccl")}


def main() -> None:
    out, ranked = Path(sys.argv[1]), "--ranked" in sys.argv[2:]
    worker(out, ranked)


if __name__ == "__main__":
    main()
