"""Benchmarks that print tables and write JSON: `python -m qmtp bench decode|mtp [MODEL]`.

Machines are noisy, so every comparison is made inside one run: the variants are interleaved (qmtp, then
mlx-lm, then mlx-lm, then qmtp, ...; or plain, n_draft=2, 3, ... then again), each measured `repeats` times,
and the tables report medians, the spread (min to max) and ratios measured in the same rounds.

Decoding speed is counted the same way for every engine: the tokens after the first one over the time from
the first token to the last (the prompt's prefill is not timed).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import default_layer_types
from ..model import Model
from . import throughput
from .throughput import expected_union


# ---- plain decoding: qmtp against mlx-lm --------------------------------------------------------------------
def mlx_lm_model(path, dtype=None):
    """The same checkpoint loaded by mlx-lm (which drops the MTP head), its floating-point parameters cast to
    `dtype` (qmtp's compute dtype: float32 on the CPU, whose gather_mm computes only float32)."""
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    from ..loading import default_dtype

    dtype = dtype or default_dtype()
    model, _ = load_model(Path(path))
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def mlx_lm_twin(model: Model):
    """mlx-lm's own qwen3_5_moe model holding this qmtp model's arrays (shared, not copied): the same weights,
    quantized the same way, run by mlx-lm's code. For a model that exists only in memory (`real_width_model`),
    which mlx-lm cannot load from a folder. The two modules name their tensors alike (the release's names after
    both fixes) but for the routed experts, `experts` here and `switch_mlp` in mlx-lm; the head is left out
    (mlx-lm has none)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_5_moe

    twin = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(model.config.to_released_dict()))
    ours = dict(tree_flatten(model.parameters()))

    def theirs(name: str) -> str:
        name = name.replace(".mlp.experts.", ".mlp.switch_mlp.")
        return f"language_model.{name}" if name.startswith("lm_head.") else f"language_model.model.{name}"

    quantized = {name.rpartition(".")[0]: ours[name] for name in ours if name.endswith(".scales")}

    def same_width(path, module):
        ours_path = path.removeprefix("language_model.").removeprefix("model.").replace(".switch_mlp.",
                                                                                       ".experts.")
        scales = quantized.get(ours_path)
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        codes = ours[f"{ours_path}.weight"]
        bits = codes.shape[-1] * 32 // (scales.shape[-1] * 64)
        return {"group_size": 64, "bits": bits, "mode": "affine"}

    nn.quantize(twin, class_predicate=same_width)
    wanted = dict(tree_flatten(twin.parameters()))
    weights = [(theirs(n), w) for n, w in ours.items() if not n.startswith("mtp.")]
    missing = set(wanted) - {n for n, _ in weights}
    wrong = [n for n, w in weights if n not in wanted or wanted[n].shape != w.shape]
    if missing or wrong:
        raise ValueError(f"mlx-lm's model does not match: missing {sorted(missing)[:3]}, unmatched {wrong[:3]}")
    twin.update(tree_unflatten(weights))
    twin.eval()
    return twin


def _qmtp_decode(model: Model, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    from ..options import Engine
    from ..speculative import generate

    g = generate(model, prompt, max_tokens=max_tokens, n_draft=1, stop_at_eos=False,
                 engine=Engine(track_experts=False))
    return g.tokens, g.stats.decode_seconds


def _mlx_lm_decode(model, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    from mlx_lm.generate import generate_step

    tokens, first = [], None
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        if first is None:
            first = time.perf_counter()
    return tokens, time.perf_counter() - first


def decode(model: Model, prompts: list, max_tokens: int = 64, repeats: int = 5, reference=None) -> dict:
    """Plain greedy decoding tokens/s of qmtp and of mlx-lm on the same checkpoint and prompts, interleaved.

    Each round runs every prompt through both engines (the order alternates between rounds); a round's speed
    is its tokens after the first of each prompt over their time. The ratio qmtp/mlx-lm is taken per round
    and its median reported. Both engines must produce the same greedy tokens (`same_tokens`).
    """
    import mlx_lm

    engines = {"qmtp": lambda p: _qmtp_decode(model, p, max_tokens)}
    # Expert-parallel, qmtp alone: mlx-lm would load the whole model on every rank, and each rank's copy would
    # run beside the other's, which measures neither engine
    if model.shard is None:
        reference = reference if reference is not None else mlx_lm_model(model.path, model.dtype)
        engines["mlx-lm"] = lambda p: _mlx_lm_decode(reference, p, max_tokens)
    outputs = {name: [run(p)[0] for p in prompts] for name, run in engines.items()}  # warm-up, and the tokens
    mismatched = [i for i, (a, b) in enumerate(zip(outputs["qmtp"], outputs.get("mlx-lm", outputs["qmtp"]))) if a != b]
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(repeats):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            seconds = tokens = 0
            for p in prompts:
                out, s = engines[name](p)
                seconds += s
                tokens += len(out) - 1
            speeds[name].append(tokens / seconds)
    ratios = [a / b for a, b in zip(speeds["qmtp"], speeds.get("mlx-lm", []))] or [float("nan")]
    return {
        "model": str(model.path),
        "config": _config_summary(model),
        "dtype": str(model.dtype).replace("mlx.core.", ""),
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "max_tokens": max_tokens, "prompts": len(prompts), "repeats": repeats,
        "engines": {name: {"tokens_per_second": statistics.median(s), "tokens_per_second_min": min(s),
                           "tokens_per_second_max": max(s), "rounds": s} for name, s in speeds.items()},
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "same_tokens": not mismatched, "mismatched_prompts": mismatched,
        "ranks": model.shard.size if model.shard is not None else 1,
    }


def not_compared() -> dict:
    """What `decode` returns for a comparison a budget skips (a second whole model at full size): every speed
    NaN, so the chapters' glued numbers say so instead of inventing one."""
    nan = {"tokens_per_second": float("nan")}
    return {"engines": {"qmtp": nan, "mlx-lm": nan}, "ratio": float("nan"), "same_tokens": True}


def decode_table(report: dict) -> str:
    head = f"{'engine':>8} {'tok/s':>8} {'(min-max)':>17}"
    lines = [head, "-" * len(head)]
    for name, e in report["engines"].items():
        lines.append(f"{name:>8} {e['tokens_per_second']:>8.1f} {e['tokens_per_second_min']:>8.1f}-"
                     f"{e['tokens_per_second_max']:<8.1f}")
    if "mlx-lm" not in report["engines"]:
        lines.append(f"expert-parallel over {report['ranks']} ranks: qmtp alone (mlx-lm holds the whole model)")
        return "\n".join(lines)
    lines.append(f"qmtp/mlx-lm: {report['ratio']:.2f} (per round {report['ratio_min']:.2f} to {report['ratio_max']:.2f}); "
                 f"same greedy tokens: {'yes' if report['same_tokens'] else 'NO, prompts ' + str(report['mismatched_prompts'])}")
    return "\n".join(lines)


# The synthetic model `bench decode --scaled` measures: every layer at the real model's widths (hidden 2048,
# gated DeltaNet 16/32 heads of 128, attention 16 query / 2 KV heads of 256, experts of 512, top-8, shared
# expert 512), so one token's pass through a layer reads what one of the real model's 40 layers reads; but
# 4 layers (3 DeltaNet + 1 attention) instead of 40, 64 experts instead of 256, and a vocabulary of 32768
# instead of 248320 (at the real vocabulary lm_head's 4-bit matmul alone takes about 0.6 s per token on a
# small CPU and would drown the layers), so that the bf16 source (2.6 GB) and its 4-bit conversion (1.1 GB,
# the head kept bf16 as qmtp converts by default) fit a laptop's memory and disk.
SCALED_REAL_WIDTHS = dict(num_hidden_layers=4, layer_types=default_layer_types(4), num_experts=64,
                          vocab_size=32768, max_position_embeddings=4096)
SCALED_BITS = 4


def scaled_checkpoint(directory, bits: int = SCALED_BITS, progress: bool = False) -> Path:
    """Write (once) the synthetic model of SCALED_REAL_WIDTHS, converted to `bits`: returns its directory."""
    from ..config import QWEN36_35B_A3B
    from ..convert import convert
    from ..tiny.synthetic import write_checkpoint

    directory = Path(directory)
    converted = directory / f"{bits}bit"
    if (converted / "config.json").exists():
        return converted
    source = write_checkpoint(directory / "bf16", QWEN36_35B_A3B.replace(**SCALED_REAL_WIDTHS), dtype="BF16")
    convert(source, converted, bits=bits, progress=progress, force=True)
    return converted


# ---- the real widths, in memory ------------------------------------------------------------------------------
RESIDUAL_WRITES = ("o_proj", "out_proj", "down_proj")  # the projections that write into the residual stream


def real_width_model(layers: int = 4, bits: int = 4, seed: int = 0, independent_routing: bool = False,
                     **overrides) -> Model:
    """Qwen3.6-35B-A3B's first `layers` layers (3 DeltaNet, 1 attention), its head and its vocabulary at their
    real widths and expert counts, built in memory as a `bits`-bit conversion loads on a machine that stores it
    in bfloat16: the trunk quantized (routers at 8 bits), the head's 256 experts in bfloat16, computed in
    float32. Made to be timed, not to be read: the embeddings and the routers are seeded at random, so tokens
    route differently and a verify pass reads a realistic union of experts; every other weight is a constant
    (a product takes the same time whatever its values), which builds in seconds instead of minutes.
    Constant weights write one direction into the residual stream, which past the first layer pulls every
    token to the same experts; `independent_routing` zeroes the trunk's projections into the residual
    stream instead (`RESIDUAL_WRITES`), so that each layer routes a token by its own embedding: tokens choose
    their experts independently, as `under_load.experts_read` assumes, and a pass reads the union they make.
    `overrides`: config fields to change (the tests build it at small widths)."""
    import math

    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from .. import cores
    from ..config import QWEN36_35B_A3B
    from ..conventions import ROUTER_BITS, is_router

    config = QWEN36_35B_A3B.replace(num_hidden_layers=layers, layer_types=default_layer_types(layers), **overrides)
    model = Model(config)

    def width(path, module):
        if path.startswith("mtp.") or not hasattr(module, "to_quantized") or module.weight.shape[-1] % 64:
            return False
        return {"group_size": 64, "bits": ROUTER_BITS if is_router(f"{path}.weight") else bits, "mode": "affine"}

    nn.quantize(model, class_predicate=width)
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)))
    key = mx.random.key(seed)
    for name, p in tree_flatten(model.parameters()):
        key, draw = mx.random.split(key)
        path, _, leaf = name.rpartition(".")
        module = modules.get(path)
        seeded = name.startswith("embed_tokens.") or is_router(f"{path}.weight")
        if p.dtype == mx.uint32:  # codes
            w = (mx.random.randint(0, 2**31 - 1, p.shape, dtype=mx.int32, key=draw).view(mx.uint32) if seeded
                 else mx.full(p.shape, 0x7777_7777, mx.uint32))
        elif leaf in ("scales", "biases"):  # values spread over +-1/sqrt(fan-in), as a random init would be
            reach = 1 / math.sqrt(module.weight.shape[-1] * 32 // module.bits)
            w = mx.full(p.shape, 2 * reach / (2**module.bits - 1)) if leaf == "scales" else mx.full(p.shape, -reach)
        elif name.endswith("norm.weight"):
            w = mx.ones(p.shape)
        else:
            dtype = mx.bfloat16 if ".experts." in name else mx.float32
            w = ((mx.random.normal(p.shape, key=draw) / math.sqrt(p.shape[-1])).astype(dtype) if seeded
                 else mx.full(p.shape, 0.5 / math.sqrt(p.shape[-1]), dtype))
        if (independent_routing and not name.startswith("mtp.") and path.rpartition(".")[2] in RESIDUAL_WRITES
                and leaf in ("scales", "biases", "weight") and p.dtype != mx.uint32):
            w = mx.zeros(p.shape, p.dtype)
        model.update(tree_unflatten([(name, w)]))
        mx.eval(w)
    model.eval()
    model._lm_head_split = cores.split_lm_head(model.lm_head)
    return model


def real_width_passes(model: Model, prompt: list[int], n_drafts=(2, 3), budget: float = 4.0) -> dict:
    """What one plain pass, one verify pass over each of `n_drafts` tokens and one head draft cost on this
    machine (`interleaved_pass_costs`, every width in the same rounds, `budget` seconds of timed calls per
    width), beside what they read (`throughput`, independent routing): if time followed bytes, as on a
    memory-bound machine, each ratio to the plain pass would be its bytes' ratio."""
    config = model.config
    in_memory = throughput.sizes_of(model)
    cache_bytes = 4 if model.dtype == mx.float32 else 2
    context = len(prompt)
    widths = tuple(dict.fromkeys((1, *n_drafts)))
    costs = interleaved_pass_costs(model, prompt, widths, budget=budget * len(widths))
    plain = costs[1]["verify"]
    plain_bytes = throughput.total(throughput.trunk_pass_bytes(config, in_memory, 1, context, None, cache_bytes))
    rows = [{"pass": "plain, 1 token", "seconds": plain, "bytes": plain_bytes}]
    for n in n_drafts:
        rows.append({"pass": f"verify, {n} tokens", "seconds": costs[n]["verify"], "bytes": throughput.total(
            throughput.trunk_pass_bytes(config, in_memory, n, context, None, cache_bytes))})
    head = min(costs[n]["head_per_draft"] for n in n_drafts)
    rows.append({"pass": "head draft", "seconds": head, "bytes": throughput.total(
        throughput.head_step_bytes(config, in_memory, context, cache_bytes))})
    for r in rows:
        r["time_over_plain"] = r["seconds"] / plain
        r["bytes_over_plain"] = r["bytes"] / plain_bytes
    return {"layers": config.num_hidden_layers, "experts": config.num_experts, "vocab": config.vocab_size,
            "rows": rows, "rounds": costs[1]["rounds"]}


# ---- speculative decoding: n_draft 1 to 5 -------------------------------------------------------------------
PASS_BUDGET_S = 10.0  # seconds of timed calls `interleaved_pass_costs` spends at most, after its third round


def pass_costs(model: Model, prompt: list[int], n_draft: int, repeats: int = 30, budget: float = PASS_BUDGET_S) -> dict:
    """`interleaved_pass_costs` for one width: its verify pass and head draft step, timed alone."""
    return interleaved_pass_costs(model, prompt, (n_draft,), rounds=repeats, budget=budget)[n_draft]


def interleaved_pass_costs(model: Model, prompt: list[int], n_drafts, rounds: int = 200,
                           budget: float = PASS_BUDGET_S, warm: int = 3) -> dict[int, dict]:
    """Seconds of one verify pass over `n_draft` tokens and of one head draft step at each of `n_drafts`, each
    compiled and timed from the state after `prompt` (inside a generation the passes overlap with the host's
    work and cannot be told apart). A head draft step is the drafting of one step (the head over the last pass's
    positions, then each draft) divided by its drafts.

    Every shape is first called `warm` times (the first calls trace and compile; fewer once a shape's warm-up
    has taken its share of half the budget); then each round calls every
    shape once, in an order that shifts by one shape from round to round, until `rounds` rounds or, after at
    least three, `budget` seconds of timed calls. A slow spell of a shared machine (they last seconds) then
    falls on every width alike, where widths timed one after another would each meet their own spell and could
    come out in the wrong order. Per width: the medians over the rounds ("verify", and "head_per_draft" where
    the width drafts) and "rounds", the calls each shape was timed."""
    from .. import acceptance, decoding
    from ..parallel import rank0_decides
    from ..continuous import prefill

    greedy = acceptance.Greedy()
    calls = {}  # (n_draft, "verify" | "draft") -> a compiled call from that width's state
    for n in n_drafts:
        k = n - 1
        state, last, _ = prefill(model, model.mtp if k else None, prompt,
                                  decoding.capacity_for(len(prompt) + 2 * n), n, greedy, "post", mx.random.key(0))
        tokens = mx.array([[last[1][0, 0].item()] * n], mx.int32)
        verify = mx.compile(lambda s, t, k=k: model.logits(decoding.trunk_step(model, t, s, k > 0)[1]),
                            inputs=[model.state])
        calls[n, "verify"] = lambda verify=verify, state=state, tokens=tokens: verify(state, tokens)
        if k:
            draft = mx.compile(lambda s, l, k=k: decoding.draft(model, model.mtp, k, (greedy,), (k,), s, l,
                                                                [mx.array(0)])[0], inputs=[model.state])
            calls[n, "draft"] = lambda draft=draft, state=state, last=last: draft(state, last)
    agree = rank0_decides(model.shard) or (lambda value: value)  # expert-parallel: every rank stops with rank 0

    def timed(call) -> float:
        started = time.perf_counter()
        mx.eval(call())
        return time.perf_counter() - started

    for call in calls.values():  # at the real model's size a pass takes seconds: warm-up stops at half the budget
        warmed = 0.0
        for _ in range(warm):
            warmed += timed(call)
            if agree(warmed > budget / 2 / len(calls)):
                break
    shapes = list(calls)
    times = {shape: [] for shape in shapes}
    spent = 0.0
    for r in range(rounds):
        shift = r % len(shapes)
        for shape in shapes[shift:] + shapes[:shift]:
            times[shape].append(timed(calls[shape]))
            spent += times[shape][-1]
        if agree(r + 1 >= 3 and spent > budget):
            break
    out = {}
    for n in n_drafts:
        out[n] = {"verify": statistics.median(times[n, "verify"]), "rounds": len(times[n, "verify"])}
        if n > 1:
            out[n]["head_per_draft"] = statistics.median(times[n, "draft"]) / (n - 1)
    return out


def _median_seconds(run, repeats: int, budget: float = 10.0, agree=None) -> float:
    """Median seconds of `run` over up to `repeats` timed calls, after warm-up calls (the first traces and
    compiles). At the real model's size a pass can take seconds: the calls stop once they have taken
    `budget` seconds, after at least three. `agree`: ranks running each call together stop when rank 0 does
    (`parallel.rank0_decides`)."""
    agree = agree or (lambda value: value)
    warm = []
    for _ in range(3):
        started = time.perf_counter()
        mx.eval(run())
        warm.append(time.perf_counter() - started)
        if agree(sum(warm) > budget / 2):
            break
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - started)
        if agree(len(times) >= 3 and sum(times) > budget):
            break
    return statistics.median(times)


