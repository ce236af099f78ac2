"""Decoding on the device: the whole state as arrays, and one decode or speculative step as a pure function.

Speculative decoding keeps a variable number of tokens per step, which an engine usually learns on the host
before it can build the next step: one host sync per step, and the machine idle while Python builds the next
graph. Here nothing the next step needs lives on the host:

- the KV caches are buffers of a fixed capacity (the prompt, the new tokens and the drafts verified past
  them, known before decoding starts), written at a position held in an array, and read through a mask of
  the valid positions, so their shapes never depend on how many drafts were accepted;
- the linear-attention state of every position of a verify pass is kept, and the accepted one chosen by an
  index held in an array (the roll back);
- acceptance is computed on the device: the longest prefix of drafts equal to the trunk's choices (greedy:
  argmaxes; sampled: argmaxes with the same Gumbel noise per position, or rejection sampling).

So a step is a function of arrays to arrays, of fixed shapes for a given draft length: `mx.compile` traces
it once and replays it with the elementwise work of all layers fused, and the host can queue step s + 1
(`mx.async_eval`) before it reads the tokens of step s. Reading them is the step's only host sync; with
them come whether the trunk's logits behind them were finite and which drafts came from finite head logits
(damaged weights give NaN logits, whose argmax is an arbitrary token: the host stops instead of writing it).

A step, with the trunk's cache holding positions 0..t-1 and `last` the previous verify pass (its trunk
states, the trunk's choice after each of its positions, and how many of them were kept):

1. draft: the head reads the kept positions of the last pass (trunk state h_j with the trunk's choice after
   it), its state at the last kept one drafts d_1, and fed its own output and d_1 it drafts d_2, ...
2. verify: one trunk pass over [pending, d_1, ..., d_k], `pending` being the trunk's last choice;
3. accept: the trunk's choice after each position; the longest prefix of drafts equal to those choices is
   kept, and the trunk's choice after the last kept token is the next pending token;
4. roll back: the offset advances by the kept tokens only; each linear-attention layer takes its state at
   the last kept position. Entries past the offset are stale, masked, and overwritten by the next step.
"""

from __future__ import annotations

import mlx.core as mx

from .config import LINEAR
from .errors import UsageError
from .sampling import Sampling, one_hot, penalise, warp

MIN_CAPACITY = 64


def capacity_for(positions: int) -> int:
    """KV buffer length for `positions`: a power of two (at least MIN_CAPACITY), so that generations of
    similar length share one compiled trace while attention reads at most twice the positions it needs."""
    return max(MIN_CAPACITY, 1 << (positions - 1).bit_length())


# ---- the state ----------------------------------------------------------------------------------------------
def empty_state(model, capacity: int, head: bool) -> dict:
    """Zero state for a batch of one: per layer (conv inputs, recurrent S) or (keys, values) buffers of
    `capacity` positions; `offset` the positions held. With `head`, the MTP head's KV buffers too."""
    dtype = model.dtype
    state = {"layers": [layer.empty_state(1, capacity, dtype) for layer in model.layers],
             "offset": mx.array(0, mx.int32)}
    if head:
        state["head"] = model.mtp.layers[0].empty_state(1, capacity, dtype)
        state["head_offset"] = mx.array(0, mx.int32)
    return state


def capacity_of(model, state: dict) -> int | None:
    """The positions the state's KV buffers hold (None when it has none: no attention layer and no head)."""
    buffers = [s for layer, s in zip(model.layers, state["layers"]) if layer.kind != LINEAR]
    buffers += [state["head"]] if "head" in state else []
    return buffers[0][0].shape[2] if buffers else None


def grow_state(model, state: dict, capacity: int) -> dict:
    """The state with KV buffers of `capacity` positions (the held ones copied, the rest zeros): a longer
    conversation than the buffers were made for. The linear-attention state has no length: it is kept."""
    def grown(buffers):
        keys, values = buffers
        pad = [(0, 0), (0, 0), (0, capacity - keys.shape[2]), (0, 0)]
        return mx.pad(keys, pad), mx.pad(values, pad)

    layers = [grown(s) if layer.kind != LINEAR else s for layer, s in zip(model.layers, state["layers"])]
    out = {**state, "layers": layers}
    if "head" in state:
        out["head"] = grown(state["head"])
    return out


