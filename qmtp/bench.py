"""Benchmarks that print tables and write JSON: `python -m qmtp bench mtp [MODEL]`.

Machines are noisy, so every comparison is made inside one run: the variants are interleaved (plain,
n_draft=2, 3, ... then again), each measured `--repeats` times, and the table reports medians and the
spread (min to max) and ratios against plain decoding measured in the same rounds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from .model import Model
from .throughput import expected_union


def mtp(model: Model, prompts: list, max_tokens: int = 64, n_drafts=(1, 2, 3, 4, 5), repeats: int = 3) -> dict:
    """Plain vs speculative decoding on the same prompts, interleaved; one record per n_draft."""
    from .speculative import generate

    runs: dict[int, list] = {n: [] for n in n_drafts}
    for _ in range(repeats):
        for n in n_drafts:
            stats = [generate(model, p, max_tokens=max_tokens, n_draft=n, stop_at_eos=False).stats for p in prompts]
            runs[n].append(stats)
    config = model.config
    results = []
    for n in n_drafts:
        speeds = [sum(s.generated for s in r) / sum(s.decode_seconds for s in r) for r in runs[n]]
        first = runs[n][0]  # greedy: every repeat makes the same tokens and the same decisions
        drafted = np.sum([s.drafted for s in first], axis=0) if n > 1 else np.zeros(0)
        accepted = np.sum([s.accepted for s in first], axis=0) if n > 1 else np.zeros(0)
        passes = [(t, e) for s in first for t, e in zip(s.tokens_per_pass, s.experts_per_pass)]
        experts = np.array([e for _, e in passes], dtype=float)  # [passes, layers]
        tokens_in_pass = [t for t, _ in passes]
        trunk = sum(sum(s.trunk_seconds for s in r) for r in runs[n])
        head = sum(sum(s.head_seconds for s in r) for r in runs[n])
        rollback = sum(sum(s.rollback_seconds for s in r) for r in runs[n])
        emitted = sum(len(step.emitted) for s in first for step in s.steps)
        results.append({
            "n_draft": n,
            "tokens_per_second": statistics.median(speeds),
            "tokens_per_second_min": min(speeds),
            "tokens_per_second_max": max(speeds),
            "acceptance_per_position": [float(a / d) if d else None for a, d in zip(accepted, drafted)],
            "tokens_per_trunk_pass": emitted / len(passes),
            "trunk_share": trunk / (trunk + head + rollback),
            "head_share": head / (trunk + head + rollback),
            "rollback_share": rollback / (trunk + head + rollback),
            "experts_per_layer_measured": experts.mean(axis=0).tolist(),
            "experts_per_pass_measured": float(experts.mean()),
            "experts_per_pass_independent": float(np.mean([
                expected_union(config.num_experts, config.num_experts_per_tok, t) for t in tokens_in_pass
            ])),
        })
    plain = next((r["tokens_per_second"] for r in results if r["n_draft"] == 1), None)
    for r in results:
        r["speedup_vs_plain"] = r["tokens_per_second"] / plain if plain else None
    return {"model": str(model.path), "max_tokens": max_tokens, "prompts": len(prompts), "repeats": repeats,
            "results": results}


def mtp_table(report: dict) -> str:
    head = (f"{'n_draft':>7} {'tok/s':>8} {'(min-max)':>15} {'vs plain':>8} {'tok/pass':>8} "
            f"{'trunk/head/rollback':>20} {'experts/layer':>13} {'indep.':>7}  acceptance per position")
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"] if a is not None) or "-"
        split = f"{r['trunk_share']:.0%}/{r['head_share']:.0%}/{r['rollback_share']:.0%}"
        lines.append(
            f"{r['n_draft']:>7} {r['tokens_per_second']:>8.1f} "
            f"{r['tokens_per_second_min']:>7.1f}-{r['tokens_per_second_max']:<7.1f} {r['speedup_vs_plain']:>8.2f} "
            f"{r['tokens_per_trunk_pass']:>8.2f} {split:>20} {r['experts_per_pass_measured']:>13.1f} "
            f"{r['experts_per_pass_independent']:>7.1f}  {acc}"
        )
    return "\n".join(lines)


def write_json(report: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")
