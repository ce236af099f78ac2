"""Decoding on the device: the whole state as arrays, and one decode or speculative step over B rows as a pure
function (`generate` is a batch of one; `qmtp.continuous` runs many).

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

The state has a leading batch axis: `offset` and `head_offset` are [B] (each row's own positions) and `last`
is (states [B, n, H], tokens after them [B, n], keep [B]). Each row is accepted by its own strategy
(`qmtp.acceptance`), with its own key and its own cap on the drafts it counts (a row's n_draft - 1 within the
step's width), so a row's tokens are those of its own run: the rows share the passes, nothing else.

A step, with a row's trunk cache holding positions 0..t-1 and `last` the previous verify pass (its trunk
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

from dataclasses import dataclass

import mlx.core as mx

from .config import LINEAR
from .model import COMPILE
from .sampling import one_hot
from .traces import traces_of

MIN_CAPACITY = 64

# The engines' choices that `draft` can make, as options (chapter 5 measures what each costs):
HEAD_CACHES = ("keep", "reset")  # the head's KV cache kept across steps, or emptied at every step
CHAINS = ("post", "pre")  # a chained draft fed the head's output after its own final norm, or before it
DRAFTING = (HEAD_CACHES[0], CHAINS[0])  # the defaults: vLLM's and SGLang's


def capacity_for(positions: int) -> int:
    """KV buffer length for `positions`: a power of two (at least MIN_CAPACITY), so that generations of
    similar length share one compiled trace while attention reads at most twice the positions it needs."""
    return max(MIN_CAPACITY, 1 << (positions - 1).bit_length())


# ---- the state ----------------------------------------------------------------------------------------------
def empty_state(model, capacity: int, head: bool, rows: int = 1) -> dict:
    """Zero state for `rows` rows: per layer (conv inputs, recurrent S) or (keys, values) buffers of `capacity`
    positions; `offset` [rows] the positions each row holds. With `head`, the MTP head's KV buffers too."""
    dtype = model.dtype
    state = {"layers": [layer.empty_state(rows, capacity, dtype) for layer in model.layers],
             "offset": mx.zeros((rows,), mx.int32)}
    if head:
        state["head"] = model.mtp.layers[0].empty_state(rows, capacity, dtype)
        state["head_offset"] = mx.zeros((rows,), mx.int32)
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
    """The trunk over tokens [B, T], row b from state["offset"][b]: (its output before and after the final
    norm [B, T, H], the experts each layer chose, the layers' new states, recorded per position for linear
    attention when `record`). The offsets are not moved."""
    x = model.embed(tokens)
    experts, layers = [], []
    for layer, layer_state in zip(model.layers, state["layers"]):
        x, new_state, indices, _ = layer.step(x, layer_state, state["offset"], record)
        experts.append(indices)
        layers.append(new_state)
    return x, model.norm(x), experts, layers


def keep_prefix(model, recorded_layers: list, keep: mx.array) -> list:
    """Roll back each row to its own kept prefix: row b's linear-attention state after its keep[b]-th position
    of the recorded pass (KV buffers need nothing: the offset says which entries are valid)."""
    out = []
    for layer, layer_state in zip(model.layers, recorded_layers):
        if layer.kind == LINEAR:  # recorded [T, B, ...]
            out.append(tuple(mx.take_along_axis(s, (keep - 1).reshape((1, -1) + (1,) * (s.ndim - 2)), axis=0)[0]
                             for s in layer_state))
        else:
            out.append(layer_state)
    return out


def head_states(model, head, hidden: mx.array, tokens: mx.array, buffers, at: mx.array):
    """The head over (trunk or head states [B, T, H], the tokens after them [B, T]), row b at head positions
    at[b]..: (its output before its own final norm, after it, its new KV buffers). A chained draft is fed one
    of the two (`draft`'s `chain`)."""
    z = head.combine(hidden, model.embed(tokens))
    z, buffers, _, _ = head.layers[0].step(z, buffers, at)
    return z, head.norm(z), buffers


def head_step(model, head, hidden: mx.array, tokens: mx.array, buffers, at: mx.array):
    """`head_states`' post-norm states and new buffers (the head reading positions, drafting nothing)."""
    _, post, buffers = head_states(model, head, hidden, tokens, buffers, at)
    return post, buffers


# ---- one step: draft, verify, accept, roll back -----------------------------------------------------------
def _row_keys(strategies, keys: mx.array):
    """Per row (step key, draft key, accept key): a strategy whose randomness is per step splits a new key off
    the row's at every step; one by position (coupled) or none keeps the seed's key."""
    out = []
    for b, strategy in enumerate(strategies):
        key = keys[b]
        per_step = strategy.random and not strategy.by_position
        out.append(tuple(mx.random.split(key, 3)) if per_step else (key, key, key))
    return out