# The decoding loop with what makes it lean taken away, one thing then both (`bench.mtp`'s ablation): the
# step's graph built op by op instead of replayed from its compiled trace, and each step's tokens read before
# the next step is queued.
ABLATIONS = {"not queued ahead": dict(queue_ahead=False), "eager, not queued ahead": dict(compiled=False,
                                                                                         queue_ahead=False)}


NOISE = 0.05  # a ratio of speeds within 5% of 1 is no measurable difference on a shared machine


def lean_loop_effects(ablation: list[dict]) -> dict[int, dict[str, float]]:
    """What each half of the lean loop is worth at each ablated n_draft, from `mtp`'s "ablation" rows (each a
    variant's median, over the rounds, of its speed over the lean loop's in the same round): "trace", the
    compiled step over the eager one, both reading each step before queueing the next; "queue ahead", the lean
    loop over the same compiled loop without queueing ahead; "both", the lean loop over the eager, unqueued one.
    A value above 1 means that half makes decoding faster."""
    unqueued = {r["n_draft"]: r["over_lean"] for r in ablation if r["loop"] == "not queued ahead"}
    eager = {r["n_draft"]: r["over_lean"] for r in ablation if r["loop"] == "eager, not queued ahead"}
    return {n: {"trace": unqueued[n] / eager[n], "queue ahead": 1 / unqueued[n], "both": 1 / eager[n]}
            for n in unqueued}


