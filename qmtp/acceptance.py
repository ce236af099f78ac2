"""Acceptance: how a verify pass keeps drafts, one strategy per row (`qmtp.decoding.step` applies it).

Greedy keeps a draft while it equals the trunk's argmax; coupled sampling (the default when sampling) shares each
position's Gumbel noise between the head and the trunk, so a seed gives the same tokens at every width; rejection
sampling (Leviathan et al. 2023) keeps a draft with probability min(1, p/q). Each sees only processed
distributions (`qmtp.sampling`: penalties, temperature, filters), so the output keeps the trunk's law exactly.
"""

from __future__ import annotations

import mlx.core as mx

from .errors import UsageError
from .sampling import Sampling, penalise, warp

# `history`, where a strategy needs one (penalties): (counts [n, V], prompt_seen [V]), how often each token
# was generated before each of the n positions scored (the drafts before it included) and the prompt's
# tokens; None otherwise, and then nothing about the history is computed or carried.
#
# Positions: `first` is the sequence position (counted from the prompt's first token) of the token that the
# first row of a verify pass chooses, the one after `pending`; draft d_i guesses the token at first + i - 1.
ACCEPTANCES = ("coupled", "rejection")


class _Acceptance:
    """What every strategy shares: the keys its random choices use (none by default)."""

    random = False  # whether it draws random numbers
    by_position = False  # whether each token's randomness is a function of the seed and its position only

    def key_at(self, key: mx.array, position) -> mx.array:
        """The key that chooses the token at `position` (a step's own key where randomness is per step)."""
        return key

    def keys(self, key: mx.array, first, n: int) -> list:
        """The keys that choose the drafts at positions first..first + n - 1."""
        return [key] * n


def _agreeing_prefix(drafts: mx.array, choices: mx.array):
    """Drafts [k] and the trunk's choices [k + 1] -> (how many leading drafts equal the choices, the trunk's
    choice after the last of them [1])."""
    if drafts.size:
        accepted = mx.cumprod((drafts == choices[:-1]).astype(mx.int32)).sum()
    else:
        accepted = mx.array(0)
    return accepted, mx.take(choices, accepted.reshape(1))


class Greedy(_Acceptance):
    """Drafts and the trunk's tokens are argmaxes; a draft is kept while it equals the trunk's choice.
    With penalties (`Sampling`), argmaxes of the penalised logits, each position with its own history."""

    def __init__(self, sampling: Sampling | None = None):
        self.sampling = sampling if sampling is not None and sampling.penalised else None
        self.history = self.sampling is not None
        self.key = ("greedy",) if self.sampling is None else ("greedy", self.sampling.key)

    def _scores(self, logits, history):
        return logits if history is None else penalise(logits, *history, self.sampling)

    def pick(self, logits: mx.array, key: mx.array, history=None):
        """A token [1] from logits [1, V], and what the acceptance needs of its
        distribution (nothing here)."""
        return mx.argmax(self._scores(logits, history), axis=-1).astype(mx.int32), None

    def accept(self, drafts: mx.array, draft_dists: list, logits: mx.array,
               key: mx.array, history=None, first=None):
        """Drafts [k], verify logits [k + 1, V] -> (accepted drafts, the trunk's next
        token [1])."""
        return _agreeing_prefix(drafts, mx.argmax(self._scores(logits, history), axis=-1).astype(mx.int32))


def position_key(key: mx.array, position) -> mx.array:
    """The key of the token at `position` (an int or an int32 array): a function of the seed's key and the
    position only. The seed's key is hashed first, so that neighbouring seeds (a conversation's turns: seed + n)
    do not share the keys of shifted positions; the position then enters one word of it, and the result is
    hashed again (MLX's keys are threefry keys, which may serve as stream ids)."""
    seed_words = mx.random.split(key)[0]
    word = mx.array(position).astype(mx.uint32)
    mixed = mx.bitwise_xor(seed_words, mx.stack([mx.array(0, mx.uint32), word]))
    return mx.random.split(mixed)[0]


def gumbel_noise(key: mx.array, vocab: int) -> mx.array:
    """Standard Gumbel noise [V] from a position's key (what `mx.random.categorical` adds to log-weights)."""
    return mx.random.gumbel((vocab,), key=key)