def cut_state(model, state: dict, capacity: int) -> dict:
    """The state with KV buffers cut to their first `capacity` positions (those it holds must fit): a prompt
    prefilled into buffers for its whole length that goes on as a row of a batch, whose buffers grow as its
    rows need (attention reads the whole buffer)."""
    def cut(buffers):
        return tuple(b[:, :, :capacity] for b in buffers)

    layers = [cut(s) if layer.kind != LINEAR else s for layer, s in zip(model.layers, state["layers"])]
    out = {**state, "layers": layers}
    if "head" in state:
        out["head"] = cut(state["head"])
    return out


# ---- the trunk and the head over the state ------------------------------------------------------------------
def trunk_step(model, tokens: mx.array, state: dict, record: bool):
    """The trunk over tokens [1, T] from `state`: (its output before and after the final norm [1, T, H], the
    experts each layer chose, the layers' new states, recorded per position for linear attention when
    `record`). The offset is not moved."""
    x = model.embed(tokens)
    experts, layers = [], []
    for layer, layer_state in zip(model.layers, state["layers"]):
        x, new_state, indices, _ = layer.step(x, layer_state, state["offset"], record)
        experts.append(indices)
        layers.append(new_state)
    return x, model.norm(x), experts, layers


def keep_prefix(model, recorded_layers: list, keep: mx.array) -> list:
    """Roll back: each linear-attention layer's state after the `keep`-th position of
    the recorded pass (KV buffers need nothing: the offset says which entries are
    valid)."""
    index = (keep - 1).reshape(1)
    out = []
    for layer, layer_state in zip(model.layers, recorded_layers):
        if layer.kind == LINEAR:
            out.append(tuple(mx.take(s, index, axis=0)[0] for s in layer_state))
        else:
            out.append(layer_state)
    return out


def head_step(model, head, hidden: mx.array, tokens: mx.array, buffers, at: mx.array):
    """The head over (trunk or head states [1, T, H], the tokens after them [1, T]) at head positions at..:
    (its post-norm states [1, T, H], its new KV buffers)."""
    _, post, buffers = head_states(model, head, hidden, tokens, buffers, at)
    return post, buffers


def head_states(model, head, hidden: mx.array, tokens: mx.array, buffers, at: mx.array):
    """`head_step` with the head's output before its own final norm too: (pre-norm states, post-norm
    states, its new KV buffers). A chained draft is fed one of the two (`draft`'s `chain`)."""
    z = head.combine(hidden, model.embed(tokens))
    z, buffers, _, _ = head.layers[0].step(z, buffers, at)
    return z, head.norm(z), buffers


# The engines' choices that `draft` can make, as options (chapter 5 measures what each costs):
HEAD_CACHES = ("keep", "reset")  # the head's KV cache kept across steps, or emptied at every step
CHAINS = ("post", "pre")  # a chained draft fed the head's output after its own final norm, or before it
DRAFTING = (HEAD_CACHES[0], CHAINS[0])  # the defaults: vLLM's and SGLang's


# ---- acceptance: greedy, coupled sampling, or rejection sampling ----------------------------------------------
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