def effect_phrase(what: str, ratio: float, tolerance: float = NOISE) -> str:
    """A speed ratio (with `what` over without it) as a reader reads it: faster, slower, or no measurable
    difference, with the number."""
    if ratio > 1 + tolerance:
        return f"{what} makes decoding faster, {ratio:.2f}x"
    if ratio < 1 - tolerance:
        return f"{what} makes decoding slower, {ratio:.2f}x"
    return f"{what} makes no difference beyond the {tolerance:.0%} of noise ({ratio:.2f}x)"


def mtp(model: Model, prompts: list, max_tokens: int = 64, n_drafts=(1, 2, 3, 4, 5), repeats: int = 3,
        peer=None, auto: bool = True, ablate=()) -> dict:
    """Plain vs speculative decoding on the same prompts, interleaved; one record per n_draft.

    Speed is tokens after the first over the time from the first token to the last, per round over all
    prompts; the record keeps the median and the spread of the rounds. Besides acceptance, each record holds
    the phases of the decoding loop (`speculative.PhaseTimer`), the distinct experts each verify pass read
    per layer (measured, and the independent-routing formula), the seconds of a verify pass and of a head
    draft step (`interleaved_pass_costs`: every width in the same rounds), and the ideal speedup: tokens per pass / (1 + head share), what drafting
    would give if a verify pass cost what a plain pass costs. "cost_model" prices each step from the passes
    (`_fit_and_predict`). `peer`: a `qmtp.book.peer.MlxVlmEngine`, run on the same prompts in the same rounds. `auto`:
    n_draft="auto" in the same rounds too, reported against the best fixed n_draft ("auto" in the report).
    `ablate`: n_drafts at which the loop also runs without queueing ahead and without compiling (ABLATIONS),
    in the same rounds ("ablation": tok/s, and over the lean loop).
    """
    from ..errors import UsageError
    from ..options import Engine
    from ..speculative import PhaseTimer, generate

    if not set(ablate) <= set(n_drafts):
        raise UsageError(f"ablate={sorted(ablate)}: ablate only n_drafts the bench runs ({min(n_drafts)}..{max(n_drafts)})")
    engines = {("qmtp", n): (lambda p, n=n, t=None: generate(model, p, max_tokens=max_tokens, n_draft=n,
                                                              stop_at_eos=False,
                                                              engine=Engine(timer=t, track_experts=True)))
               for n in n_drafts}
    if auto:
        engines[("qmtp", "auto")] = lambda p, t=None: generate(model, p, max_tokens=max_tokens, n_draft="auto",
                                                                stop_at_eos=False,
                                                                engine=Engine(timer=t, track_experts=True))
    for variant, settings in ABLATIONS.items():
        engines.update({(f"qmtp {variant}", n): (lambda p, n=n, t=None, s=settings: generate(
            model, p, max_tokens=max_tokens, n_draft=n, stop_at_eos=False, engine=Engine(track_experts=True, **s)))
            for n in ablate})
    if peer is not None:
        engines.update({("mlx-vlm", n): (lambda p, n=n, t=None: peer.generate(p, max_tokens, n)) for n in n_drafts})
    # every qmtp run tracks its experts (the fixed widths' are read below), so that all are timed alike
    # warm-up: the first passes of each shape trace and compile (auto's, as it first uses each width)
    warm_up = {name: run(prompts[0]) for name, run in engines.items()}
    speeds = {name: [] for name in engines}
    first_token = {name: [] for name in engines}  # seconds from the call to the first token, every run
    outputs, timers = {}, {n: PhaseTimer() for n in [*n_drafts, "auto"]}
    names = list(engines)
    # decode seconds over every round: the phase timers add up every round too, so a step's mean time over the
    # same runs bounds its phases (a median speed comes from other rounds than a slow spell's)
    all_seconds = dict.fromkeys(names, 0.0)
    for r in range(repeats):
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        results = {name: [] for name in names}
        # Every prompt goes through every engine before the next prompt, in an order that rotates from prompt
        # to prompt: a slow spell of the machine (they last seconds here) then falls on all engines alike.
        for i, p in enumerate(prompts):
            shift = (i + r * len(prompts)) % len(names)
            for name in names[shift:] + names[:shift]:
                if name[0].startswith("qmtp"):
                    out = engines[name](p, t=timers[name[1]] if name[0] == "qmtp" else None)
                    seconds[name] += out.stats.decode_seconds
                    first_token[name].append(out.stats.first_token_seconds)
                    tokens[name] += out.stats.generated - 1
                else:
                    out = engines[name](p)
                    seconds[name] += out["seconds"]
                    tokens[name] += len(out["tokens"]) - 1
                results[name].append(out)
        for name in names:
            speeds[name].append(tokens[name] / seconds[name])
            all_seconds[name] += seconds[name]
            outputs.setdefault(name, results[name])  # greedy: every round makes the same tokens
    config = model.config
    E, k = config.num_experts, config.num_experts_per_tok
    in_memory = throughput.sizes_of(model)
    cache_bytes = 4 if model.dtype == mx.float32 else 2
    context = statistics.mean(len(p) for p in prompts) + max_tokens / 2
    costs = interleaved_pass_costs(model, prompts[0], n_drafts)
    plain_pass = costs[min(n_drafts)]["verify"]
    plain_tokens = [g.tokens for g in outputs[("qmtp", min(n_drafts))]]
    results = []
    for n in n_drafts:
        first = [g.stats for g in outputs[("qmtp", n)]]
        passes = [(t, e) for s in first for t, e in zip(s.tokens_per_pass, s.experts_per_pass)]
        experts = np.array([e for _, e in passes], dtype=float)  # [passes, layers]
        tokens_in_pass = [t for t, _ in passes]
        emitted = sum(len(step.emitted) for s in first for step in s.steps)
        measured_union = experts.mean(axis=0).tolist()
        independent = float(np.mean([expected_union(E, k, t) for t in tokens_in_pass]))
        tokens_per_pass = emitted / len(passes)
        head = costs[n].get("head_per_draft", 0.0)
        phases = timers[n].seconds
        decode = sum(s.decode_seconds for s in first) * repeats
        results.append({
            "n_draft": n,
            "tokens_per_second": statistics.median(speeds[("qmtp", n)]),
            "tokens_per_second_min": min(speeds[("qmtp", n)]),
            "tokens_per_second_max": max(speeds[("qmtp", n)]),
            "acceptance_per_position": _acceptance([s.drafted for s in first], [s.accepted for s in first]),
            "tokens_per_trunk_pass": tokens_per_pass,
            "first_token_seconds": statistics.median(first_token[("qmtp", n)]),
            "same_tokens_as_plain": [g.tokens for g in outputs[("qmtp", n)]] == plain_tokens,
            "head_share": (n - 1) * head / ((n - 1) * head + costs[n]["verify"]),
            "ideal_speedup": tokens_per_pass / (1 + (n - 1) * head / plain_pass),
            "phase_seconds_per_pass": {name: t / (repeats * len(passes)) for name, t in phases.items()
                                       if name not in ("prefill", "host")},  # before the first token; the books
            "decode_seconds_per_pass": decode / (repeats * len(passes)),
            "step_seconds_mean": all_seconds[("qmtp", n)] / (repeats * len(passes)),
            "tokens_in_verify_pass": statistics.mean(tokens_in_pass),
            "experts_per_layer_measured": measured_union,
            "experts_per_layer_independent": independent,
            "experts_per_pass_measured": float(experts.mean()),
            "experts_per_pass_independent": independent,
            "union_measured_over_independent": float(experts.mean()) / independent,
            "trunk_seconds_per_pass": costs[n]["verify"],
            "head_seconds_per_draft": head,
            "trunk_bytes_per_pass": throughput.total(
                throughput.trunk_pass_bytes(config, in_memory, n, context, measured_union, cache_bytes)),
            "trunk_bytes_per_pass_independent": throughput.total(
                throughput.trunk_pass_bytes(config, in_memory, n, context, None, cache_bytes)),
            "head_bytes_per_draft": throughput.total(throughput.head_step_bytes(config, in_memory, context, cache_bytes)),
        })
    plain = next((r["tokens_per_second"] for r in results if r["n_draft"] == 1), None)
    for r in results:
        r["speedup_vs_plain"] = r["tokens_per_second"] / plain if plain else None
    from .. import blas

    report = {"model": str(model.path), "config": _config_summary(model), "max_tokens": max_tokens,
              "prompts": len(prompts), "repeats": repeats, "context": context, "blas": blas.describe(),
              "results": results, "pass_rounds": costs[min(n_drafts)]["rounds"]}
    report["cost_model"] = _fit_and_predict(model, in_memory, results, context, cache_bytes)
    if auto:
        report["auto"] = _auto_report(outputs[("qmtp", "auto")], speeds[("qmtp", "auto")], results, plain_tokens,
                                      timers["auto"], repeats, first_token[("qmtp", "auto")])
    if ablate:
        report["ablation"] = [{"loop": variant, "n_draft": n, "tokens_per_second": statistics.median(speeds[(f"qmtp {variant}", n)]),
                               "over_lean": statistics.median(a / b for a, b in zip(speeds[(f"qmtp {variant}", n)],
                                                                                    speeds[("qmtp", n)])),
                               "same_tokens_as_lean": [g.tokens for g in outputs[(f"qmtp {variant}", n)]]
                               == [g.tokens for g in outputs[("qmtp", n)]]}
                              for variant in ABLATIONS for n in ablate]
    if peer is not None:
        report["peer"] = _peer_report(peer, outputs, speeds, n_drafts, plain_tokens, results)
    return report


