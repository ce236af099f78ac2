"""What coupled acceptance (the default: drafts and trunk share each position's Gumbel noise) costs in acceptance
against rejection sampling (Leviathan et al.), on one model, per sampler and width.

    PYTHONPATH=. python tools/measure_coupling.py [MODEL] [--seeds 3] [--max-tokens 64] [--json OUT]

MODEL defaults to the bundled tiny model. Samplers: temperature 0.6, 0.8 and 1.0 (no filter) and the model's own
(`sampling="model"`: its generation_config.json); widths n_draft 2..5; a few prompts, each with `--seeds` seeds.
The two acceptances run interleaved (for each prompt, seed, sampler and width, one after the other), so a drift of
the machine touches both alike; only counts are compared, no times. The table: per draft position, accepted over
proposed (summed over runs), and the tokens each trunk pass emitted, for each acceptance, and their ratio. A
seed gives coupled runs the same text at every width, so their rows are not independent samples; the exact
line below the table pairs the two on the same positions instead: along each width-2 text, the probability that
each acceptance keeps the first draft there, computed from the trunk's and the head's distributions.

Gumbel-max coupling keeps a draft with probability P(argmax(log q + g) = argmax(log p + g)), at most rejection
sampling's sum(min(p, q)) and at least (1 - TV) / (1 + TV), TV the total variation distance between the head's q
and the trunk's p: the gap is small where the head is either sure and right or far off, largest in between.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

import qmtp
from qmtp.sampling import one_hot, penalise, resolve, warp

PROMPTS = ["Once upon a time", "The little fox looked at the river and", "One day, a girl named Lily",
           "Tom wanted to build a boat. He"]
SAMPLERS = {"T=0.6": dict(temperature=0.6), "T=0.8": dict(temperature=0.8), "T=1.0": dict(temperature=1.0),
            "model": dict(sampling="model")}
WIDTHS = (2, 3, 4, 5)
ACCEPTANCES = ("coupled", "rejection")


def kept_probabilities(p: np.ndarray, q: np.ndarray, candidates: int = 256) -> tuple[float, float]:
    """The probability that a draft from q is kept when the trunk samples p: rejection sampling's sum(min(p, q))
    and Gumbel-max coupling's sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) (both argmaxes land on i), over the
    `candidates` tokens of largest min(p_i, q_i) (the rest add at most their sum(min(p, q)), which is tiny)."""
    both = np.minimum(p, q)
    top = np.argsort(-both)[:candidates]
    top = top[both[top] > 0]
    ratios = np.maximum(p[None] / p[top, None], q[None] / q[top, None])
    return float(both.sum()), float((1.0 / ratios.sum(axis=1)).sum())


def exact_first_draft(model, prompt_ids: list[int], generated: list[int], settings) -> list[tuple[float, float]]:
    """Along one generation: at each position whose first draft a step could propose, the chance rejection
    sampling and coupling keep it (teacher forcing: the head's guess for x_{t+2} from h_t and x_{t+1}, against
    the trunk's distribution after x_{t+1}, both processed with the history of the generated tokens)."""
    tokens = mx.array([prompt_ids + generated])
    _, h = model.trunk(tokens)
    trunk = model.logits(h)[0].astype(mx.float32)
    head = model.logits(model.mtp(h[:, :-1], model.embed_tokens(tokens[:, 1:])))[0].astype(mx.float32)
    start, vocab = len(prompt_ids), trunk.shape[-1]
    seen = mx.array(np.isin(np.arange(vocab), prompt_ids))
    out = []
    for i in range(1, len(generated)):  # the token generated[i], at position start + i
        t = start + i
        counts = one_hot(mx.array(generated[:i]), vocab).sum(axis=0)[None]
        p, q = (mx.softmax(warp(penalise(row[None], counts, seen, settings), settings), axis=-1)[0]
                for row in (trunk[t - 1], head[t - 2]))
        out.append(kept_probabilities(np.array(p, np.float64), np.array(q, np.float64)))
    return out


def measure(model, seeds: int, max_tokens: int) -> dict:
    """(sampler, width, acceptance) -> summed drafts proposed and accepted per position, tokens, passes; and
    (sampler, "exact") -> the first draft's chance of being kept under each acceptance, summed over the positions
    of the width-2 texts."""
    totals = {}
    for prompt in PROMPTS:
        for seed in range(seeds):
            for name, sampler in SAMPLERS.items():
                for width in WIDTHS:
                    for acceptance in ACCEPTANCES:
                        g = qmtp.generate(model, prompt, max_tokens=max_tokens, n_draft=width, seed=seed,
                                          stop_at_eos=False, engine=qmtp.Engine(acceptance=acceptance), **sampler)
                        t = totals.setdefault((name, width, acceptance), dict(
                            proposed=[0] * (width - 1), accepted=[0] * (width - 1), tokens=0, passes=0))
                        t["proposed"] = [a + b for a, b in zip(t["proposed"], g.stats.drafted)]
                        t["accepted"] = [a + b for a, b in zip(t["accepted"], g.stats.accepted)]
                        # the prefill's token is no pass's
                        t["tokens"] += sum(len(s.emitted) for s in g.stats.steps)
                        t["passes"] += g.stats.trunk_passes
                        if width == 2:
                            settings = resolve(model, sampler.get("sampling"), temperature=sampler.get("temperature"))
                            kept = exact_first_draft(model, g.prompt_tokens, g.tokens, settings)
                            e = totals.setdefault((name, "exact"), dict(rejection=0.0, coupled=0.0, positions=0))
                            e["rejection"] += sum(r for r, _ in kept)
                            e["coupled"] += sum(c for _, c in kept)
                            e["positions"] += len(kept)
    return totals


def rates(t: dict) -> list[float]:
    return [a / p if p else float("nan") for a, p in zip(t["accepted"], t["proposed"])]


def table(totals: dict) -> str:
    lines = ["| sampler | n_draft | acceptance per position, coupled | rejection | tokens/pass coupled | rejection "
             "| ratio |", "|---|---|---|---|---|---|---|"]
    for name in SAMPLERS:
        for width in WIDTHS:
            c, r = totals[(name, width, "coupled")], totals[(name, width, "rejection")]
            tc, tr = c["tokens"] / c["passes"], r["tokens"] / r["passes"]
            lines.append(f"| {name} | {width} | {' '.join(f'{x:.2f}' for x in rates(c))} | "
                         f"{' '.join(f'{x:.2f}' for x in rates(r))} | {tc:.2f} | {tr:.2f} | {tc / tr:.3f} |")
    return "\n".join(lines)


def first_position_summary(totals: dict) -> str:
    """The first draft's rate over every width, per sampler (the most drafts behind each number), and the
    exact chance of keeping it, paired on the same positions."""
    out = []
    for name in SAMPLERS:
        e = totals[(name, "exact")]
        rejection, coupled = e["rejection"] / e["positions"], e["coupled"] / e["positions"]
        out.append(f"{name}: exact chance the first draft is kept, over {e['positions']} positions: "
                   f"{coupled:.3f} coupled, {rejection:.3f} rejection (ratio {coupled / rejection:.3f})")
        pair = []
        for acceptance in ACCEPTANCES:
            runs = [totals[(name, w, acceptance)] for w in WIDTHS]
            pair.append(sum(t["accepted"][0] for t in runs) / sum(t["proposed"][0] for t in runs))
        out.append(f"{name}: first draft kept {pair[0]:.3f} coupled, {pair[1]:.3f} rejection "
                   f"({pair[0] - pair[1]:+.3f})")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="a converted checkpoint (default: the bundled model)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the counts here")
    args = parser.parse_args(argv)
    model = qmtp.load(args.model) if args.model else qmtp.load()
    totals = measure(model, args.seeds, args.max_tokens)
    print(table(totals))
    print()
    print(first_position_summary(totals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"|".join(map(str, key)): t for key, t in totals.items()}, f, indent=1)


if __name__ == "__main__":
    main()