# ---- one step: draft, verify, accept, roll back -----------------------------------------------------------
def draft(model, head, k: int, strategy, state: dict, last, key, head_cache: str = "keep",
          chain: str = "post", history=None):
    """k drafts [1, k] from the head, their distributions, and the head's new buffers
    and offset.

    The head first reads the positions of the last pass (trunk state h_j with the token
    after it) of which the first `keep` are valid: their entries stay in its cache. Its
    output at the last valid one drafts d_1; each further draft feeds the head its own
    output and the draft before.

    head_cache="reset" empties the head's cache at every step, as lemon-mlx-engine does:
    the head reads only the position it drafts from (and its own chained drafts), so its
    attention sees none of the text before. chain="pre" feeds a chained draft the head's
    output before its own final norm (ik_llama.cpp before its PR 1815), "post" after it
    (vLLM, SGLang). Both change the drafts only: verification keeps the output exact.
    `history` (penalties): (the counts before d_1 [V], prompt_seen); each draft's counts
    add the drafts before it."""
    hidden, next_tokens, keep = last
    last_kept = (keep - 1).reshape(1)
    offset = state["head_offset"] + keep
    if head_cache == "reset":
        buffers = head.layers[0].empty_state(1, k, model.dtype)
        z_pre, z, buffers = head_states(
            model, head, mx.take(hidden, last_kept, axis=1),
            mx.take(next_tokens, last_kept, axis=1), buffers, mx.array(0, mx.int32))
        at = mx.array(1, mx.int32)  # chained drafts follow in the emptied cache
    else:
        z_pre, z, buffers = head_states(model, head, hidden, next_tokens, state["head"],
                                        state["head_offset"])
        z_pre, z = (mx.take(s, last_kept, axis=1) for s in (z_pre, z))
        at = offset
    drafts, dists, finite = [], [], []
    keys = strategy.keys(key, state["offset"] + 1, k)  # d_1 guesses the token after `pending`
    counts = history[0][None] if history is not None else None
    for i, draft_key in enumerate(keys):
        logits = model.logits(z)[:, -1].astype(mx.float32)
        seen = None if counts is None else (counts, history[1])
        d, dist = strategy.pick(logits, draft_key, seen)
        drafts.append(d)
        dists.append(dist)
        finite.append(mx.isfinite(logits).all().reshape(1))
        # entries past `offset` are the head's own guesses: the next step overwrites
        # them
        if i + 1 < k:
            fed = z if chain == "post" else z_pre
            z_pre, z, buffers = head_states(model, head, fed, d.reshape(1, 1), buffers,
                                            at + i)
            if counts is not None:
                counts = counts + one_hot(d, counts.shape[-1])
    drafts = mx.concatenate(drafts).reshape(1, k)
    if head_cache == "reset":  # the kept cache is left as it was: nothing reads it
        buffers = state["head"]
    return drafts, dists, mx.concatenate(finite), buffers, offset


def follow(model, head, state: dict, last):
    """The head reads the kept positions of the last pass into its cache and drafts nothing: a plain step
    after which drafting can resume (its cache misses no position). The head's new buffers and offset."""
    hidden, next_tokens, keep = last
    _, buffers = head_step(model, head, hidden, next_tokens, state["head"], state["head_offset"])
    return buffers, state["head_offset"] + keep


def verify(model, tokens: mx.array, state: dict, record: bool):
    """One trunk pass over [pending, d_1..d_k]: (pre-norm and post-norm states, logits [k + 1, V], experts,
    the layers' states)."""
    pre, post, experts, layers = trunk_step(model, tokens, state, record)
    return pre, post, model.logits(post)[0].astype(mx.float32), experts, layers


def roll_back(model, layers: list, keep: mx.array, record: bool) -> list:
    return keep_prefix(model, layers, keep) if record else layers