def _acceptance(proposed: list[list[int]], accepted: list[list[int]]) -> list[float | None]:
    """Per draft position over all runs: accepted over proposed (None where nothing was proposed)."""
    if not proposed or not len(proposed[0]):
        return []
    proposed, accepted = np.sum(proposed, axis=0), np.sum(accepted, axis=0)
    return [float(a / d) if d else None for a, d in zip(accepted, proposed)]


def _auto_report(runs: list, speeds: list[float], results: list[dict], plain_tokens: list, timer, repeats: int,
                 first_token: list[float]) -> dict:
    """n_draft="auto" beside the fixed widths of the same rounds: its speed over plain and over the best fixed
    width, how often it chose each width, its acceptance, and its time to the first token over plain
    decoding's (it times nothing before the first token: it learns the widths' costs as it decodes)."""
    stats = [g.stats for g in runs]
    best = max(results, key=lambda r: r["tokens_per_second"])
    plain = next((r["tokens_per_second"] for r in results if r["n_draft"] == 1), None)
    tps = statistics.median(speeds)
    widths = [w for s in stats for w in s.tokens_per_pass]
    passes = len(widths)
    return {"tokens_per_second": tps, "tokens_per_second_min": min(speeds), "tokens_per_second_max": max(speeds),
            "speedup_vs_plain": tps / plain if plain else None,
            "best_fixed_n_draft": best["n_draft"], "over_best_fixed": tps / best["tokens_per_second"],
            "width_share": {n: widths.count(n) / passes for n in sorted(set(widths))},
            "tokens_per_trunk_pass": sum(len(st.emitted) for s in stats for st in s.steps) / passes,
            "acceptance_per_position": _acceptance([s.drafted for s in stats], [s.accepted for s in stats]),
            "same_tokens_as_plain": [g.tokens for g in runs] == plain_tokens,
            "first_token_seconds": statistics.median(first_token),
            "first_token_over_plain": statistics.median(first_token) / next(
                (r["first_token_seconds"] for r in results if r["n_draft"] == 1), float("nan")),
            "phase_seconds_per_pass": {name: t / (repeats * passes) for name, t in timer.seconds.items()
                                       if name not in ("prefill", "host")}}