def _draft_keys(strategies, caps, draft_keys, offsets: mx.array) -> list:
    """Per row, the keys of its counted drafts (d_1 guesses the token after `pending`, at the row's offset + 1)."""
    return [strategy.keys(key, offsets[b] + 1, cap) if cap else []
            for b, (strategy, cap, key) in enumerate(zip(strategies, caps, draft_keys))]


def draft(model, head, k: int, strategies, caps, state: dict, last, draft_keys, head_cache: str = "keep",
          chain: str = "post", counts=None):
    """k drafts per row [B, k] from the head (row b's first caps[b] picked by its strategy with its keys, the
    others argmaxes nobody counts), their distributions per row, which came from finite logits [B, k], and the
    head's new buffers and offsets.

    The head first reads the positions of the last pass (trunk state h_j with the token after it) of which
    the first `keep` are valid: their entries stay in its cache. Its output at the last valid one drafts d_1;
    each further draft feeds the head its own output and the draft before.

    head_cache="reset" empties the head's cache at every step, as lemon-mlx-engine does: the head reads only
    the position it drafts from (and its own chained drafts), so its attention sees none of the text before.
    chain="pre" feeds a chained draft the head's output before its own final norm (ik_llama.cpp before its PR
    1815), "post" after it (vLLM, SGLang). Both change the drafts only: verification keeps the output exact.
    `counts` [B, V] (penalties): each row's generated-token counts before d_1; a penalised row's d_i is picked
    with the drafts before it counted."""
    hidden, next_tokens, keep = last
    rows = keep.shape[0]
    last_kept = (keep - 1)[:, None, None]
    offset = state["head_offset"] + keep
    if head_cache == "reset":
        buffers = head.layers[0].empty_state(rows, k, model.dtype)
        z_pre, z, buffers = head_states(
            model, head, mx.take_along_axis(hidden, last_kept, axis=1),
            mx.take_along_axis(next_tokens, (keep - 1)[:, None], axis=1), buffers, mx.zeros((rows,), mx.int32))
        at = mx.ones((rows,), mx.int32)  # chained drafts follow in the emptied cache
    else:
        z_pre, z, buffers = head_states(model, head, hidden, next_tokens, state["head"], state["head_offset"])
        z_pre, z = (mx.take_along_axis(s, last_kept, axis=1) for s in (z_pre, z))
        at = offset
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
        # entries past `offset` are the head's own guesses: the next step overwrites them
        if i + 1 < k:
            fed = z if chain == "post" else z_pre
            z_pre, z, buffers = head_states(model, head, fed, d.reshape(-1, 1), buffers, at + i)
            if counts is not None:
                counts = counts + one_hot(d, counts.shape[-1])
    if head_cache == "reset":  # the kept cache is left as it was: nothing reads it
        buffers = state["head"]
    return mx.stack(drafts, axis=1), dists, mx.stack(finite, axis=1), buffers, offset


def follow(model, head, state: dict, last):
    """The head reads the kept positions of the last pass into its cache and drafts nothing: a plain step
    after which drafting can resume (its cache misses no position). The head's new buffers and offsets."""
    hidden, next_tokens, keep = last
    _, buffers = head_step(model, head, hidden, next_tokens, state["head"], state["head_offset"])
    return buffers, state["head_offset"] + keep


def verify(model, tokens: mx.array, state: dict, record: bool):
    """One trunk pass over each row's [pending, d_1..d_k] [B, k + 1]: (pre-norm and post-norm states, logits
    [B, k + 1, V], experts, the layers' states, each linear-attention layer's recorded after every position
    when `record`, for the roll back)."""
    pre, post, experts, layers = trunk_step(model, tokens, state, record)
    return pre, post, model.logits(post).astype(mx.float32), experts, layers


def roll_back(model, layers: list, keep: mx.array, record: bool) -> list:
    """Each row's layers as they were after its kept tokens (`keep_prefix`); without `record` they are left past
    the whole pass, for the host to replay the kept tokens (`Engine(rollback="replay")`)."""
    return keep_prefix(model, layers, keep) if record else layers


def _fed_row(strategy, logits: mx.array, feed: dict, b: int):
    """A prompt's row in a step (`step`'s feeding): (accepted [1]: all its tokens but the first, its next token
    [1], whether the logits at its last position are finite). At its last piece the next token is the first
    generated one, picked from those logits with its first key, as `continuous._prefill_row` picks it."""
    kept = feed["keep"][b]
    at_last = mx.take(logits, (kept - 1).reshape(1), axis=0)  # [1, V]
    first, _ = strategy.pick(at_last, feed["first_key"][b])
    given = feed["next"][b]
    return ((kept - 1).reshape(1), mx.where(given >= 0, given, first[0]).reshape(1).astype(mx.int32),
            mx.isfinite(at_last).all())