class Coupled(_Acceptance):
    """Sampling by the Gumbel-max trick with one noise per position, shared by the drafts and the trunk: the
    token at position t is argmax(log p_t + g_t), a sample of p_t, the trunk's processed distribution
    (`qmtp.sampling`), g_t Gumbel noise that depends on the seed and t only (`position_key`); the draft for t
    is argmax(log q_t + g_t) with the same g_t, and is kept while it equals the trunk's token.

    So the tokens are a function of the seed and the trunk's distributions alone: the same whatever the widths
    (n_draft 1..8 or "auto", whose widths follow the clock), from one run to the next, and in a batch whatever
    the other rows do. Each g_t is independent of the noise that chose the tokens before t, so token t has the
    law p_t given them: exactly the trunk's distribution. The price: a draft is kept with probability
    P(argmax(log q + g) = argmax(log p + g)), at most rejection sampling's sum(min(p, q))
    (`tools/measure_coupling.py` measures the difference)."""

    random = True
    by_position = True

    def __init__(self, sampling: Sampling | float):
        if not isinstance(sampling, Sampling):
            sampling = Sampling(temperature=float(sampling))
        self.sampling = sampling
        self.history = sampling.penalised
        self.key = ("coupled", sampling.key)

    def key_at(self, key: mx.array, position) -> mx.array:
        return position_key(key, position)

    def keys(self, key: mx.array, first, n: int) -> list:
        return [position_key(key, first + i) for i in range(n)]

    def _scores(self, logits, history):
        """log p up to a constant per row: the processed logits (softmax's normaliser moves no argmax)."""
        if history is not None:
            logits = penalise(logits, *history, self.sampling)
        return warp(logits, self.sampling)

    def pick(self, logits: mx.array, key: mx.array, history=None):
        """A token [1] from logits [1, V] with its position's key (`key_at`)."""
        scores = self._scores(logits, history)
        noise = gumbel_noise(key, scores.shape[-1])
        return mx.argmax(scores + noise[None], axis=-1).astype(mx.int32), None

    def accept(self, drafts: mx.array, draft_dists: list, logits: mx.array,
               key: mx.array, history=None, first=None):
        scores = self._scores(logits, history)  # [k + 1, V]
        noise = mx.stack([gumbel_noise(position_key(key, first + j), scores.shape[-1])
                          for j in range(scores.shape[0])])
        return _agreeing_prefix(drafts, mx.argmax(scores + noise, axis=-1).astype(mx.int32))


class Rejection(_Acceptance):
    """Sampling (`Sampling`, or a temperature alone): draft d ~ q, kept with probability min(1, p(d) / q(d));
    at the first rejection the next token is drawn from max(0, p - q) renormalised, after all k from p
    (Leviathan et al. 2023). p and q are the processed distributions (`qmtp.sampling`: penalties,
    temperature, top-k, top-p, min-p) of the trunk's and the head's logits, each position with its own
    history, so the tokens have exactly the distribution of sampling the trunk alone with those settings.
    Its random numbers are drawn per step, so the tokens depend on the widths: `Coupled` is the default,
    this the reference it is measured against (`generate(..., engine=Engine(acceptance="rejection"))`)."""

    random = True

    def __init__(self, sampling: Sampling | float):
        if not isinstance(sampling, Sampling):
            sampling = Sampling(temperature=float(sampling))
        self.sampling = sampling
        self.temperature = sampling.temperature
        self.history = sampling.penalised
        plain = not (sampling.penalised or sampling.filtered)
        self.key = ("sample", self.temperature) if plain else ("sample", sampling.key)

    def keys(self, key: mx.array, first, n: int) -> list:
        return mx.random.split(key, n)

    def _distribution(self, logits, history=None):
        if history is not None:
            logits = penalise(logits, *history, self.sampling)
        return mx.softmax(warp(logits, self.sampling), axis=-1)

    def pick(self, logits: mx.array, key: mx.array, history=None):
        q = self._distribution(logits, history)
        return mx.random.categorical(mx.log(q), key=key).astype(mx.int32), q[0]

    def accept(self, drafts: mx.array, draft_dists: list, logits: mx.array,
               key: mx.array, history=None, first=None):
        p = self._distribution(logits, history)  # [k + 1, V]
        k = drafts.size
        test_key, draw_key = mx.random.split(key)
        accepted, residual = mx.array(0), p
        if k:
            q = mx.stack(draft_dists)
            ratio = (mx.take_along_axis(p[:k], drafts[:, None], axis=-1)
                     / mx.take_along_axis(q, drafts[:, None], axis=-1))[:, 0]
            kept = mx.random.uniform(shape=(k,), key=test_key) < ratio
            accepted = mx.cumprod(kept.astype(mx.int32)).sum()
            residual = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]])
        row = mx.take(residual, accepted.reshape(1), axis=0)
        row = mx.where(row.sum() > 0, row, mx.take(p, accepted.reshape(1), axis=0))
        return accepted, mx.random.categorical(mx.log(row), key=draw_key).astype(mx.int32)


def strategy_for(sampling: Sampling, acceptance: str = "coupled"):
    """Greedy at temperature 0 (penalties still apply); otherwise sampling with `acceptance`: "coupled" (the
    default: drafts and trunk share each position's noise, so a seed gives the same tokens at any width) or
    "rejection" (Leviathan et al.'s rejection sampling, per-step randomness)."""
    if acceptance not in ACCEPTANCES:
        raise UsageError(f"acceptance={acceptance!r:.40}: use 'coupled' (the default) or 'rejection'")
    if sampling.greedy:
        return Greedy(sampling)
    return Coupled(sampling) if acceptance == "coupled" else Rejection(sampling)