def _peer_report(peer, outputs: dict, speeds: dict, n_drafts, plain_tokens: list, results: list) -> dict:
    """mlx-vlm beside qmtp: tok/s, acceptance, its MTP output against its own plain output and qmtp's."""
    ours = {r["n_draft"]: r["tokens_per_second"] for r in results}
    plain = [g["tokens"] for g in outputs[("mlx-vlm", min(n_drafts))]]
    rows = []
    for n in n_drafts:
        runs = outputs[("mlx-vlm", n)]
        tps = statistics.median(speeds[("mlx-vlm", n)])
        rows.append({"n_draft": n, "tokens_per_second": tps, "tokens_per_second_min": min(speeds[("mlx-vlm", n)]),
                     "tokens_per_second_max": max(speeds[("mlx-vlm", n)]),
                     "acceptance_per_position": _acceptance([g["proposed"] for g in runs], [g["accepted"] for g in runs]),
                     "same_tokens_as_own_plain": [g["tokens"] for g in runs] == plain,
                     "same_tokens_as_qmtp": [g["tokens"] for g in runs] == plain_tokens,
                     "qmtp_over_peer": ours[n] / tps})
    best_ours = max(ours.values())
    best_peer = max(r["tokens_per_second"] for r in rows)
    return {"engine": f"mlx-vlm {peer.version}", "results": rows, "best_qmtp_over_best_peer": best_ours / best_peer}