def step(model, head, k: int, strategy, hidden: str, record: bool, state: dict, last,
         key, head_cache: str = "keep", chain: str = "post", follows: bool = False):
    """One trunk pass and the drafts it checks: (new state, what the next step needs,
    the report [pending, d_1..d_k, next, keep, finite, draft_finite_1..k] as int32,
    experts per layer, new key).

    `finite` counts the leading verify positions whose logits are all finite: below
    `keep`, the kept tokens were chosen from NaN or Inf (damaged weights), which the
    host learns in the same read as the tokens. `draft_finite_i` is 0 where the head's
    logits for d_i were not finite (such a draft is an arbitrary token, which
    verification treats like any other). With k = 0 and `follows`, the head still reads
    the last pass (`follow`), so that a later step can draft."""
    if strategy.random and not strategy.by_position:  # per-step randomness: a new key for each step
        key, draft_key, accept_key = mx.random.split(key, 3)
    else:  # none, or the seed's key, from which each position's key is made
        draft_key = accept_key = key
    _, next_tokens, keep = last
    pending = mx.take(next_tokens, (keep - 1).reshape(1), axis=1)
    new_state = {}
    history = None
    if strategy.history:  # the pending token is generated: every position scored here counts it
        vocab = state["counts"].shape[-1]
        history = (state["counts"] + one_hot(pending, vocab)[0], state["prompt_seen"])
    if k:
        drafts, dists, drafts_finite, head_buffers, head_offset = draft(
            model, head, k, strategy, state, last, draft_key, head_cache, chain, history)
        new_state["head"], new_state["head_offset"] = head_buffers, head_offset
        tokens = mx.concatenate([pending, drafts], axis=1)
    else:
        dists, tokens, drafts_finite = [], pending, mx.zeros((0,), mx.bool_)
        if follows:
            new_state["head"], new_state["head_offset"] = follow(model, head, state, last)
    pre, post, logits, experts, layers = verify(model, tokens, state, record)
    rows = None
    if history is not None:  # position j follows pending, d_1..d_j
        counts = state["counts"][None] + mx.cumsum(one_hot(tokens[0], vocab), axis=0)
        rows = (counts, history[1])
    accepted, next_token = strategy.accept(tokens[0, 1:], dists, logits, accept_key,
                                           rows, state["offset"] + 1)
    keep = accepted + 1
    if history is not None:  # the kept tokens enter the cache: pending, d_1..d_accepted
        new_state["counts"] = mx.take(counts, accepted.reshape(1), axis=0)[0]
        new_state["prompt_seen"] = history[1]
    new_state["layers"] = roll_back(model, layers, keep, record)
    new_state["offset"] = state["offset"] + keep
    # The head's input for the kept positions: the token after each (an accepted draft,
    # then `next`).
    n = k + 1
    nxt = next_token.reshape(1, 1)
    after = mx.concatenate([tokens[:, 1:], nxt], axis=1)
    after = mx.where(mx.arange(n)[None] == keep - 1, nxt, after)
    finite = mx.cumprod(mx.isfinite(logits).all(axis=-1).astype(mx.int32)).sum()
    report = mx.concatenate([tokens[0], next_token, keep.reshape(1).astype(mx.int32),
                             finite.reshape(1), drafts_finite.astype(mx.int32)])
    hidden_out = post if hidden == "post" else pre
    return new_state, (hidden_out, after, keep), report, experts, key


# ---- a batch of rows, each at its own position (`qmtp.continuous`) -----------------------------------------
# The same state with a leading batch axis: `offset` and `head_offset` are [B] (each row's own positions), and
# `last` is (states [B, n, H], tokens after them [B, n], keep [B]). Each row is accepted by its own strategy,
# with its own key and its own cap on the drafts it counts (`caps`: a row's n_draft - 1 within the step's
# width), so a row's tokens are those of its own run: the batch shares the passes, nothing else.
def trunk_step_rows(model, tokens: mx.array, state: dict, record: bool):
    """`trunk_step` over tokens [B, T], row b at state["offset"][b]."""
    x = model.embed(tokens)
    experts, layers = [], []
    for layer, layer_state in zip(model.layers, state["layers"]):
        x, new_state, indices, _ = layer.step_rows(x, layer_state, state["offset"], record)
        experts.append(indices)
        layers.append(new_state)
    return x, model.norm(x), experts, layers


def keep_prefix_rows(model, recorded_layers: list, keep: mx.array) -> list:
    """Roll back each row to its own kept prefix: row b's linear-attention state after its keep[b]-th position."""
    out = []
    for layer, layer_state in zip(model.layers, recorded_layers):
        if layer.kind == LINEAR:  # recorded [T, B, ...]
            out.append(tuple(mx.take_along_axis(s, (keep - 1).reshape((1, -1) + (1,) * (s.ndim - 2)), axis=0)[0]
                             for s in layer_state))
        else:
            out.append(layer_state)
    return out


def head_states_rows(model, head, hidden: mx.array, tokens: mx.array, buffers, at: mx.array):
    """`head_states` for rows at their own head positions at [B]."""
    z = head.combine(hidden, model.embed(tokens))
    z, buffers, _, _ = head.layers[0].step_rows(z, buffers, at)
    return z, head.norm(z), buffers


def _by_position(strategy) -> bool:
    """Whether the strategy draws each token's randomness from (seed, position) (coupled sampling, where it
    exists): its keys are then made from the row's positions, never split per step."""
    return getattr(strategy, "by_position", False)


def _row_keys(strategies, keys: mx.array):
    """Per row (step key, draft key, accept key), split as `step` splits a single run's key."""
    out = []
    for b, strategy in enumerate(strategies):
        key = keys[b]
        per_step = strategy.random and not _by_position(strategy)
        out.append(tuple(mx.random.split(key, 3)) if per_step else (key, key, key))
    return out


