"""The decoding state one generation leaves, kept so that the next one prefills only what differs.

A chat renders its whole history again at every turn, and the history it renders need not start with the
tokens already decoded: Qwen's template drops a reply's thinking once a later question follows, so the
reply as history is shorter than the reply as generated. What the next generation can keep is the longest
common prefix of the token ids the state holds and the ids of the new prompt.

Cutting the state back to a prefix is free for attention (its KV buffers are read through a mask up to an
offset: entries past it are ignored and overwritten) but impossible for linear attention (gated DeltaNet's
state is a running summary of every position). So the cache keeps snapshots of the linear-attention state
at a few positions (the end of each prompt, and positions its caller marks: where a turn's generation
prompt starts) and resumes from the latest snapshot at or before the common prefix; with the MTP head
drafting, a snapshot also keeps the trunk's state at the position before (what the head reads with the
next token). The head's KV entries, like attention's, stay valid below the offset.

Resuming gives the same tokens as a fresh generation over the same ids: the positions kept hold what a
fresh prefill would compute for them (up to the rounding of computing them in other passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .config import LINEAR
from .errors import UsageError

MAX_SNAPSHOTS = 6  # the latest: about two turns (a turn resumes within the last one; each costs the linear states)


@dataclass(eq=False)
class Snapshot:
    """The linear-attention state after the first `position` tokens (per trunk layer; None for attention
    layers), and the trunk's state at position - 1 [1, 1, H] (None when the head does not draft)."""

    position: int
    linear: list
    hidden: mx.array | None