def _fit_and_predict(model: Model, in_memory, results: list[dict], context: float, cache_bytes: int) -> dict | None:
    """Price each speculative step and predict its speedup over the measured plain decoding, two ways.

    The bytes model (`throughput.fit_machine`: overhead + bytes / bandwidth, fitted to the verify passes and
    head steps timed alone) is what a memory-bound machine follows; "bytes_intercept" is where the unclamped
    line of time against bytes crosses zero bytes: below zero, time grows faster than bytes and the bytes model
    (its overhead clamped at 0) cannot fit. The loop model (`throughput.fit_loop`: a line in the pass's tokens,
    the mean head draft, and the loop's own cost per step taken from plain decoding) is what a dispatch-bound
    machine follows; its prediction is "predicted_speedup". Each prediction carries the step measured two ways:
    its passes timed alone ("measured_step_seconds") and its step in the loop, tokens per pass over tokens per
    second ("loop_step_seconds"), whose difference is the loop's own cost.
    """
    verify = [r for r in results if r["n_draft"] > 1]
    plain = next((r for r in results if r["n_draft"] == 1), None)
    if len(verify) < 2 or plain is None or model.mtp is None:
        return None
    try:
        machine = throughput.fit_machine(
            [r["trunk_bytes_per_pass"] for r in verify], [r["trunk_seconds_per_pass"] for r in verify],
            [r["head_bytes_per_draft"] for r in verify], [r["head_seconds_per_draft"] for r in verify],
        )
    except ValueError:
        machine = None
    intercept, _ = throughput.fit_line([r["trunk_bytes_per_pass"] for r in verify],
                                       [r["trunk_seconds_per_pass"] for r in verify])
    loop = throughput.fit_loop([r["n_draft"] for r in verify], [r["trunk_seconds_per_pass"] for r in verify],
                               [r["head_seconds_per_draft"] for r in verify], 1.0 / plain["tokens_per_second"])
    plain_seconds = plain["trunk_seconds_per_pass"]
    predictions = []
    for r in results:
        n = r["n_draft"]
        rates = [a or 0.0 for a in r["acceptance_per_position"]]
        tau = adaptive_tau(rates, n)
        by_bytes = float("nan")
        if machine is not None:
            p = throughput.predicted_speedup(model.config, in_memory, rates, n, machine, int(context),
                                             union=r["experts_per_layer_measured"], cache_bytes=cache_bytes)
            by_bytes = p.tokens_per_pass * plain_seconds / (plain_seconds if n == 1 else p.step_seconds)
        predictions.append({
            "n_draft": n, "tokens_per_pass": tau,
            "predicted_step_seconds": loop.step_seconds(n),
            "predicted_pass_seconds": loop.pass_seconds(n),
            "measured_step_seconds": r["trunk_seconds_per_pass"] + (n - 1) * r["head_seconds_per_draft"],
            "loop_step_seconds": r["tokens_per_trunk_pass"] / r["tokens_per_second"],
            "predicted_speedup": loop.speedup(tau, n),
            "bytes_model_speedup": by_bytes,
            "measured_speedup": r["speedup_vs_plain"],
        })
    return {"bandwidth": machine.bandwidth if machine else float("nan"),
            "overhead": machine.overhead if machine else float("nan"),
            "head_overhead": machine.head_overhead if machine else float("nan"),
            "bytes_intercept": intercept, "loop_overhead": loop.loop_overhead, "pass_fixed": loop.pass_fixed,
            "pass_per_token": loop.pass_per_token, "head_per_draft": loop.head_per_draft,
            "plain_seconds_measured": plain_seconds, "plain_loop_seconds": 1.0 / plain["tokens_per_second"],
            "predictions": predictions}