def step(model, head, k: int, strategies, caps, hidden: str, record: bool, state: dict, last, keys: mx.array,
         head_cache: str = "keep", chain: str = "post", follows: bool = False, feeding: tuple = (),
         feed: dict | None = None):
    """One trunk pass over every row and the drafts it checks: (new state, what the next step needs, the
    report [B, 4 + 2k] (per row [pending, d_1..d_k, next, keep, finite, draft_finite_1..k], int32), experts
    per layer, new keys [B, 2]).

    `finite` counts a row's leading verify positions whose logits are all finite: below `keep`, the kept
    tokens were chosen from NaN or Inf (damaged weights), which the host learns in the same read as the
    tokens. `draft_finite_i` is 0 where the head's logits for d_i were not finite (such a draft is an
    arbitrary token, which verification treats like any other). With k = 0 and `follows`, the head still
    reads the last pass (`follow`), so that a later step can draft. `record`: the linear-attention states of
    every position are kept and each row rolled back to its kept prefix; without it the layers' states are
    those after all k + 1 tokens, and the host replays the kept ones (`Engine(rollback="replay")`).

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
        drafts, dists, drafts_finite, new_state["head"], new_state["head_offset"] = draft(
            model, head, k, strategies, caps, state, last, [s[1] for s in split], head_cache, chain,
            counts if history else None)
        tokens = mx.concatenate([pending, drafts], axis=1)
    else:
        tokens, drafts_finite = pending, mx.zeros((pending.shape[0], 0), mx.bool_)
        if follows:
            new_state["head"], new_state["head_offset"] = follow(model, head, state, last)
    if any(feeding):
        tokens = mx.where(mx.array(feeding)[:, None], feed["tokens"], tokens)
    record = record and k > 0
    pre, post, logits, experts, layers = verify(model, tokens, state, record)
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
        where = {"first": state["offset"][b] + 1} if strategy.by_position else {}
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
    new_state["layers"] = roll_back(model, layers, keep, record)
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


@dataclass(frozen=True)
class RowReport:
    """One row of a step's report, read once on the host (`read_report`).

    tokens: the pass's n tokens (the pending one, then the drafts); next_token: the trunk's token after the kept
    ones (a prompt's row: its first token, once its last piece is read); keep: tokens of the pass kept (1 + the
    drafts accepted; a prompt's row: tokens it read); finite: leading positions whose logits were all finite;
    draft_finite: per draft, 0 where the head's logits for it were not finite."""

    tokens: list[int]
    next_token: int
    keep: int
    finite: int
    draft_finite: list[int]

    @property
    def accepted(self) -> int:
        return self.keep - 1

    @property
    def emitted(self) -> list[int]:
        """The tokens the step adds to the row's reply, the accepted drafts and then the trunk's next."""
        return self.tokens[1:self.keep] + [self.next_token]


def read_report(report: mx.array, width: int) -> list[RowReport]:
    """A step's report [B, 4 + 2k] as one `RowReport` per row (one host read for the whole batch)."""
    return [RowReport(line[:width], line[width], line[width + 1], line[width + 2], line[width + 3:])
            for line in report.tolist()]


def compiled_step(model, head, k: int, strategies: tuple, caps: tuple, hidden: str, record: bool,
                  drafting=DRAFTING, follows: bool = False, feeding: tuple = (), compiled: bool = True):
    """`step` for these rows' strategies and caps, this width and these options (`drafting`: the head's cache and
    chain options; `follows`: a plain step whose head reads the pass; `feeding`: which rows read a prompt), traced
    by `mx.compile` once and replayed (the weights are implicit inputs, read at every call). Kept in the traces
    of the head that drafts (`qmtp.traces`: an ablation head's are freed with it), of the model when no head is
    read; for a single generation and a batch alike."""
    head = head if (k or follows) else None
    owner = head if head is not None else model
    feeding = feeding if any(feeding) else ()
    drafting = tuple(drafting) if k else DRAFTING
    record = record and k > 0
    key = ("step", id(model), k, tuple(s.key for s in strategies), caps, hidden, record, drafting, follows, feeding,
           compiled)

    def build():
        def run(state, last, keys, *feed):
            return step(model, head, k, strategies, caps, hidden, record, state, last, keys, *drafting, follows,
                        feeding, *feed)

        if COMPILE and compiled:
            implicit = [model.state] + ([head.state] if head is not None and head is not model.mtp else [])
            run = mx.compile(run, inputs=implicit)
        return run

    return traces_of(owner).get(key, build)