@dataclass(eq=False)
class Resume:
    """Where a prefill starts: the first `position` prompt tokens are in `state` (None: start empty), and
    `pending` [1, n, H] holds the trunk's states at the n positions before `position` that the head has not
    read yet (None when the head does not draft)."""

    position: int = 0
    state: dict | None = None
    pending: mx.array | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """What `generate(..., prefix_cache=cache)` leaves for the next call: the state after the last generation,
    the token ids it holds, and snapshots of the linear-attention state. One model's while it holds a state: it
    refuses another until `clear()`. Drafting with another head (or none), or feeding the head other trunk
    states (`hidden`), starts it anew."""

    def __init__(self):
        self.marks: set[int] = set()  # positions of the next prompt to snapshot at
        self.clear()

    def __repr__(self) -> str:
        return f"PrefixCache({len(self.tokens)} tokens held, {len(self.snapshots)} snapshots)"

    def clear(self) -> None:
        """Forget the state: the next generation prefills its whole prompt, with any model."""
        self.model = None  # the model whose state this is: with none held, the cache is no model's
        self.tokens: list[int] = []  # the ids the state holds (the last generated token is not fed)
        self.state: dict | None = None
        self.pending: mx.array | None = None  # see `Resume`; None with a head: the head fell behind (a plain step)
        self.snapshots: list[Snapshot] = []
        self.owner: tuple | None = None  # (id of the drafter or None, hidden)
        self._live: tuple | None = None  # during a generation: see `hold`
        self._head: tuple | None = None  # during a generation: the head's last buffers and offset

    def mark(self, *positions: int) -> None:
        """Snapshot the linear-attention state also after these many tokens of the next prompt (where later
        prompts are likely to part from it: the start of a turn's generation prompt)."""
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise UsageError(f"mark: give token positions (integers >= 0), not {p!r:.40}")
        self.marks.update(positions)

    # ---- one generation: resume, snapshots, hold, settle -------------------------------------------------------
    def resume(self, model, drafter, hidden: str, prompt_tokens: list[int]) -> Resume:
        """Where the generation over `prompt_tokens` starts; the state is handed over (so the steps may reuse
        its buffers), and comes back with `settle`."""
        if self.model is not None and self.model is not model:
            raise UsageError("prefix_cache holds another model's decoding state: give each model its own "
                             "PrefixCache (or clear() this one, which frees it for any model)")
        owner = (id(drafter) if drafter is not None else None, hidden)
        if owner != self.owner:
            self.clear()
            self.owner = owner
        self.model = model
        # at least the last prompt token is fed: its logits choose the first new token
        common = min(common_prefix(self.tokens, prompt_tokens), len(prompt_tokens) - 1)
        live = self.state is not None and common == len(self.tokens) and (drafter is None or self.pending is not None)
        if live:
            resume = Resume(common, self.state, self.pending)
        else:
            resume = self._from_snapshot(model, common)
        self.tokens = list(prompt_tokens[:resume.position])
        self.snapshots = [s for s in self.snapshots if s.position <= resume.position]
        self.state, self.pending = None, None
        return resume

    def _from_snapshot(self, model, common: int) -> Resume:
        """The state cut back to the latest snapshot at or before `common` tokens (empty if there is none)."""
        snapshot = next((s for s in reversed(self.snapshots) if s.position <= common), None)
        if snapshot is None or self.state is None or snapshot.position == 0:
            return Resume()
        state = dict(self.state)
        state["layers"] = [s if layer.kind != LINEAR else kept
                           for layer, s, kept in zip(model.layers, self.state["layers"], snapshot.linear)]
        state["offset"] = mx.array([snapshot.position], mx.int32)
        if "head" in state:
            state["head_offset"] = mx.array([snapshot.position - 1], mx.int32)
        return Resume(snapshot.position, state, snapshot.hidden)

    def take_marks(self) -> set[int]:
        marks, self.marks = self.marks, set()
        return marks

    def snapshot(self, model, position: int, layers: list, hidden: mx.array | None) -> None:
        linear = [s if layer.kind == LINEAR else None for layer, s in zip(model.layers, layers)]
        self.snapshots = [s for s in self.snapshots if s.position < position][-(MAX_SNAPSHOTS - 1):]
        self.snapshots.append(Snapshot(position, linear, hidden))

    def hold(self, state: dict, last, produced: list[int], held: int, step_start=None) -> None:
        """After a step: the state, what the next step would need, the tokens produced so far (a list the
        steps extend), how many positions the state holds, and where the step started (positions held, the
        layers' states, what it read: `decoding.step`'s `last`, a batch of one), if it was not the prefill."""
        self._live = (state, last, produced, held, step_start)
        if "head" in state:  # a plain step that gave drafting up for good drops the head's buffers
            self._head = (state["head"], state["head_offset"])

    def settle(self, prompt_tokens: list[int]) -> None:
        """The generation is over: keep its state, which holds the prompt and every produced token but the
        last (chosen, never fed), and a snapshot where its last step started. The last step may have fed
        tokens past the end of the output (drafts accepted after an end id, a stop string or `max_tokens`),
        which the next prompt will not hold: it can resume there instead of at the prompt's end."""
        state, last, produced, held, step_start = self._live
        self._live = None
        state = {k: v for k, v in state.items() if k not in ("counts", "prompt_seen")}  # per generation
        tokens = list(prompt_tokens) + list(produced[:held - len(prompt_tokens)])
        drafting = self.owner[0] is not None
        if drafting and "head" not in state:  # the head's buffers as it left them: whole below its offset
            state["head"], state["head_offset"] = self._head
        self._head = None
        # the head has read every position but the last pass's, unless a plain step that gave drafting up for
        # good left it further behind: then it resumes from a snapshot taken before
        synced = not drafting or int(state["head_offset"].item()) + int(last[2].item()) == len(tokens)
        self.tokens, self.state = tokens, state
        self.pending = last[0][:, :int(last[2].item())] if drafting and synced else None
        if step_start is not None and synced:
            position, layers, before = step_start
            hidden = None
            if drafting:  # the trunk's state at position - 1: the last one the step before kept
                kept = int(before[2].item())
                hidden = before[0][:, kept - 1:kept]
            self.snapshot(self.model, position, layers, hidden)