def adaptive_tau(rates, n_draft: int) -> float:
    """Expected tokens per pass at `n_draft` from per-position rates (`adaptive.expected_tokens_per_pass`)."""
    from ..adaptive import expected_tokens_per_pass

    return expected_tokens_per_pass(list(rates)[: n_draft - 1])


def mtp_table(report: dict) -> str:
    head = (f"{'n_draft':>7} {'tok/s':>7} {'(min-max)':>13} {'vs plain':>8} {'ideal':>6} {'predicted':>9} "
            f"{'tok/pass':>8} {'verify ms':>9} {'head ms':>7} {'build/sync ms':>13} {'lossless':>8} {'experts':>7}"
            f"  acceptance per position")
    lines = [f"matrix products: {report['blas']}", head, "-" * len(head)]
    predicted = {p["n_draft"]: p["predicted_speedup"] for p in (report.get("cost_model") or {}).get("predictions", [])}
    for r in report["results"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"] if a is not None) or "-"
        guess = f"{predicted[r['n_draft']]:>9.2f}" if r["n_draft"] in predicted else f"{'-':>9}"
        phases = r["phase_seconds_per_pass"]
        host = f"{phases.get('build', 0) * 1e3:.2f}/{phases.get('sync', 0) * 1e3:.2f}"
        lines.append(
            f"{r['n_draft']:>7} {r['tokens_per_second']:>7.1f} "
            f"{r['tokens_per_second_min']:>6.1f}-{r['tokens_per_second_max']:<6.1f} {r['speedup_vs_plain']:>8.2f} "
            f"{r['ideal_speedup']:>6.2f} {guess} {r['tokens_per_trunk_pass']:>8.2f} "
            f"{r['trunk_seconds_per_pass'] * 1e3:>9.2f} {r['head_seconds_per_draft'] * 1e3:>7.2f} {host:>13} "
            f"{'yes' if r['same_tokens_as_plain'] else 'NO':>8} {r['experts_per_pass_measured']:>7.1f}  {acc}"
        )
    lines.append("ideal: tokens per pass / (1 + head share), the speedup if a verify pass cost a plain pass; verify "
                 "and head ms: each compiled and timed alone; build/sync: per pass, the host's time to queue a pass "
                 "and to wait for its tokens; lossless: greedy tokens equal plain greedy's")
    lines.append("experts per layer, measured (independent routing E(1-(1-k/E)^n) in brackets):")
    for r in report["results"]:
        per_layer = " ".join(f"{e:5.1f}" for e in r["experts_per_layer_measured"])
        lines.append(f"  n_draft={r['n_draft']}: {per_layer}   ({r['experts_per_layer_independent']:.1f})")
    cost = report.get("cost_model")
    if cost:
        lines.append(f"cost model, the loop: {cost['loop_overhead'] * 1e3:.2f} ms per step in the loop + "
                     f"{cost['pass_fixed'] * 1e3:.2f} ms per pass + {cost['pass_per_token'] * 1e3:.2f} ms per token "
                     f"+ {cost['head_per_draft'] * 1e3:.2f} ms per head draft (\"predicted\"); time against bytes "
                     f"crosses zero bytes at {cost['bytes_intercept'] * 1e3:.2f} ms")
    auto = report.get("auto")
    if auto:
        shares = ", ".join(f"{n}: {share:.0%}" for n, share in auto["width_share"].items())
        lines.append(f"n_draft=auto: {auto['tokens_per_second']:.1f} tok/s ({auto['tokens_per_second_min']:.1f}-"
                     f"{auto['tokens_per_second_max']:.1f}), {auto['speedup_vs_plain']:.2f}x plain, "
                     f"{auto['over_best_fixed']:.2f}x the best fixed (n_draft={auto['best_fixed_n_draft']}); "
                     f"{auto['tokens_per_trunk_pass']:.2f} tokens/pass; widths chosen {shares}; lossless "
                     f"{'yes' if auto['same_tokens_as_plain'] else 'NO'}")
        fixed = ", ".join(f"n_draft={r['n_draft']} {r['first_token_seconds'] * 1e3:.1f}" for r in report["results"])
        lines.append(f"time to first token (median, ms): {fixed}, auto {auto['first_token_seconds'] * 1e3:.1f} "
                     f"({auto['first_token_over_plain']:.2f}x plain)")
    for r in report.get("ablation", ()):
        lines.append(f"loop {r['loop']}, n_draft={r['n_draft']}: {r['tokens_per_second']:.1f} tok/s, "
                     f"{r['over_lean']:.2f}x the lean loop; same tokens {'yes' if r['same_tokens_as_lean'] else 'NO'}")
    peer = report.get("peer")
    if peer:
        lines.append(f"{peer['engine']} on the same checkpoint and prompts, interleaved in the same rounds:")
        lines.append(f"{'n_draft':>7} {'tok/s':>7} {'(min-max)':>13} {'qmtp/peer':>9} {'own plain':>9} {'= qmtp':>6}  acceptance")
        for r in peer["results"]:
            acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"] if a is not None) or "-"
            lines.append(f"{r['n_draft']:>7} {r['tokens_per_second']:>7.1f} {r['tokens_per_second_min']:>6.1f}-"
                         f"{r['tokens_per_second_max']:<6.1f} {r['qmtp_over_peer']:>9.2f} "
                         f"{'yes' if r['same_tokens_as_own_plain'] else 'NO':>9} "
                         f"{'yes' if r['same_tokens_as_qmtp'] else 'NO':>6}  {acc}")
        lines.append(f"best qmtp over best {peer['engine']}: {peer['best_qmtp_over_best_peer']:.2f}x")
    return "\n".join(lines)


def _config_summary(model: Model) -> dict:
    c = model.config
    return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers, "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "moe_intermediate_size": c.moe_intermediate_size,
            "vocab_size": c.vocab_size}