def _draft_keys(strategies, caps, draft_keys, offsets: mx.array) -> list:
    """Per row, the keys of its counted drafts: by position (d_1 guesses the token after `pending`, at the
    row's offset + 1), or split off the step's draft key as a single run splits it."""
    out = []
    for b, (strategy, cap, key) in enumerate(zip(strategies, caps, draft_keys)):
        if _by_position(strategy):
            out.append(strategy.keys(key, offsets[b] + 1, cap))
        else:
            out.append(mx.random.split(key, cap) if strategy.random and cap else [key] * cap)
    return out


def draft_rows(model, head, k: int, strategies, caps, state: dict, last, draft_keys, chain: str = "post",
               counts=None):
    """`draft` for a batch: k drafts per row [B, k] (row b's first caps[b] picked by its strategy with its
    keys, the others argmaxes nobody counts), their distributions per row, which came from finite logits
    [B, k], and the head's new buffers and offsets. `counts` [B, V] (penalties): each row's generated-token
    counts before d_1; a penalised row's d_i is picked with the drafts before it counted, as `draft` does."""
    hidden, next_tokens, keep = last
    last_kept = (keep - 1)[:, None, None]
    offset = state["head_offset"] + keep
    z_pre, z, buffers = head_states_rows(model, head, hidden, next_tokens, state["head"], state["head_offset"])
    z_pre, z = (mx.take_along_axis(s, last_kept, axis=1) for s in (z_pre, z))
    keys = _draft_keys(strategies, caps, draft_keys, state["offset"])
    drafts, dists, finite = [], [[] for _ in strategies], []
    for i in range(k):
        logits = model.logits(z)[:, -1].astype(mx.float32)  # [B, V]
        picked = []
        for b, strategy in enumerate(strategies):
            if i < caps[b]:
                seen = (counts[b:b + 1], state["prompt_seen"][b]) if strategy.history else None
                d, dist = strategy.pick(logits[b:b + 1], keys[b][i], seen)
                dists[b].append(dist)
            else:
                d = mx.argmax(logits[b:b + 1], axis=-1).astype(mx.int32)
            picked.append(d)
        d = mx.concatenate(picked)
        drafts.append(d)
        finite.append(mx.isfinite(logits).all(axis=-1))
        if i + 1 < k:
            fed = z if chain == "post" else z_pre
            z_pre, z, buffers = head_states_rows(model, head, fed, d.reshape(-1, 1), buffers, offset + i)
            if counts is not None:
                counts = counts + one_hot(d, counts.shape[-1])
    return mx.stack(drafts, axis=1), dists, mx.stack(finite, axis=1), buffers, offset


def _fed_row(strategy, logits: mx.array, feed: dict, b: int):
    """A prompt's row in a step (`step_rows`' feeding): (accepted [1]: all its tokens but the first, its next
    token [1], whether the logits at its last position are finite). At its last piece the next token is the
    first generated one, picked from those logits with its first key, as `continuous._prefill_row` picks it."""
    kept = feed["keep"][b]
    at_last = mx.take(logits, (kept - 1).reshape(1), axis=0)  # [1, V]
    first, _ = strategy.pick(at_last, feed["first_key"][b])
    given = feed["next"][b]
    return ((kept - 1).reshape(1), mx.where(given >= 0, given, first[0]).reshape(1).astype(mx.int32),
            mx.isfinite(at_last).all())


