"""`bench batch`: batched decoding measured side by side in one run, batch sizes by widths.

For every width (n_draft 1..5, "auto") and batch size B, B prompts of different lengths decode together
(`qmtp.generate_batch`, greedy, end ids ignored so every row runs its `max_tokens`): the batch's aggregate
tokens per second (all rows' tokens over the batch's wall time, prefill included), each row's own tokens per
second after its first token, acceptance and time to first token; beside them the same B prompts run one after
another by `qmtp.generate` (plain), where mlx-lm offers it mlx-lm's `batch_generate` on the same file, and where
mlx-vlm offers it mlx-vlm's `BatchGenerator` at every fixed width (plain, and with its batched MTP drafting; it has
no auto width), whose tokens are checked row by row against qmtp's greedy batch. The configurations are
interleaved round by round (a shared machine drifts) and each cell keeps its median.

Goals (issue 35): 4 rows plain >= 2.5x four single runs; 4 rows drafting (the best width) >= 1.4x 4 rows
plain; qmtp's plain batch and its best drafting width at least as fast as mlx-lm's batch and mlx-vlm's best
drafting width; where one is missed the report carries the batch's per-phase profile (prefill, the step's device
work and sync, the host's bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..errors import UsageError
from ..options import Engine
from . import machine
from ..speculative import PhaseTimer

TEXTS = [
    "The history of the city begins",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Water boils at a temperature that depends on",
    "The best way to learn a new language is",
    "In the beginning of the twentieth century, the railway",
    "A recipe for bread needs flour, water,",
    "The committee met on Tuesday to discuss",
]
GOALS = {"plain_batch_over_singles": 2.5, "drafting_over_plain_batch": 1.4}


def prompts_for(model, count: int) -> list[list[int]]:
    """`count` prompts of different lengths (token ids)."""
    if model.tokenizer is not None:
        return [model.tokenizer.encode(TEXTS[i % len(TEXTS)]) for i in range(count)]
    return [[(7 * i + j) % model.config.vocab_size for j in range(3 + 2 * i)] for i in range(count)]


def _batch_cell(model, prompts, n_draft, max_tokens: int) -> dict:
    from ..batch import generate_batch

    timer = PhaseTimer()
    result = generate_batch(model, prompts, max_tokens=max_tokens, n_draft=n_draft, stop_at_eos=False,
                            engine=Engine(track_experts=False, timer=timer))
    return {"tokens_per_second": result.totals["tokens_per_second"], "seconds": result.totals["seconds"],
            "steps": result.totals["steps"],
            "row_tokens_per_second": [g.stats.tokens_per_second for g in result],
            "acceptance": [g.stats.acceptance_rate for g in result],
            "first_token_seconds": [g.stats.first_token_seconds for g in result],
            "phases": dict(timer.seconds)}


def _singles_cell(model, prompts, max_tokens: int) -> dict:
    from ..speculative import generate

    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(generate(model, prompt, max_tokens=max_tokens, stop_at_eos=False,
                               engine=Engine(track_experts=False)).tokens)
    seconds = time.perf_counter() - started
    return {"tokens_per_second": tokens / seconds, "seconds": seconds}


def _mlx_lm_cell(peer, prompts, max_tokens: int) -> dict:
    from mlx_lm.generate import batch_generate

    model, tokenizer = peer
    started = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    seconds = time.perf_counter() - started
    tokens = sum(len(t) for t in getattr(response, "token_ids", None) or response.texts)
    return {"tokens_per_second": tokens / seconds, "seconds": seconds}


def _mlx_vlm_cell(engine, prompts, n_draft: int, max_tokens: int, reference: list[list[int]]) -> dict:
    result = engine.generate_batch(prompts, max_tokens, n_draft)
    return {"tokens_per_second": result["tokens_per_second"], "seconds": result["seconds"],
            "steps": result["passes"],
            "row_tokens_per_second": [r["tokens_per_second"] for r in result["rows"]],
            "acceptance": [r["acceptance"] for r in result["rows"]] if n_draft > 1 else None,
            "first_token_seconds": [r["first_token_seconds"] for r in result["rows"]],
            "lockstep": result["lockstep"],
            "first_mismatch": [first_mismatch(r["tokens"], ours) for r, ours in zip(result["rows"], reference)]}


def first_mismatch(theirs: list[int], ours: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            return i
    return None if len(theirs) == len(ours) else min(len(theirs), len(ours))


def _mlx_vlm_peer(model):
    """(mlx-vlm's engine for the same file, None), or (None, why not: not installed, no batched MTP, no file)."""
    from . import peer

    reason = peer.batch_unavailable() or (None if model.path else "the model has no file for mlx-vlm to load")
    return (None, reason) if reason else (peer.MlxVlmEngine(model.path, model.dtype), None)


NO_AUTO = "mlx-vlm has no auto width"


def _mlx_lm_peer(model):
    """mlx-lm's model and tokenizer for the same file, or None (no batch_generate, or no file)."""
    try:
        from mlx_lm.generate import batch_generate  # noqa: F401
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from .bench import mlx_lm_model
    except ImportError:
        return None
    if not model.path:
        return None
    return mlx_lm_model(model.path), load_tokenizer(Path(model.path))


def _median(cells: list[dict]) -> dict:
    """Per field, the median over rounds (lists element by element; phases of the median round). A token
    mismatch of any round is kept (the rounds decode the same prompts: one differing round is a finding)."""
    middle = sorted(cells, key=lambda c: c["tokens_per_second"])[len(cells) // 2]
    out = dict(middle)
    out["tokens_per_second"] = statistics.median(c["tokens_per_second"] for c in cells)
    if "first_mismatch" in middle:
        out["first_mismatch"] = [min((m for m in row if m is not None), default=None)
                                 for row in zip(*(c["first_mismatch"] for c in cells))]
    return out


PEERS = ("mlx-lm", "mlx-vlm")


def run(model, batches=(1, 2, 4, 8), n_drafts=(1, 2, 3, 4, 5, "auto"), max_tokens: int = 64, rounds: int = 3,
        peers=PEERS, peer_n_drafts=None, progress=None) -> dict:
    """Every (width, batch size) cell, the singles and the peers' batches per size, interleaved over `rounds`
    after one warm-up round (compiling every trace); the medians and the goals. `peers`: which of `PEERS` run
    (True: all, False: none), each where installed; mlx-vlm runs at `peer_n_drafts` (default: the fixed widths
    of `n_drafts`), its tokens checked against qmtp's greedy batch of the same prompts."""
    peers = PEERS if peers is True else () if peers is False else tuple(peers)
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise UsageError(f"peers {sorted(unknown)}: choose among {', '.join(PEERS)}")
    mlx_lm = _mlx_lm_peer(model) if "mlx-lm" in peers else None
    mlx_vlm, mlx_vlm_missing = _mlx_vlm_peer(model) if "mlx-vlm" in peers else (None, None)
    vlm_asked = list(n_drafts if peer_n_drafts is None else peer_n_drafts)
    vlm_widths = [n for n in vlm_asked if n != "auto"]
    notes = [f"mlx-vlm: not run, {mlx_vlm_missing}"] if mlx_vlm_missing else []
    if mlx_vlm is not None and "auto" in vlm_asked:
        notes.append(f"mlx-vlm auto: not run, {NO_AUTO}")
    references = {}
    if mlx_vlm is not None:
        from ..batch import generate_batch

        for size in batches:  # greedy: every width of qmtp gives these tokens (its tests check it)
            references[size] = [g.tokens for g in generate_batch(
                model, prompts_for(model, size), max_tokens=max_tokens, n_draft=1, stop_at_eos=False,
                engine=Engine(track_experts=False))]
    cells: dict[tuple, list] = {}
    for round_ in range(rounds + 1):
        for size in batches:
            prompts = prompts_for(model, size)
            plan = [(("batch", str(n), size), lambda n=n: _batch_cell(model, prompts, n, max_tokens))
                    for n in n_drafts]
            plan.append((("singles", "1", size), lambda: _singles_cell(model, prompts, max_tokens)))
            if mlx_lm is not None:
                plan.append((("mlx-lm", "1", size), lambda: _mlx_lm_cell(mlx_lm, prompts, max_tokens)))
            if mlx_vlm is not None:
                plan += [(("mlx-vlm", str(n), size),
                          lambda n=n: _mlx_vlm_cell(mlx_vlm, prompts, n, max_tokens, references[size]))
                         for n in vlm_widths]
            for name, cell in plan:
                result = cell()
                if round_:  # the first round compiles
                    cells.setdefault(name, []).append(result)
                if progress:
                    progress(f"round {round_} {name}: {result['tokens_per_second']:.1f} tok/s")
    rows = [{"engine": e, "n_draft": n, "batch": b, **_median(c)} for (e, n, b), c in cells.items()]
    return {"max_tokens": max_tokens, "rounds": rounds, "rows": rows, "goals": goals(rows), "notes": notes,
            "mlx_vlm": mlx_vlm.version if mlx_vlm is not None else None}


def _speed(rows, engine, n_draft, batch):
    found = [r["tokens_per_second"] for r in rows if (r["engine"], r["n_draft"], r["batch"]) == (engine, n_draft, batch)]
    return found[0] if found else None


def _best_drafting(rows, engine, size):
    """(tokens/s, n_draft) of `engine`'s fastest drafting width at `size` rows, or None."""
    drafting = [(r["tokens_per_second"], r["n_draft"]) for r in rows
                if r["engine"] == engine and r["batch"] == size and r["n_draft"] != "1"]
    return max(drafting) if drafting else None


def goals(rows: list[dict], size: int = 4) -> dict:
    """The issue's goals at `size` rows: plain batch over singles, best drafting width over plain batch (and,
    where measured, qmtp's plain batch over mlx-lm's and qmtp's best drafting width over mlx-vlm's best), each
    with its target and whether it is met."""
    plain, singles = _speed(rows, "batch", "1", size), _speed(rows, "singles", "1", size)
    drafting = _best_drafting(rows, "batch", size)
    out = {}
    if plain and singles:
        out["plain_batch_over_singles"] = {"ratio": plain / singles, "goal": GOALS["plain_batch_over_singles"]}
    if plain and drafting:
        best, width = drafting
        out["drafting_over_plain_batch"] = {"ratio": best / plain, "goal": GOALS["drafting_over_plain_batch"],
                                            "n_draft": width}
    theirs = _speed(rows, "mlx-lm", "1", size)
    if plain and theirs:
        out["plain_batch_over_mlx_lm"] = {"ratio": plain / theirs, "goal": 1.0}
    theirs_drafting = _best_drafting(rows, "mlx-vlm", size)
    if drafting and theirs_drafting:
        # best against best (qmtp's may be auto, which mlx-vlm lacks), and width by width where both ran
        same_width = {r["n_draft"]: _speed(rows, "batch", r["n_draft"], size) / r["tokens_per_second"]
                      for r in rows if r["engine"] == "mlx-vlm" and r["batch"] == size and r["n_draft"] != "1"
                      and _speed(rows, "batch", r["n_draft"], size)}
        out["drafting_over_mlx_vlm_drafting"] = {"ratio": drafting[0] / theirs_drafting[0], "goal": 1.0,
                                                 "n_draft": drafting[1], "mlx_vlm_n_draft": theirs_drafting[1],
                                                 "at_same_width": same_width}
    for goal in out.values():
        goal["met"] = goal["ratio"] >= goal["goal"]
    return out


def table(report: dict) -> str:
    """The report as a text table, then the goals (with the per-phase profile of the cells they compare)."""
    def fmt(values, spec):
        return " ".join("-" if v is None else format(v, spec) for v in values) if values else "-"

    def same(r):
        """Per row: '=' where mlx-vlm's tokens are qmtp's greedy tokens, else the first position they differ."""
        if "first_mismatch" not in r:
            return "-"
        return " ".join("=" if m is None else f"@{m}" for m in r["first_mismatch"])

    lines = [f"{'engine':8} {'n_draft':>7} {'batch':>5} {'tok/s':>8} {'per row tok/s':>28} {'acceptance':>24} "
             f"{'ttft s':>22} {'tokens = qmtp':>15}"]
    for r in report["rows"]:
        lines.append(f"{r['engine']:8} {r['n_draft']:>7} {r['batch']:>5} {r['tokens_per_second']:8.1f} "
                     f"{fmt(r.get('row_tokens_per_second'), '.1f'):>28} {fmt(r.get('acceptance'), '.2f'):>24} "
                     f"{fmt(r.get('first_token_seconds'), '.2f'):>22} {same(r):>15}")
    lines += report.get("notes", [])
    lockstep = sorted({r["batch"] for r in report["rows"] if r["engine"] == "mlx-vlm" and r.get("lockstep")
                       and r["batch"] > 1})
    if lockstep:
        lines.append(f"mlx-vlm's rows accept in lockstep (requires_uniform_batch_acceptance) at batch "
                     f"{', '.join(map(str, lockstep))}: every row accepts the smallest count of its round")
    mismatched = [r for r in report["rows"] if any(m is not None for m in r.get("first_mismatch", ()))]
    for r in mismatched:
        lines.append(f"MISMATCH {r['engine']} n_draft {r['n_draft']} batch {r['batch']}: rows "
                     f"{[i for i, m in enumerate(r['first_mismatch']) if m is not None]} differ from qmtp's greedy "
                     f"tokens (first at {[m for m in r['first_mismatch'] if m is not None]})")
    for name, goal in report["goals"].items():
        verdict = "met" if goal["met"] else f"missed by {goal['goal'] / goal['ratio']:.2f}x"
        widths = ""
        if "mlx_vlm_n_draft" in goal:
            from .under_load import other_widths

            widths = f" (n_draft {goal['n_draft']} over {goal['mlx_vlm_n_draft']}" + "".join(
                f"; at n_draft {n} both {ratio:.2f}x" for n, ratio in other_widths(goal).items()) + ")"
        lines.append(f"{name}: {goal['ratio']:.2f}x{widths} (goal {goal['goal']}x) {verdict}")
    for r in report["rows"]:
        if r["engine"] == "batch" and r["batch"] == 4 and r.get("phases"):
            phases = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(r["phases"].items()))
            lines.append(f"profile batch 4 n_draft {r['n_draft']}: {phases} of {r['seconds']:.2f}s")
    return "\n".join(lines)


# ---- a long prompt joining running rows ----------------------------------------------------------------------
def join_stall(model, rows: int = 4, prompt_tokens: int = 2000, n_draft=3, warm_steps: int = 30, seed: int = 0,
               join: str = "auto") -> dict:
    """How long running rows wait between tokens while a `prompt_tokens`-token prompt joins them (issue 35: at
    most twice as long): `rows` rows decode (greedy, end ids ignored); their step time is timed for
    `warm_steps` steps after as many unmeasured ones (compiling), then the long prompt is submitted and every
    step until it decodes its first token is timed (`join`: how it joins, `ContinuousBatch`'s: chunks of its
    own between the rows' steps, or a row of their pass). The rows may decode the whole context: read as a
    row, the prompt takes a step for every few of its tokens, and a row that ended would leave the others
    alone."""
    import numpy as np

    from ..continuous import ContinuousBatch
    from ..options import Settings

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    context = model.config.max_position_embeddings
    batch = ContinuousBatch(model, max_batch=rows + 1, join=join)
    running = [batch.submit(rng.integers(0, vocab, 8 + 4 * i).tolist(),
                            Settings.of(max_tokens=context - 64 - 4 * rows, n_draft=n_draft, stop_at_eos=False))
               for i in range(rows)]

    def timed_step() -> float:
        started = time.perf_counter()
        batch.step()
        return time.perf_counter() - started

    for _ in range(warm_steps):
        batch.step()
    before = [timed_step() for _ in range(warm_steps)]
    joining = batch.submit(rng.integers(0, vocab, prompt_tokens).tolist(),
                           Settings.of(max_tokens=4, n_draft=n_draft))
    fed = batch.counters["prompt_rows_stepped"]
    during = []
    while not joining.tokens and not joining.done.is_set():
        during.append(timed_step())
    fed = batch.counters["prompt_rows_stepped"] - fed
    smallest_tokens, smallest_seconds = batch.chunk_costs.smallest() or (None, None)
    for request in running + [joining]:
        request.cancel()
    while batch.step():
        pass
    typical = statistics.median(before)
    return {"rows": rows, "prompt_tokens": prompt_tokens, "n_draft": n_draft, "join": join, "step_seconds": typical,
            "steps_while_joining": len(during), "longest_while_joining": max(during),
            "median_while_joining": statistics.median(during), "longest_over_step": max(during) / typical,
            "p90_over_step": float(np.quantile(during, 0.9)) / typical,
            "share_over_twice": sum(d > 2 * typical for d in during) / len(during),
            "steps_as_a_row": fed,
            "prefill_seconds": joining.stats.prefill_seconds, "smallest_chunk_tokens": smallest_tokens,
            "smallest_chunk_seconds": smallest_seconds}


# ---- verify passes over B rows x n tokens at the real widths -------------------------------------------------
def real_width_passes(batches=(1, 2, 4, 8), n_drafts=(1, 2, 3, 4, 5), layers: int = 4, context: int = 64,
                      budget: float = 3.0, progress=None, overrides: dict | None = None) -> dict:
    """The trunk of one verify pass over B rows of n tokens each (compiled, median of timed calls; lm_head is
    timed apart, for one token) on
    `bench.real_width_model` (the real model's first `layers` layers, 256 experts, its vocabulary, 4-bit; each
    token routed by its own embedding, so tokens choose experts independently), from
    B rows each `context` tokens in; the experts each layer's pass read (the union of its B n tokens' top-8,
    counted from the router's choices) beside the independent-routing union `under_load.experts_read`, and the
    pass's time over one row's one-token pass beside the batch's tokens (B n) and the union's growth.
    `overrides`: config fields changed (the tests' small widths)."""
    import mlx.core as mx
    import numpy as np

    from .. import acceptance, continuous, decoding
    from .bench import _median_seconds, real_width_model
    from .under_load import experts_read

    model = real_width_model(layers, independent_routing=True, **(overrides or {}))
    config, rng = model.config, np.random.default_rng(0)
    greedy = acceptance.Greedy()
    capacity = decoding.capacity_for(context + 2 * max(n_drafts))
    rows = []
    for size in batches:
        state = None
        for _ in range(size):  # each row its own prompt, prefilled alone as a joining request is
            prompt = rng.integers(0, config.vocab_size, context).tolist()
            prefill = continuous._prefill_row(model, None, prompt, capacity, greedy, "post", mx.random.key(0),
                                              lambda: context)
            try:
                while True:
                    next(prefill)
            except StopIteration as done:
                row = continuous._as_row(model, done.value[0], capacity, None)
            state = row if state is None else continuous._joined(state, row)
        for n in n_drafts:
            tokens = mx.array(rng.integers(0, config.vocab_size, (size, n)), mx.int32)

            def trunk(s, t, record=n > 1):
                _, post, experts, layers = decoding.trunk_step(model, t, s, record)
                return post, experts, layers

            compiled = mx.compile(lambda s, t: trunk(s, t)[0], inputs=[model.state])
            seconds = _median_seconds(lambda: compiled(state, tokens), repeats=10, budget=budget)
            _, experts, _ = trunk(state, tokens)
            union = [len(np.unique(np.array(e))) for e, layer in zip(experts, model.layers)]
            rows.append({"batch": size, "n_draft": n, "tokens": size * n, "seconds": seconds,
                         "experts_read": float(np.mean(union)), "experts_predicted": experts_read(size, n, config)})
            if progress:
                progress(f"batch {size} n_draft {n}: {seconds * 1e3:.1f} ms, {rows[-1]['experts_read']:.0f} experts")
    one = next(r["seconds"] for r in rows if r["tokens"] == 1) if any(r["tokens"] == 1 for r in rows) else None
    for r in rows:
        r["time_over_one_token"] = r["seconds"] / one if one else None
    # lm_head apart: at the real vocabulary its product over every token of the pass would drown the layers
    hidden = mx.zeros((1, 1, config.hidden_size), mx.float32)
    logits = mx.compile(lambda h: model.logits(h), inputs=[model.state])
    lm_head = _median_seconds(lambda: logits(hidden), repeats=10, budget=budget)
    return {"layers": layers, "experts": config.num_experts, "vocab": config.vocab_size, "context": context,
            "rows": rows, "lm_head_one_token_seconds": lm_head}


def real_width_table(report: dict) -> str:
    lines = [f"real widths, {report['layers']} layers, {report['experts']} experts, vocabulary {report['vocab']}, "
             f"{report['context']} tokens in each row",
             f"lm_head alone, one token: {report['lm_head_one_token_seconds'] * 1e3:.1f} ms",
             f"{'batch':>5} {'n_draft':>7} {'tokens':>6} {'ms':>8} {'x one token':>11} {'experts read':>12} "
             f"{'predicted':>9}"]
    for r in report["rows"]:
        over = f"{r['time_over_one_token']:.2f}" if r["time_over_one_token"] else "-"
        lines.append(f"{r['batch']:>5} {r['n_draft']:>7} {r['tokens']:>6} {r['seconds'] * 1e3:8.1f} {over:>11} "
                     f"{r['experts_read']:12.1f} {r['experts_predicted']:9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m qmtp.book.bench_batch [MODEL] --batch 1,2,4,8 --n-draft 1,2,3,4,5,auto [--json PATH]"""
    from ..loading import load

    parser = argparse.ArgumentParser(prog="python -m qmtp bench batch", description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="a checkpoint folder (default: the bundled model)")
    parser.add_argument("--batch", default="1,2,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--n-draft", default="1,2,3,4,5,auto", help="widths, comma-separated (auto allowed)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (medians kept)")
    parser.add_argument("--no-peers", action="store_true", help="leave the peers (mlx-lm, mlx-vlm) out")
    parser.add_argument("--peers", default=",".join(PEERS), help="which peers run, comma-separated, each where "
                        "installed: mlx-lm (batch_generate, plain), mlx-vlm (BatchGenerator, plain and batched MTP "
                        "at the fixed widths of --n-draft; it has no auto width)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--real-width", action="store_true", help="instead: the trunk of verify passes over B rows x "
                        "n_draft tokens timed on the real widths (256 experts, in memory, about 6 GB), experts counted")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    n_drafts = [n if n == "auto" else int(n) for n in args.n_draft.split(",")]
    if args.real_width:
        if "auto" in n_drafts:
            n_drafts = [n for n in n_drafts if n != "auto"]  # a pass has a width; auto chooses among them
        report = real_width_passes(batches, n_drafts, progress=lambda line: print(line, flush=True))
        report.update(machine.where_and_when())
        print(real_width_table(report))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1, default=str))
        return 0
    peers = () if args.no_peers else tuple(p for p in args.peers.split(",") if p)
    report = run(load(args.model), batches, n_drafts, args.max_tokens, args.rounds, peers,
                 progress=lambda line: print(line, flush=True))
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