def write_json(report: dict, path: Path | None) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def lm_head_seconds(model: Model, repeats: int = 5) -> dict:
    """lm_head alone on one token's hidden state, as qmtp runs it (split into row blocks on several CPU streams by
    `qmtp.cores`, where it does) and whole, as mlx-lm runs it: median seconds of each, interleaved, and the
    number of blocks (1 where qmtp does not split)."""
    import statistics
    import time

    split = model._lm_head_split
    h = mx.ones((1, 1, model.config.hidden_size), model.dtype)
    ways = {"split": split if split is not None else model.lm_head, "whole": model.lm_head}
    for run in ways.values():  # the first product of each shape pays for its setup
        mx.eval(run(h))
    seconds = {name: [] for name in ways}
    for _ in range(repeats):
        for name, run in ways.items():
            started = time.perf_counter()
            mx.eval(run(h))
            seconds[name].append(time.perf_counter() - started)
    return {"split": statistics.median(seconds["split"]), "whole": statistics.median(seconds["whole"]),
            "blocks": len(split.blocks) if split is not None else 1}


# ---- bench.mtp's report as Markdown tables for chapter 7 (one table per function) ---------------------------------
def _markdown_table(rows, columns, formats=None) -> str:
    from .inventory import markdown_table

    return markdown_table(rows, columns, formats)


def step_table(report: dict) -> str:
    """Per n_draft: the median speed, a step's mean time over every round, the verify pass and the head's drafts
    timed alone, and the loop's phases (queueing the step, waiting for its tokens) per step over the same rounds."""
    rows = [{"n_draft": r["n_draft"], "tok/s": r["tokens_per_second"], "step ms": r["step_seconds_mean"] * 1e3,
             "verify ms": r["trunk_seconds_per_pass"] * 1e3,
             "drafts ms": (r["n_draft"] - 1) * r["head_seconds_per_draft"] * 1e3,
             "queue ms": r["phase_seconds_per_pass"].get("build", 0) * 1e3,
             "wait ms": r["phase_seconds_per_pass"].get("sync", 0) * 1e3} for r in report["results"]]
    formats = {"tok/s": "{:.0f}", **dict.fromkeys(list(rows[0])[2:], "{:.2f}")}
    return _markdown_table(rows, list(rows[0]), formats)


def width_share_table(auto: dict) -> str:
    """The share of steps `n_draft="auto"` ran at each width."""
    rows = [{"width": n, "share of steps": share} for n, share in auto["width_share"].items()]
    return _markdown_table(rows, ["width", "share of steps"], {"share of steps": "{:.0%}"})


def ablation_table(report: dict) -> str:
    """The lean loop (compiled, queued ahead) at plain decoding and n_draft 4 beside the loop with one or both
    taken away: medians of tokens/s, the per-round ratio to the lean loop, and speed over lean plain decoding."""
    lean = {r["n_draft"]: r["tokens_per_second"] for r in report["results"] if r["n_draft"] in (1, 4)}
    rows = [{"loop": "compiled, queued ahead", "n_draft": n, "tok/s": lean[n], "of the lean loop": 1.0,
             "vs plain (lean)": lean[n] / lean[1]} for n in (1, 4)]
    rows += [{"loop": r["loop"].replace("eager", "eager (not compiled)"), "n_draft": r["n_draft"],
              "tok/s": r["tokens_per_second"], "of the lean loop": r["over_lean"],
              "vs plain (lean)": r["tokens_per_second"] / lean[1]} for r in report["ablation"]]
    return _markdown_table(rows, list(rows[0]), {"tok/s": "{:.0f}", "of the lean loop": "{:.2f}x",
                                                 "vs plain (lean)": "{:.2f}x"})


def peer_table(report: dict) -> str:
    """qmtp's widths beside mlx-vlm's in the same rounds (`report["peer"]`, present when mlx-vlm ran)."""
    qmtp_tps = {r["n_draft"]: r["tokens_per_second"] for r in report["results"]}
    rows = [{"n_draft": r["n_draft"], "qmtp tok/s": qmtp_tps[r["n_draft"]], "mlx-vlm tok/s": r["tokens_per_second"],
             "qmtp / mlx-vlm": r["qmtp_over_peer"], "same tokens as qmtp": "yes" if r["same_tokens_as_qmtp"] else "no",
             "mlx-vlm acceptance": ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"] if a is not None) or "-"}
            for r in report["peer"]["results"]]
    return _markdown_table(rows, list(rows[0]), {"qmtp tok/s": "{:.0f}", "mlx-vlm tok/s": "{:.0f}",
                                                 "qmtp / mlx-vlm": "{:.2f}x"})
