"""Speculative decoding with the MTP head as the drafter.

One step, with the trunk's cache holding x_0..x_t and the trunk's choice x_{t+1} ("pending") not yet fed:

1. draft: the head turns (h_t, x_{t+1}) into a guess d_1 for x_{t+2}; fed its own post-norm output and
   d_1 it guesses d_2, and so on: `n_draft - 1` drafts.
2. verify: one trunk pass over [x_{t+1}, d_1, ..., d_k] gives the trunk's own choice after each of them.
3. accept: the longest prefix of drafts the trunk agrees with, plus the trunk's next token (greedy), or,
   when sampling, each draft with probability min(1, p/q) and a resample from max(0, p - q) at the first
   rejection (Leviathan et al. 2023). Either way the output has exactly the trunk's distribution.
4. roll back: every cache is cut back to the accepted tokens, as if only they had been decoded.

`n_draft` follows the seed engine's convention: it counts the trunk's own token, so `n_draft=1` is plain
decoding and `n_draft=2` verifies one head draft per step (vLLM's num_speculative_tokens = n_draft - 1).
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .errors import QmtpError, UsageError
from .model import Model

MAX_N_DRAFT = 8


@dataclass
class Step:
    """What one trunk pass did: the drafts it checked and how many it kept."""

    drafts: list[int]
    accepted: int
    emitted: list[int]  # tokens this step added to the output (accepted drafts + the trunk's own)


@dataclass
class Stats:
    n_draft: int
    prompt_tokens: int = 0
    generated: int = 0
    drafted: list[int] = field(default_factory=list)  # per draft position: how often a draft was proposed
    accepted: list[int] = field(default_factory=list)  # per draft position: how often it was accepted
    prefill_seconds: float = 0.0
    trunk_seconds: float = 0.0
    head_seconds: float = 0.0
    rollback_seconds: float = 0.0
    experts_per_pass: list[list[int]] = field(default_factory=list)  # per verify pass, per layer: distinct experts
    steps: list[Step] = field(default_factory=list)

    @property
    def trunk_passes(self) -> int:
        """Decode or verify passes (a replay after a partial accept is not counted: it is rollback work)."""
        return len(self.steps)

    @property
    def tokens_per_pass(self) -> list[int]:
        """Tokens each pass ran through the trunk: the pending token and the drafts."""
        return [1 + len(s.drafts) for s in self.steps]

    @property
    def acceptance(self) -> list[float]:
        """Per draft position, accepted over proposed (position i is proposed only if 1..i-1 were accepted)."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted, self.drafted)]

    @property
    def acceptance_rate(self) -> float:
        """All accepted drafts over all proposed drafts."""
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else float("nan")

    @property
    def tokens_per_trunk_pass(self) -> float:
        """Mean tokens emitted per verify pass (1 for plain decoding)."""
        emitted = sum(len(s.emitted) for s in self.steps)
        return emitted / len(self.steps) if self.steps else float("nan")

    @property
    def decode_seconds(self) -> float:
        return self.trunk_seconds + self.head_seconds + self.rollback_seconds

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over decode time (prefill excluded)."""
        return self.generated / self.decode_seconds if self.decode_seconds else float("nan")

    def summary(self) -> dict:
        return {
            "n_draft": self.n_draft,
            "generated": self.generated,
            "trunk_passes": self.trunk_passes,
            "acceptance": self.acceptance,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_trunk_pass": self.tokens_per_trunk_pass,
            "tokens_per_second": self.tokens_per_second,
            "trunk_seconds": self.trunk_seconds,
            "head_seconds": self.head_seconds,
            "rollback_seconds": self.rollback_seconds,
        }


@dataclass
class Generation:
    """What `generate` returns: the new text and tokens (the prompt's tokens apart) and the run's statistics."""

    text: str
    tokens: list[int]  # generated tokens only
    prompt_tokens: list[int]
    stats: Stats


class _Sampler:
    """Greedy at temperature 0, else sampling from softmax(logits / T) with a seeded generator."""

    def __init__(self, temperature: float, seed: int):
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        z = logits.astype(np.float64) / self.temperature
        z = np.exp(z - z.max(axis=-1, keepdims=True))
        return z / z.sum(axis=-1, keepdims=True)

    def choose(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        return self.draw(self.probs(logits))

    def draw(self, probs: np.ndarray) -> int:
        """A token from `probs` (already softmaxed: the caller keeps them for the acceptance test)."""
        return int(self.rng.choice(len(probs), p=probs))


def _validate(model: Model, prompt_tokens: list[int], max_tokens: int, n_draft: int, temperature: float, seed,
              head):
    if not 1 <= n_draft <= MAX_N_DRAFT:
        raise UsageError(f"n_draft={n_draft} is out of range: use 1 (plain decoding) to {MAX_N_DRAFT}")
    if n_draft > 1 and head is None:
        model.require_head()
    if not prompt_tokens:
        raise UsageError("the prompt is empty: give at least one token of text")
    if max_tokens < 1:
        raise UsageError(f"max_tokens={max_tokens} must be at least 1")
    if not (temperature >= 0 and math.isfinite(temperature)):  # NaN fails every comparison
        raise UsageError(f"temperature={temperature} must be a finite number >= 0")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UsageError(f"seed={seed!r} must be a non-negative integer")
    vocab = model.config.vocab_size
    outside = next((t for t in prompt_tokens if not 0 <= t < vocab), None)
    if outside is not None:  # MLX does not bounds-check an embedding lookup: garbage, or a crash
        where = f" of {model.path}" if model.path else ""
        raise UsageError(
            f"prompt token id {outside} is outside the vocabulary{where} (0..{vocab - 1}, config.json vocab_size); "
            f"were the ids made by another model's tokenizer?"
        )
    # The sequence (prompt and new tokens) must fit the context, and so must the drafts verified past its
    # last token (the cache holds one position less: the last new token is never fed back).
    limit = model.config.max_position_embeddings
    if len(prompt_tokens) > limit:
        raise UsageError(f"prompt of {len(prompt_tokens)} tokens is longer than the context of {limit} positions")
    needed = len(prompt_tokens) + max_tokens + n_draft - 1
    if needed > limit:
        drafts = f" + {n_draft - 1} drafted ahead" if n_draft > 1 else ""
        raise UsageError(
            f"prompt of {len(prompt_tokens)} tokens + {max_tokens} new ones{drafts} is {needed} positions, more "
            f"than the context of {limit}: ask for at most {max_tokens - (needed - limit)} new tokens"
        )


def _start_routing_logs(model: Model) -> None:
    for layer in model.layers:
        layer.mlp.routing_log = []


def _stop_routing_logs(model: Model) -> list[list[mx.array]]:
    """Per trunk layer, the expert indices its calls chose since `_start_routing_logs` (still on the device)."""
    logs = []
    for layer in model.layers:
        logs.append(layer.mlp.routing_log)
        layer.mlp.routing_log = None
    return logs


def _experts_touched(logs: list[list[mx.array]]) -> list[int]:
    """Per layer, how many distinct experts its log names. Run once the generation is over, so that tracking
    adds no work and no host sync to the passes it watches."""
    return [int(np.unique(np.concatenate([np.array(i).ravel() for i in log])).size) if log else 0 for log in logs]


def generate(
    model: Model,
    prompt,
    max_tokens: int = 64,
    n_draft: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    head=None,
    hidden: str = "post",
    rollback: str = "record",
    track_experts: bool = True,
    stop_at_eos: bool = True,
) -> Generation:
    """Generate up to `max_tokens` tokens after `prompt` (text, or a list of token ids).

    Args:
        n_draft: tokens per trunk pass counting the trunk's own (1 = plain decoding, 2 = one head draft),
            the seed engine's convention; vLLM's num_speculative_tokens is n_draft - 1.
        temperature: 0 for greedy; otherwise rejection sampling keeps exactly the trunk's distribution.
        head: a replacement drafter (e.g. `mtp.without_routed_experts(model.mtp)`); default model.mtp.
        hidden: "post" feeds the head the trunk state after its final norm (as vLLM and SGLang do), "pre"
            the state before it.
        rollback: "record" keeps each position's linear-attention state during verification; "replay"
            restores a snapshot and runs the accepted tokens again.
    """
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise UsageError("this model has no tokenizer: pass the prompt as a list of token ids")
        if not prompt:
            raise UsageError("the prompt is empty: give at least one token of text")
        prompt_tokens = model.tokenizer.encode(prompt)
    else:
        try:
            prompt_tokens = [operator.index(t) for t in prompt]
        except (TypeError, ValueError):
            raise UsageError(f"prompt: give text or a sequence of integer token ids, not {prompt!r:.60}") from None
    if hidden not in ("post", "pre"):
        raise UsageError(f"hidden={hidden!r}: use 'post' (after the final norm) or 'pre'")
    if rollback not in ("record", "replay"):
        raise UsageError(f"rollback={rollback!r}: use 'record' or 'replay'")
    drafter = head if head is not None else model.mtp
    _validate(model, prompt_tokens, max_tokens, n_draft, temperature, seed, drafter if n_draft > 1 else None)
    k = n_draft - 1
    eos = model.tokenizer.eos_id if (stop_at_eos and model.tokenizer is not None) else None
    sampler = _Sampler(temperature, seed)
    stats = Stats(n_draft=n_draft, prompt_tokens=len(prompt_tokens), drafted=[0] * k, accepted=[0] * k)
    cache = model.make_cache()
    head_cache = cache.head if drafter is model.mtp else None
    if k and head_cache is None:
        from .cache import KVCache

        head_cache = KVCache()

    def trunk_pass(tokens, last_only: bool = False):
        pre, post = model.trunk(tokens if isinstance(tokens, mx.array) else mx.array([tokens]), cache)
        # The prefill needs the next token's scores only: lm_head over every prompt position would cost
        # prompt length x vocabulary x hidden for one row that is used. Verify passes need every row.
        logits = model.logits(post[:, -1:] if last_only else post)
        return (post if hidden == "post" else pre), logits

    greedy = temperature == 0
    expert_logs: list = []  # per verify pass, per layer: the experts chosen (read when the generation ends)

    # ---- prefill ---------------------------------------------------------------------------------------------
    started = time.perf_counter()
    h, logits = trunk_pass(prompt_tokens, last_only=True)
    last = logits[0, -1].astype(mx.float32)
    # Damaged weights (NaN/Inf) give NaN logits, whose argmax is an arbitrary token: stop here instead.
    finite = mx.isfinite(last).all()
    if greedy:
        first = mx.argmax(last)
        mx.eval(first, h, finite)
        pending = int(first.item())
    else:
        last = np.array(last)
        mx.eval(h, finite)
        pending = None
    if not finite.item():
        where = f" {model.path}" if model.path else ""
        raise QmtpError(f"model{where} computes NaN or Inf logits for the prompt: its weights are damaged "
                        f"(find the tensor with `python -m qmtp doctor MODEL --scan`)")
    if pending is None:
        pending = sampler.choose(last)
    stats.prefill_seconds = time.perf_counter() - started
    out = [pending]

    if k == 0 and greedy:
        # ---- plain greedy decoding, pipelined ----------------------------------------------------------------
        # The next pass is queued (mx.async_eval) before the current token is read, so the machine computes
        # while Python builds the next graph: one host sync per token, and no idle gap between passes.
        t0 = time.perf_counter()
        token = mx.array([[pending]])
        queued = None
        while len(out) < max_tokens and not (eos is not None and out[-1] == eos):
            if queued is None:
                queued = _queue_plain_pass(model, token, trunk_pass, track_experts)
            token, logs = queued
            queued = None
            if len(out) + 1 < max_tokens:
                queued = _queue_plain_pass(model, token, trunk_pass, track_experts)
            next_token = int(token.item())
            if logs is not None:
                expert_logs.append(logs)
            stats.steps.append(Step([], 0, [next_token]))
            out.append(next_token)
        stats.trunk_seconds = time.perf_counter() - t0
        return _finish(model, out, prompt_tokens, max_tokens, eos, stats, expert_logs)

    # Head inputs not yet fed to the head: (trunk state at position j, token at j + 1) from position `head_from`.
    head_from, head_h, head_next = 0, h, prompt_tokens[1:] + [pending]

    while len(out) < max_tokens and not (eos is not None and out[-1] == eos):
        # ---- draft ---------------------------------------------------------------------------------------------
        drafts, draft_probs = [], []
        if k:
            t0 = time.perf_counter()
            z = drafter(head_h, model.embed_tokens(mx.array([head_next])), head_cache)[:, -1:]
            chosen = []  # greedy: the drafts stay on the device until all k are made (one sync)
            for i in range(k):
                draft_logits = model.logits(z)[0, -1].astype(mx.float32)
                if greedy:
                    d = mx.argmax(draft_logits)
                    chosen.append(d)
                    d = d.reshape(1, 1)
                else:
                    q = sampler.probs(np.array(draft_logits))
                    d = sampler.draw(q)
                    drafts.append(d)
                    draft_probs.append(q)
                    d = mx.array([[d]])
                if i + 1 < k:
                    z = drafter(z, model.embed_tokens(d), head_cache)
            if greedy:
                drafts = mx.stack(chosen).tolist()
            stats.head_seconds += time.perf_counter() - t0

        # ---- verify --------------------------------------------------------------------------------------------
        t0 = time.perf_counter()
        snapshot = cache.snapshot() if rollback == "replay" else None
        cache.set_record(rollback == "record" and k > 0)
        if track_experts:
            _start_routing_logs(model)
        verify_tokens = [pending] + drafts
        h_verify, logits = trunk_pass(verify_tokens)
        if track_experts:
            expert_logs.append(_stop_routing_logs(model))
        if greedy:
            trunk_choices = mx.argmax(logits[0].astype(mx.float32), axis=-1).tolist()
        else:
            verify_logits = np.array(logits[0].astype(mx.float32))
        stats.trunk_seconds += time.perf_counter() - t0

        # ---- accept --------------------------------------------------------------------------------------------
        accepted, next_token = 0, None
        for i, d in enumerate(drafts):
            stats.drafted[i] += 1
            if greedy:
                ok = d == trunk_choices[i]
            else:
                p = sampler.probs(verify_logits[i])
                q = draft_probs[i]
                ok = sampler.rng.random() < min(1.0, p[d] / q[d])
                if not ok:
                    residual = np.maximum(p - q, 0.0)
                    total = residual.sum()
                    next_token = sampler.draw(residual / total) if total > 0 else sampler.draw(p)
            if not ok:
                if greedy:
                    next_token = trunk_choices[i]
                break
            stats.accepted[i] += 1
            accepted += 1
        if next_token is None:
            next_token = trunk_choices[accepted] if greedy else sampler.choose(verify_logits[accepted])

        # ---- roll back -----------------------------------------------------------------------------------------
        t0 = time.perf_counter()
        keep = accepted + 1  # the pending token and the accepted drafts
        if keep < len(verify_tokens):
            if rollback == "record":
                cache.rewind(keep, len(verify_tokens))
            else:
                cache.restore(snapshot)
                h_verify, _ = trunk_pass(verify_tokens[:keep])
        cache.set_record(False)
        if k:
            # Head entries from position t + 1 on were built from the head's own guesses: drop them. The
            # accepted positions are fed again next step, with the trunk's true states.
            head_cache.trim_to(head_from + head_h.shape[1])
        stats.rollback_seconds += time.perf_counter() - t0

        emitted = verify_tokens[1:keep] + [next_token]
        stats.steps.append(Step(drafts, accepted, emitted))
        out.extend(emitted)
        head_from += head_h.shape[1]
        head_h = h_verify[:, :keep]
        head_next = verify_tokens[1:keep] + [next_token]
        pending = next_token

    return _finish(model, out, prompt_tokens, max_tokens, eos, stats, expert_logs)


def _queue_plain_pass(model: Model, token: mx.array, trunk_pass, track_experts: bool):
    """Build one plain decoding pass after `token` [1, 1] and start computing it: (next token [1, 1], the
    experts each layer chose or None), still on the device."""
    if track_experts:
        _start_routing_logs(model)
    _, logits = trunk_pass(token)
    logs = _stop_routing_logs(model) if track_experts else None
    next_token = mx.argmax(logits[:, -1].astype(mx.float32), axis=-1, keepdims=True)
    mx.async_eval(next_token)
    return next_token, logs


def _finish(model: Model, out: list[int], prompt_tokens: list[int], max_tokens: int, eos, stats: Stats,
            expert_logs: list) -> Generation:
    stats.experts_per_pass = [_experts_touched(logs) for logs in expert_logs]
    out = out[:max_tokens]
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    stats.generated = len(out)
    text = model.tokenizer.decode([t for t in out if t != eos]) if model.tokenizer is not None else ""
    return Generation(text=text, tokens=out, prompt_tokens=prompt_tokens, stats=stats)