def step_rows(model, head, k: int, strategies, caps, hidden: str, state: dict, last, keys: mx.array,
              chain: str = "post", follows: bool = False, feeding: tuple = (), feed: dict | None = None):
    """`step` for a batch of rows: (new state, what the next step needs, the report [B, 4 + 2k] (per row
    [pending, d_1..d_k, next, keep, finite, draft_finite_1..k]), experts per layer, new keys [B, 2]).

    feeding[b] true: row b is a prompt still being read (`qmtp.continuous`: a joining prompt rides in the rows'
    pass). Its tokens are feed["tokens"][b] (the prompt's next ones, its pending first) and all
    feed["keep"][b] of them are kept; its next token is feed["next"][b] (the prompt's following token) or, at
    -1 (its last piece), the first generated token, picked as a prefill picks it: from the logits at its last
    prompt position with feed["first_key"][b]. Its key becomes feed["after_key"][b]."""
    split = _row_keys(strategies, keys)
    _, next_tokens, keep = last
    pending = mx.take_along_axis(next_tokens, (keep - 1)[:, None], axis=1)  # [B, 1]
    new_state, dists = {}, [[] for _ in strategies]
    # penalties: every row carries counts [B, V] and prompt_seen [B, V] once one row is penalised (the others'
    # are carried along unread); the pending token is generated, so every position scored here counts it
    history = "counts" in state
    if history:
        vocab = state["counts"].shape[-1]
        counts = state["counts"] + one_hot(pending[:, 0], vocab)
    if k:
        drafts, dists, drafts_finite, new_state["head"], new_state["head_offset"] = draft_rows(
            model, head, k, strategies, caps, state, last, [s[1] for s in split], chain,
            counts if history else None)
        tokens = mx.concatenate([pending, drafts], axis=1)
    else:
        tokens, drafts_finite = pending, mx.zeros((pending.shape[0], 0), mx.bool_)
        if follows:
            hidden_in, after_in, keep_in = last
            _, _, new_state["head"] = head_states_rows(model, head, hidden_in, after_in, state["head"],
                                                       state["head_offset"])
            new_state["head_offset"] = state["head_offset"] + keep_in
    if any(feeding):
        tokens = mx.where(mx.array(feeding)[:, None], feed["tokens"], tokens)
    pre, post, experts, layers = trunk_step_rows(model, tokens, state, record=k > 0)
    logits = model.logits(post).astype(mx.float32)  # [B, k + 1, V]
    if history:  # position j of row b follows its pending, d_1..d_j
        counts = state["counts"][:, None] + mx.cumsum(one_hot(tokens, vocab).reshape(tokens.shape + (vocab,)), axis=1)
    accepted, next_token, fed_finite = [], [], []
    for b, strategy in enumerate(strategies):
        if b < len(feeding) and feeding[b]:
            a, t, f = _fed_row(strategy, logits[b], feed, b)
            accepted.append(a)
            next_token.append(t)
            fed_finite.append(f)
            continue
        where = {"first": state["offset"][b] + 1} if _by_position(strategy) else {}
        if strategy.history:
            where["history"] = (counts[b, :caps[b] + 1], state["prompt_seen"][b])
        a, t = strategy.accept(tokens[b, 1:1 + caps[b]], dists[b], logits[b, :caps[b] + 1], split[b][2], **where)
        accepted.append(a.reshape(1))
        next_token.append(t.reshape(1))
    accepted, next_token = mx.concatenate(accepted), mx.concatenate(next_token)
    keep = accepted + 1
    if history:  # each row's kept tokens enter its counts: pending, d_1..d_accepted
        new_state["counts"] = mx.take_along_axis(counts, accepted[:, None, None], axis=1)[:, 0]
        new_state["prompt_seen"] = state["prompt_seen"]
    new_state["layers"] = keep_prefix_rows(model, layers, keep) if k else layers
    new_state["offset"] = state["offset"] + keep
    n, nxt = k + 1, next_token[:, None]
    after = mx.concatenate([tokens[:, 1:], nxt], axis=1)
    after = mx.where(mx.arange(n)[None] == (keep - 1)[:, None], nxt, after)
    finite = mx.cumprod(mx.isfinite(logits).all(axis=-1).astype(mx.int32), axis=1).sum(axis=1)
    if any(feeding):  # a prompt's row: as a prefill, only its last position's logits are checked (its last piece)
        fed = iter(fed_finite)
        finite = mx.concatenate([mx.where(next(fed), keep[b], 0).reshape(1) if b < len(feeding) and feeding[b]
                                 else finite[b:b + 1] for b in range(len(strategies))])
    report = mx.concatenate([tokens, nxt, keep[:, None].astype(mx.int32), finite[:, None].astype(mx.int32),
                             drafts_finite.astype(mx.int32)], axis=1)
    new_keys = mx.stack([feed["after_key"][b] if b < len(feeding) and feeding[b] else s[0]
                         for b, s in enumerate(split)])
    return new_state, (post if hidden == "post" else pre, after, keep), report, experts, new_keys
