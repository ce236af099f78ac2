"""A continuous batch: requests join at a step boundary, decode together, and leave when done.

The decoding state of `qmtp.decoding` with a leading batch axis (`decoding.step_rows`): each row has its own
offset, KV mask, acceptance, drafts cap and key, and its linear-attention state is rolled back to its own last
kept position. A request joins by a prefill of its own (batch 1, so no padding enters its linear-attention or
conv state), run in chunks between the running rows' steps so they are not stalled, and its state is then
inserted as a new row. A finished row is removed from the state at once: it costs no more work.

One width per step for the batch: the widest fixed n_draft of its rows, or, with an "auto" row, a
`DraftPlanner` fed the batch's own step costs (per batch size) and every drafting row's acceptance. A row's
n_draft caps the drafts it counts within that width, so its tokens are those of its own `qmtp.decode` run.

Only the engine thread calls MLX (`step`, `run`); `submit` and `Request.cancel` may come from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import acceptance, adaptive, chat, decoding, parallel
from .adaptive import DraftPlanner
from .errors import UsageError
from .model import COMPILE, Model, release_at_thread_exit
from .options import DEFAULT_ENGINE, MAX_N_DRAFT, Engine, Settings
from .prefix_cache import PrefixCache, Resume
from .generation import ExpertRecorder, Generation, Stats, Step, _end_set, _untimed, _nonfinite, _validate
from .text import ReplyText
from .traces import traces_of

PREFILL_CHUNK = 8  # tokens of a joining prompt's first chunk while rows run, before any chunk is timed
CHUNK_SHARE = 0.8  # a chunk's time, as a share of one decoding step's: the rows' interval stays under twice theirs
MIN_CHUNK, MAX_CHUNK = 1, 1024
IDLE_CHUNK = 1024  # with no row running, nobody waits: prompts are prefilled whole until this many tokens ran
# A joining prompt rides in the rows' own pass (a row that reads the prompt's next tokens, width a step) when
# a chunk of its own within the step's budget would read fewer than this many times the width: a pass's fixed
# cost (dispatch, on a small model or a CPU) then dominates a chunk, and a row costs the step far less.
FEED_OVER_CHUNK = 4


class Request:
    """One row's life: its prompt and settings, what it produced so far, and how it ended."""

    def __init__(self, prompt_tokens: list[int], settings: Settings, on_tokens, strategy, eos: frozenset[int],
                 tokenizer=None, on_done=None, prefix_cache: PrefixCache | None = None,
                 recorder: ExpertRecorder | None = None, marks=()):
        self.prompt_tokens = list(prompt_tokens)
        self.marks = tuple(marks)  # positions to hold the prompt's state at (a chat's generation prompt start)
        self.prefix_cache = prefix_cache  # a conversation's own cache (`generate(prefix_cache=...)`), else None
        self.recorder = recorder  # the experts of its verify passes (`Engine(track_experts=True)`), else None
        self._held = len(prompt_tokens)  # positions its trunk state holds
        self.settings = settings
        self.tokens: list[int] = []  # the reply's (`reply.tokens`)
        self.text = ""  # the reply's text, once it is done
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        widest = settings.widest
        self.stats = Stats(n_draft=settings.n_draft, prompt_tokens=len(prompt_tokens),
                           prefilled_tokens=len(prompt_tokens), drafted=[0] * (widest - 1),
                           accepted=[0] * (widest - 1))
        self.cached_tokens = 0
        self.done = threading.Event()
        self.on_tokens = on_tokens
        self.on_done = on_done  # called on the engine thread once the row has ended (after its last tokens)
        self.strategy = strategy
        self.eos = eos
        self.submitted = time.perf_counter()
        self._cancelled = False
        self.reply = ReplyText(tokenizer, eos, settings.stop, settings.max_tokens)
        self._decoded: list[int] = []  # every token decoded (past an end or a stop too, until the row leaves)
        self._first_at = None
        self._feed_at: int | None = None  # while the row reads its prompt in the rows' pass: the next position
        self._prefill_started: float | None = None

    def cancel(self) -> None:
        """The row leaves at the next step boundary (thread-safe)."""
        self._cancelled = True

    @property
    def drafts(self) -> bool:
        return self.settings.n_draft != 1

    def cap(self, width: int) -> int:
        """The drafts this row counts in a step of `width` tokens."""
        n = width if self.settings.n_draft == "auto" else min(width, self.settings.n_draft)
        return n - 1

    def generation(self) -> Generation:
        """What `generate` would return for this row (once it is done)."""
        if not self.done.is_set():
            raise UsageError("this request is still running: wait for request.done first")
        return Generation(text=self.text, tokens=list(self.tokens), prompt_tokens=self.prompt_tokens,
                          stats=self.stats, finish_reason=self.finish_reason)

    def _take(self, model: Model, emitted: list[int]) -> bool:
        """Add a step's tokens (stream them, cut at an end id, a stop string or max_tokens: `ReplyText`); whether
        the row is done."""
        if self._first_at is None:
            self._first_at = time.perf_counter()
            self.stats.first_token_seconds = self._first_at - self.submitted
        self._decoded.extend(emitted)
        kept = self.reply.take(emitted)
        self.tokens = self.reply.tokens
        if self.on_tokens is not None and kept:
            self.on_tokens(kept)
        if self.reply.done:
            self.finish_reason = self.reply.finish_reason
            self.text = self.reply.text
        return self.reply.done

    def _finish(self, reason: str | None = None, error: Exception | None = None) -> None:
        if reason is not None:
            self.finish_reason = reason
        self.error = error
        if not self.reply.done:  # cancelled or failed: the text of what it produced
            self.text = self.reply.text
        self.stats.generated = len(self.tokens)
        if self._first_at is not None:
            self.stats.decode_seconds = time.perf_counter() - self._first_at
        if self.recorder is not None:
            self.stats.experts_per_pass = self.recorder.distinct()
        if self.prefix_cache is not None and (error is not None or reason == "cancelled"):
            self.prefix_cache.clear()  # a state cut short is not kept: the next call prefills anew
        self.done.set()
        if self.on_done is not None:
            self.on_done()


def _prefill_row(model: Model, head, tokens: list[int], capacity: int, strategy, hidden: str, key, chunk,
                 resume: Resume | None = None, marks=(), on_mark=None):
    """A joining prompt through the trunk alone (batch 1), yielding between chunks (and the head over its
    positions but the last, when it drafts); from `resume`'s state when given (only the tokens after its
    position are run). `chunk()` gives a chunk's tokens, cut to a power of two and run compiled while rows
    decode, or None: up to the next mark in one pass, op by op (nobody waits, and a prompt needs no trace).
    A chunk ends at each of `marks` inside the prompt, and `on_mark(at, state, h)` gets the state there (the
    head has read position at - 1 with the token at `at`; h: the trunk's state at position at - 1 [1, 1, H]).
    Yields (the tokens done, the state, the trunk state at the last position done). Returns (state, the trunk
    state at the last position [1, 1, H], the first token, whether its logits were finite)."""
    state = _resumed(model, head, tokens, capacity, resume)
    at, length = (resume.position if resume is not None else 0), len(tokens)
    marks = sorted(m for m in marks if at < m < length)
    while at < length:
        upto = next((m for m in marks if m > at), length)
        size = chunk()
        trunk_pass, head_pass = _chunk_passes(model, head, compiled=size is not None)
        end = upto if size is None else at + _power_of_two_at_most(min(upto, at + size) - at)
        pre, post, state["layers"] = trunk_pass(state["layers"], state["offset"],
                                                mx.array([tokens[at:end]], mx.int32))
        state["offset"] = mx.array([end], mx.int32)
        h = post if hidden == "post" else pre
        read = min(end, length - 1) - at  # the head reads position j with token j + 1
        if head is not None and read > 0:
            state["head"] = head_pass(h[:, :read], mx.array([tokens[at + 1:at + 1 + read]], mx.int32),
                                      state["head"], mx.array([at], mx.int32))
        at = end
        if at < length:
            mx.eval(state)
            if at in marks and on_mark is not None:
                on_mark(at, {**state, "head_offset": mx.array([at], mx.int32)} if head is not None else dict(state),
                        h[:, -1:])
            yield at, state, h[:, -1:]
    if head is not None:
        state["head_offset"] = mx.array([length - 1], mx.int32)
    logits = model.logits(post[:, -1:])[0].astype(mx.float32)
    if getattr(strategy, "by_position", False):  # coupled sampling: the first token's key is its position's
        key = strategy.key_at(key, length)
    history = None
    if strategy.history:  # penalties: nothing generated yet, and the prompt's tokens (a held state's are not
        state.update(_fresh_history(logits.shape[-1], tokens))  # this request's: `_held` drops them)
        history = (state["counts"], state["prompt_seen"][0])
    first, _ = strategy.pick(logits, key, history)
    finite = mx.isfinite(logits).all()
    mx.eval(first, finite, state)
    return state, h[:, -1:], int(first.item()), bool(finite.item())


def prefill(model: Model, head, tokens: list[int], capacity: int, width: int, strategy, hidden: str, key):
    """A prompt prefilled as a batch of one, and not decoded: (state, `last` for a first step of `width` tokens,
    the first token). For timing a step from a real state (`qmtp.book.bench`)."""
    run = _prefill_row(model, head, tokens, capacity, strategy, hidden, key, lambda: None)
    while True:
        try:
            next(run)
        except StopIteration as done:
            state, h, first, _ = done.value
            break
    last = (_pad_axis(h, 1, width), _pad_axis(mx.array([[first]], mx.int32), 1, width), mx.array([1], mx.int32))
    return state, last, first


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _chunk_passes(model: Model, head, compiled: bool = True):
    """The trunk over a chunk of a joining prompt, and the head over its positions; `compiled`: traced once per
    model and chunk size (chunks are cut to powers of two, so a prompt of any length needs at most a few
    traces). On a dispatch-bound machine a chunk run op by op cost more than the rows' whole compiled step, so
    that the rows waited more than twice as long even for the smallest chunk, and the chunks shrank to a token
    each."""
    def trunk(layers, offset, tokens):
        pre, post, _, layers = decoding.trunk_step(model, tokens, {"layers": layers, "offset": offset}, record=False)
        return pre, post, layers

    def head_over(hidden, tokens, buffers, at):
        return decoding.head_step(model, head, hidden, tokens, buffers, at)[1]

    if not (COMPILE and compiled):
        return trunk, head_over
    owner = head if head is not None else model  # an ablation head's traces go with it (`qmtp.traces`)
    return traces_of(owner).get(("chunk passes", id(model)), lambda: (
        mx.compile(trunk, inputs=[model.state]),
        mx.compile(head_over, inputs=[model.state] + ([head.state] if head is not None and head is not model.mtp
                                                      else []))))


def _fresh_history(vocab: int, prompt: list[int]) -> dict:
    """A penalised row's history before its first token: no token generated, the prompt's tokens seen."""
    seen = np.zeros((1, vocab), np.bool_)
    seen[0, prompt] = True
    return {"counts": mx.zeros((1, vocab), mx.float32), "prompt_seen": mx.array(seen)}


def _no_history(vocab: int, rows: int) -> dict:
    """The history a row that is not penalised carries in a batch where another is (never read)."""
    return {"counts": mx.zeros((rows, vocab), mx.float32), "prompt_seen": mx.zeros((rows, vocab), mx.bool_)}


class _Held:
    """A state kept for a later prompt that continues its ids (`ContinuousBatch`'s cache): the ids its trunk
    state holds, the state (batch 1), and either the trunk's states its head has not read (a finished row: its
    last pass's kept positions) or None with the token its head read after the ids (a prompt's state at its
    last turn's start)."""

    def __init__(self, ids: tuple[int, ...], state: dict, pending, head: bool, read_next: int | None = None):
        self.ids, self.state, self.pending, self.head, self.read_next = ids, state, pending, head, read_next

    def continued_by(self, prompt: list[int]) -> bool:
        ids = self.ids
        return (len(ids) < len(prompt) and tuple(prompt[:len(ids)]) == ids
                and (self.read_next is None or prompt[len(ids)] == self.read_next))

    def resume(self) -> Resume:
        return Resume(len(self.ids), self.state, self.pending)


def _resumed(model: Model, head, tokens: list[int], capacity: int, resume: Resume | None) -> dict:
    """The state a prefill starts from: empty, or a held one (a `Resume`) grown to `capacity`, its head (when
    drafting) having read the trunk's states it had not, each with the prompt's token after it."""
    if resume is None or resume.state is None:
        return decoding.empty_state(model, capacity, head=head is not None)
    state = dict(resume.state)
    if decoding.capacity_of(model, state) < capacity:
        state = decoding.grow_state(model, state, capacity)
    if head is None:
        state.pop("head", None)
        state.pop("head_offset", None)
        return state
    at, pending = resume.position, resume.pending
    if pending is not None and pending.shape[1]:
        read_from = at - pending.shape[1]
        _, state["head"] = decoding.head_step(model, head, pending, mx.array([tokens[read_from + 1:at + 1]], mx.int32),
                                              state["head"], mx.array([read_from], mx.int32))
    state["head_offset"] = mx.array([at], mx.int32)
    return state


def _rows_of(tree, index: mx.array):
    """Every array of a batch state (or `last`) cut to the rows `index`."""
    return _map(lambda a: mx.take(a, index, axis=0), tree)


def _map(function, tree):
    if isinstance(tree, dict):
        return {name: _map(function, value) for name, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(function, value) for value in tree)
    return function(tree)


def _pad_axis(a: mx.array, axis: int, size: int) -> mx.array:
    if a.shape[axis] >= size:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return mx.pad(a, pad)


def _as_row(model, state: dict, capacity: int, head) -> dict:
    """A batch-1 state as one row of a batch: KV buffers `capacity` long, the head's buffers present exactly
    when the batch drafts with `head` (empty ones for a row that does not: it counts no draft)."""
    row = decoding.grow_state(model, state, capacity) if decoding.capacity_of(model, state) < capacity else state
    row = dict(row)
    if head is not None and "head" not in row:
        row["head"] = head.layers[0].empty_state(1, capacity, model.dtype)
        row["head_offset"] = row["offset"] - 1
    elif head is None and "head" in row:
        del row["head"], row["head_offset"]
    return row


def _joined(a, b):
    return _map2(lambda x, y: mx.concatenate([x, y], axis=0), a, b)


def _map2(function, a, b):
    if isinstance(a, dict):
        return {name: _map2(function, a[name], b[name]) for name in a}
    if isinstance(a, (list, tuple)):
        return type(a)(_map2(function, x, y) for x, y in zip(a, b))
    return function(a, b)


class ChunkCosts:
    """A prefill chunk's seconds as a fixed part and a part per token, fitted to the last chunks (least squares);
    the chunk sizes it proposes vary a little around the fit, so that the fit sees more than one size."""

    def __init__(self, keep: int = 32):
        self.seen: deque[tuple[int, float]] = deque(maxlen=keep)
        self.turn = 0

    def observe(self, tokens: int, seconds: float) -> None:
        self.seen.append((tokens, seconds))

    def smallest(self) -> tuple[int, float] | None:
        """The smallest chunk kept (tokens) and the median of its times: the least a chunk costs here."""
        if not self.seen:
            return None
        tokens = min(n for n, _ in self.seen)
        return tokens, float(np.median([t for n, t in self.seen if n == tokens]))

    def tokens_within(self, seconds: float) -> int | None:
        """About how many tokens one chunk runs in `seconds` (None before any chunk was timed)."""
        if not self.seen:
            return None
        sizes = np.array([n for n, _ in self.seen], float)
        times = np.array([t for _, t in self.seen])
        per_token, fixed = times.sum() / sizes.sum(), 0.0  # all of the cost counted per token: the safer guess
        if len(self.seen) >= 4 and sizes.std() > 0:
            slope, intercept = np.polyfit(sizes, times, 1)
            if slope > 0 and intercept >= 0:  # noisy times of nearly one size can fit any slope, even below 0
                per_token, fixed = slope, intercept
        self.turn += 1
        spread = (0.75, 1.25)[self.turn % 2]
        # at most twice the largest chunk seen: a fit is trusted only near the sizes it was fitted on
        return min(int(spread * max(seconds - fixed, 0.0) / per_token), 2 * int(sizes.max()))


class _Joining:
    """A request being prefilled: its prefill generator, the tokens done, the seconds spent, its seed's key."""

    def __init__(self, request: Request, prefill, key: mx.array, mark: int = 0):
        self.request, self.prefill, self.key, self.mark = request, prefill, key, mark
        self.done, self.seconds = 0, 0.0


@dataclass(eq=False)
class _Pass:
    """A step on the device: the rows it runs (in the state's order when it was queued), its width and each
    row's drafts cap, the state and `last` it read and those it made, its report and experts (unread)."""

    rows: list[Request]
    width: int
    caps: tuple
    inputs: tuple  # (state, last)
    outputs: tuple  # (state, last)
    report: mx.array
    experts: list
    queued: float  # when it was queued


class ContinuousBatch:
    """Rows decoding together; requests join at step boundaries (`submit`, `step`, `run`). `qmtp.generate` is a
    batch of one of these.

    max_batch: rows decoding at once (more requests wait). cache_entries: finished rows' states kept for a
    later request whose prompt continues one of them (`qmtp.continuous` docs: a conversation's next turn),
    the least recently used evicted first. join: how a prompt joins running rows: "auto" (the cheaper way,
    measured), "chunks" (passes of its own between the rows' steps) or "rows" (as a row of their pass).
    planner: what chooses the width of the "auto" rows' steps (default: a `DraftPlanner` that learns the
    batch's step costs, per batch size, and starts from the acceptance the model's last generations counted).

    The next step is queued on the device before the host reads the current one whenever that one cannot
    change what the next must compute (no row reads a prompt, the kept tokens are not replayed, and some row
    will not reach its max_tokens), so the machine computes while the host keeps the books; a row that
    finishes in the current step rides along in the next one, unread, and leaves after it."""

    JOINS = ("auto", "chunks", "rows")

    def __init__(self, model: Model, max_batch: int = 8, engine: Engine = DEFAULT_ENGINE, cache_entries: int = 16,
                 join: str = "auto", planner: DraftPlanner | None = None):
        if not isinstance(model, Model):
            raise UsageError(f"model: give a qmtp Model, not {type(model).__name__}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise UsageError(f"max_batch={max_batch!r:.40} must be an integer >= 1")
        if not isinstance(engine, Engine):
            raise UsageError(f"engine: give a qmtp.Engine, not {type(engine).__name__}")
        if planner is not None and not isinstance(planner, DraftPlanner):
            raise UsageError(f"planner: give a qmtp.adaptive.DraftPlanner (or None), not {type(planner).__name__}")
        self.model, self.max_batch, self.engine = model, max_batch, engine
        self._timer = engine.timer or _untimed
        self._record = engine.rollback == "record"
        self.drafter = engine.drafter(model) if model.mtp is not None or engine.head is not None else None
        if isinstance(cache_entries, bool) or not isinstance(cache_entries, int) or cache_entries < 0:
            raise UsageError(f"cache_entries={cache_entries!r:.40} must be an integer >= 0")
        self.cache_entries = cache_entries
        if join not in self.JOINS:
            raise UsageError(f"join={join!r:.40}: use one of {', '.join(self.JOINS)}")
        self.join = join
        self._cache: OrderedDict[tuple[int, ...], _Held] = OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queue: deque[Request] = deque()
        self._joining: list[_Joining] = []
        self._rows: list[Request] = []  # in the order of the rows of `_state`, the latest state queued
        self._state = self._last = self._keys = None
        self._queued: _Pass | None = None  # a step queued behind the one being read
        self._capacity = 0
        # step costs per batch size, kept with the model: a later batch (or generation) starts from them
        self._costs: dict[int, adaptive.StepCosts] = model.__dict__.setdefault("_step_costs", {}).setdefault(
            (id(self.drafter), engine.hidden, engine.rollback, engine.head_cache, engine.chain), {})
        self._planner = planner
        self._agree = parallel.rank0_decides(model.shard)  # ranks time steps differently, and must agree on widths
        self._read_at, self._previous = None, None  # the last read; what it read (width, width queued, rows)
        self._step_seconds = None  # the last step's time: what a prefill chunk may take
        self.chunk_costs = ChunkCosts()  # what a prefill chunk costs, by its tokens
        self._budget = None  # prefill tokens this step may still run
        self._idle = True  # whether this step began with no row running
        self.counters = {"steps": 0, "rows_stepped": 0, "max_rows_in_a_step": 0, "prefill_chunks": 0,
                         "generated": 0, "prefilled_tokens": 0, "prompt_rows_stepped": 0}

    @property
    def active(self) -> int:
        """Requests holding a row, decoding or admitted and still prefilling."""
        return len(self._rows) + len(self._joining)

    @property
    def waiting(self) -> int:
        """Requests that wait for a row, the ones queued beyond the rows still free (a burst the engine has not
        yet admitted waits for nothing while rows are free)."""
        return max(0, len(self._queue) - max(0, self.max_batch - self.active))

    def submit(self, prompt_tokens: list[int], settings: Settings, on_tokens=None, on_done=None,
               marks=()) -> Request:
        """Check the request now (a UsageError naming what is wrong) and queue it; thread-safe. `on_tokens`
        gets each step's new tokens, `on_done` is called once the row has ended, both on the engine thread.
        `marks`: a position of the prompt where a later prompt is likely to part from it (a chat's generation
        prompt start, `qmtp.chat.generation_prompt_start`): its state there is held for it (the last mark)."""
        request = self.check(prompt_tokens, settings, on_tokens, on_done, marks=marks)
        with self._lock:
            self._queue.append(request)
        self._wake.set()
        return request

    def enqueue(self, requests: list[Request]) -> None:
        """Queue requests made by `check` (in order)."""
        with self._lock:
            self._queue.extend(requests)
        self._wake.set()

    def check(self, prompt_tokens, settings: Settings, on_tokens=None, on_done=None,
              prefix_cache: PrefixCache | None = None, marks=()) -> Request:
        """The request for a prompt and settings, every check done (nothing queued). `prefix_cache`: the
        request starts from the state it holds and leaves its own there (`generate(prefix_cache=...)`)."""
        if not isinstance(settings, Settings):
            raise UsageError(f"settings: give a qmtp.Settings (Settings.of(...)), not {type(settings).__name__}")
        if on_tokens is not None and not callable(on_tokens):
            raise UsageError(f"on_tokens={on_tokens!r:.40} must be a function of a list of token ids (or None)")
        if on_done is not None and not callable(on_done):
            raise UsageError(f"on_done={on_done!r:.40} must be a function of no argument (or None)")
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise UsageError(f"prefix_cache: give a qmtp.PrefixCache (or None), not {type(prefix_cache).__name__}")
        marks = (marks,) if isinstance(marks, int) and not isinstance(marks, bool) else marks
        if not isinstance(marks, (list, tuple)) or any(isinstance(m, bool) or not isinstance(m, int) or m < 0
                                                       for m in marks):
            raise UsageError(f"marks={marks!r:.40}: give prompt positions (integers >= 0)")
        if settings.n_draft != 1 and self.drafter is None:
            self.model.require_head()
        sampler = settings.check_for(self.model)
        prompt_tokens = list(prompt_tokens) if not isinstance(prompt_tokens, str) else prompt_tokens
        if isinstance(prompt_tokens, str) or not all(isinstance(t, int) for t in prompt_tokens):
            raise UsageError("prompt_tokens: give a list of integer token ids")
        _validate(self.model, prompt_tokens, settings)
        eos = chat.end_ids(self.model) if settings.stop_at_eos else frozenset()
        return Request(prompt_tokens, settings, on_tokens, acceptance.strategy_for(sampler, self.engine.acceptance),
                       _end_set(eos), self.model.tokenizer, on_done, prefix_cache,
                       ExpertRecorder() if self.engine.track_experts else None, marks)

    def run(self, stop: threading.Event) -> None:
        """The engine thread's loop: step while there is work, else wait for a submit (or `stop`)."""
        release_at_thread_exit()
        while not stop.is_set():
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()
        with self._lock:  # what is left at shutdown ends cancelled: nobody waits on it forever
            left, self._queue = [*self._queue, *(j.request for j in self._joining), *self._rows], deque()
        self._joining, self._rows = [], []
        self._state = self._last = self._keys = self._queued = None
        for request in left:
            request._finish("cancelled")

    def step(self) -> bool:
        """Admit waiting requests (a chunk of one joining prompt's prefill), then one decoding step for every
        running row. False when there is nothing to do."""
        with self.model.lock:
            self._leave_cancelled()
            with self._lock:
                while self._queue and len(self._rows) + len(self._joining) < self.max_batch:
                    self._joining.append(self._start_prefill(self._queue.popleft()))
            if self._rows and all(r._feed_at is not None for r in self._rows):
                self._unfeed()
            self._budget, self._idle = None, not self._rows
            self._budget = IDLE_CHUNK if self._idle else self._chunk()
            while self._joining and self._budget > 0:  # short prompts join together, a long one in chunks
                with self._timer("prefill"):
                    self._budget -= self._prefill_chunk()
            if self._rows:
                self._decode_step()
            return bool(self._rows or self._joining or self._queue)

    # ---- joining ------------------------------------------------------------------------------------------
    def _leave_cancelled(self) -> None:
        with self._lock:
            for request in [r for r in self._queue if r._cancelled]:
                self._queue.remove(request)
                request._finish("cancelled")
        for joining in [j for j in self._joining if j.request._cancelled]:
            self._joining.remove(joining)
            joining.request._finish("cancelled")
        gone = [b for b, r in enumerate(self._rows) if r._cancelled]
        for b in gone:
            self._rows[b]._finish("cancelled")
        self._remove(gone)

    def _chunk(self) -> int | None:
        """Tokens of the next prefill chunk: what is left of this step's budget, about one decoding step's time
        while rows run; None when the step began with no row running (nobody waits: the prompt in one pass up
        to its next mark, op by op, as no trace is needed)."""
        if self._idle:
            return None
        if self._budget is not None:
            return max(1, self._budget)
        tokens = None if self._step_seconds is None else self.chunk_costs.tokens_within(CHUNK_SHARE * self._step_seconds)
        return PREFILL_CHUNK if tokens is None else max(MIN_CHUNK, min(MAX_CHUNK, tokens))

    def _start_prefill(self, request: Request) -> _Joining:
        settings = request.settings
        # the prompt and a step's room: the buffers grow as the row decodes (`_fit`), not to max_tokens up front
        capacity = decoding.capacity_for(len(request.prompt_tokens) + 2 * MAX_N_DRAFT)
        head = self.drafter if request.drafts else None
        key = mx.random.key(settings.seed)
        prompt, cache = request.prompt_tokens, request.prefix_cache
        if cache is not None:  # a conversation's own cache: its marks (turn starts) snapshotted as it goes
            resume = cache.resume(self.model, head, self.engine.hidden, prompt)
            marks, mark = cache.take_marks(), 0

            def on_mark(at: int, state: dict, h: mx.array) -> None:
                cache.snapshot(self.model, at, state["layers"], h if head is not None else None)
        else:
            held = self._lookup(request)
            resume = held.resume() if held is not None else None
            mark = max((m for m in request.marks if 0 < m < len(prompt)), default=0) if self.cache_entries else 0
            if held is not None and mark <= len(held.ids):
                mark = 0
            marks, on_mark = (mark,), self._turn_holder(request, mark) if mark else None
        if resume is not None and resume.position:
            request.cached_tokens = resume.position
            request.stats.prefilled_tokens -= resume.position
        prefill = _prefill_row(self.model, head, prompt, capacity, request.strategy, self.engine.hidden, key,
                               self._chunk, resume, marks, on_mark)
        return _Joining(request, prefill, key, mark)

    def _prefill_chunk(self) -> int:
        """One chunk of the first joining prompt (at most the step's budget of tokens); a prompt done joins the
        batch. The tokens it ran."""
        joining = self._joining[0]
        request = joining.request
        started = time.perf_counter()
        self._previous = None  # the interval to the next read holds this chunk: no step's cost
        try:
            (done, partial, h_partial), result = next(joining.prefill), None
        except StopIteration as finished:
            done, result = len(request.prompt_tokens), finished.value
        except Exception as error:  # this request fails, not the rows beside it (nor the engine thread)
            self._joining.pop(0)
            request._finish("error", error)
            return max(1, len(request.prompt_tokens) - joining.done)
        seconds = time.perf_counter() - started
        joining.seconds += seconds
        self.counters["prefill_chunks"] += 1
        ran = done - joining.done
        if self._rows and ran > 0:
            self.chunk_costs.observe(ran, seconds)
        joining.done = done
        if result is None:
            if self._feeds(request):
                self._joining.pop(0)
                self._start_feeding(joining, partial, h_partial, done)
            return ran
        self._joining.pop(0)
        request.stats.prefill_seconds = joining.seconds
        self.counters["prefilled_tokens"] += len(request.prompt_tokens)
        state, h_last, first, finite = result
        prompt = request.prompt_tokens
        if not finite:
            request._finish("error", _nonfinite(self.model, len(prompt) - 1, prompt[-1], "for the prompt "))
            return ran
        if request.prefix_cache is not None:
            request.prefix_cache.snapshot(self.model, len(prompt), state["layers"],
                                          h_last if request.drafts else None)
        finished = request._take(self.model, [first])
        self.counters["generated"] += 1
        if finished:
            if request.prefix_cache is not None:
                last = (h_last, mx.array([[first]], mx.int32), mx.array([1], mx.int32))
                request.prefix_cache.hold(state, last, request._decoded, len(prompt))
                request.prefix_cache.settle(prompt)
            request._finish()
        else:
            by_position = getattr(request.strategy, "by_position", False)  # then the seed's key, never split
            key = joining.key if by_position else mx.random.split(joining.key)[1]
            self._insert(request, state, h_last, first, key)
        return ran

    # ---- a joining prompt as a row of the rows' own pass ------------------------------------------------------
    def _feeds(self, request: Request) -> bool:
        """Whether a joining prompt, one chunk in, goes on as a row of the rows' pass (reading `width` of its
        tokens a step) rather than in chunks of its own: when rows decode and a chunk within the step's budget
        would read fewer than FEED_OVER_CHUNK times the width. On this project's CPU a one-token chunk costs
        about 0.8 of four rows' whole step (its fixed cost), a fifth row about 0.1 of it. A penalised prompt
        goes on in chunks: its history starts at its first generated token, which a row's step would not
        know; so does one with a conversation's cache (its snapshots are taken by its prefill)."""
        if (self.join == "chunks" or request.strategy.history or request.prefix_cache is not None
                or self._step_seconds is None or not any(r._feed_at is None for r in self._rows)):
            return False
        if self.join == "rows":
            return True
        tokens = self.chunk_costs.tokens_within(CHUNK_SHARE * self._step_seconds)
        width = self._last[0].shape[1] if self._last is not None else 1
        return tokens is not None and tokens < FEED_OVER_CHUNK * width

    def _start_feeding(self, joining: _Joining, state: dict, h_last: mx.array, at: int) -> None:
        """A joining prompt, `at` tokens read, as the batch's last row, its pending token the prompt's next. Its
        head has read position at - 1 with token at; it reads it again in the first step (the same entry)."""
        request = joining.request
        state = decoding.cut_state(self.model, state, decoding.capacity_for(at + 2 * MAX_N_DRAFT))
        if "head" in state:
            state["head_offset"] = mx.array([at - 1], mx.int32)
        request._feed_at, request._mark = at, joining.mark if joining.mark > at else 0
        request._prefill_started = time.perf_counter() - joining.seconds
        by_position = getattr(request.strategy, "by_position", False)
        request._seed_key = joining.key
        request._first_key = request.strategy.key_at(joining.key, len(request.prompt_tokens))
        request._after_key = joining.key if by_position else mx.random.split(joining.key)[1]
        self._insert(request, state, h_last, request.prompt_tokens[at], joining.key)

    def _feed(self, width: int) -> dict:
        """What `decoding.step_rows` reads of the prompts' rows this step (zeros for the others, unread)."""
        tokens, keep, following, first_keys, after_keys = [], [], [], [], []
        unread = self._keys[0]
        for request in self._rows:
            at = request._feed_at
            if at is None:
                tokens.append([0] * width), keep.append(1), following.append(0)
                first_keys.append(unread), after_keys.append(unread)
                continue
            prompt = request.prompt_tokens
            end = min(len(prompt), at + width)
            if at < request._mark < end:  # the turn's start is held for the conversation's next turn
                end = request._mark
            tokens.append(prompt[at:end] + [0] * (width - (end - at)))
            keep.append(end - at)
            following.append(prompt[end] if end < len(prompt) else -1)
            first_keys.append(request._first_key)
            after_keys.append(request._seed_key if end < len(prompt) else request._after_key)
        return {"tokens": mx.array(tokens, mx.int32), "keep": mx.array(keep, mx.int32),
                "next": mx.array(following, mx.int32), "first_key": mx.stack(first_keys),
                "after_key": mx.stack(after_keys)}

    def _fed(self, done: _Pass, b: int, request: Request, row: decoding.RowReport) -> bool:
        """A prompt's row's share of a step: its position moves on; at its last piece, its first token (whether
        the row is done)."""
        keep, finite, first = row.keep, row.finite, row.next_token
        at, prompt = request._feed_at + keep, request.prompt_tokens
        if at < len(prompt):
            request._feed_at = at
            if at == request._mark:
                self._hold(done, b, tuple(prompt[:at]))
            return False
        request._feed_at = None
        request.stats.prefill_seconds = time.perf_counter() - request._prefill_started
        self.counters["prefilled_tokens"] += len(prompt)
        if finite < keep:
            request._finish("error", _nonfinite(self.model, len(prompt) - 1, prompt[-1], "for the prompt "))
            return True
        self.counters["generated"] += 1
        if request._take(self.model, [first]):
            request._finish()
            return True
        return False

    def _unfeed(self) -> None:
        """No row decodes any more: the prompts' rows go back to chunks of their own (nobody waits on them). No
        step is queued: a step with a prompt's row is read before the next is queued."""
        joinings = []
        latest = _Pass(list(self._rows), 0, (), (None, None), (self._state, self._last), None, [], 0.0)
        for b, request in enumerate(self._rows):
            at = request._feed_at
            held = self._held(latest, b, tuple(request.prompt_tokens[:at]))
            capacity = decoding.capacity_for(len(request.prompt_tokens) + 2 * MAX_N_DRAFT)
            prefill = _prefill_row(self.model, self.drafter if request.drafts else None, request.prompt_tokens,
                                   capacity, request.strategy, self.engine.hidden, request._seed_key, self._chunk,
                                   held.resume(), (request._mark,),
                                   self._turn_holder(request, request._mark) if request._mark else None)
            joining = _Joining(request, prefill, request._seed_key, request._mark)
            joining.done, joining.seconds = at, time.perf_counter() - request._prefill_started
            request._feed_at = None
            joinings.append(joining)
        self._remove(list(range(len(self._rows))))
        self._joining[:0] = joinings

    def _turn_holder(self, request: Request, mark: int):
        """What keeps a prompt's state at its last turn's start, `mark` (the head read mark - 1 with its token)."""
        prompt = request.prompt_tokens

        def hold_turn_start(at: int, state: dict, h: mx.array) -> None:
            self._put(_Held(tuple(prompt[:mark]), state, None, request.drafts, read_next=prompt[mark]))
        return hold_turn_start

    def _insert(self, request: Request, state: dict, h_last: mx.array, first: int, key: mx.array) -> None:
        """A prefilled request as the batch's last row."""
        head = any(r.drafts for r in self._rows) or request.drafts
        if self._state is not None and head and "head" not in self._state:
            self._state = self._with_head(self._state)
        capacity = max(self._capacity, decoding.capacity_of(self.model, state))
        if self._state is not None and capacity > self._capacity:
            self._state = decoding.grow_state(self.model, self._state, capacity)
        self._capacity = capacity
        row = _as_row(self.model, state, capacity, self.drafter if head else None)
        vocab = next((t["counts"].shape[-1] for t in (row, self._state or {}) if "counts" in t), 0)
        if self._state is not None and "counts" in row and "counts" not in self._state:
            self._state = {**self._state, **_no_history(vocab, len(self._rows))}
        if self._state is not None and "counts" in self._state and "counts" not in row:
            row = {**row, **_no_history(vocab, 1)}
        width = self._last[0].shape[1] if self._last is not None else 1
        last = (_pad_axis(h_last, 1, width), _pad_axis(mx.array([[first]], mx.int32), 1, width),
                mx.array([1], mx.int32))
        if self._state is None:
            self._state, self._last, self._keys = row, last, key[None]
        else:
            if self._last[0].shape[1] < width:
                self._last = (_pad_axis(self._last[0], 1, width), _pad_axis(self._last[1], 1, width), self._last[2])
            self._state = _joined(self._state, row)
            self._last = _joined(self._last, last)
            self._keys = mx.concatenate([self._keys, key[None]])
        self._rows.append(request)

    def _with_head(self, state: dict) -> dict:
        """The state with (empty) head buffers for rows that do not draft, now that one does."""
        rows = state["offset"].shape[0]
        capacity = decoding.capacity_of(self.model, state)
        buffers = self.drafter.layers[0].empty_state(rows, capacity, self.model.dtype)
        return {**state, "head": buffers, "head_offset": state["offset"] - 1}

    def _remove(self, rows: list[int]) -> None:
        """Rows that left: cut from the state (a finished row costs no more work)."""
        if not rows:
            return
        kept = [b for b in range(len(self._rows)) if b not in rows]
        self._rows = [self._rows[b] for b in kept]
        if self._queued is not None and all(r.done.is_set() for r in self._queued.rows):
            self._queued = None  # nobody reads it
        if not kept:
            self._state = self._last = self._keys = self._queued = None
            self._capacity = 0
            return
        index = mx.array(kept, mx.int32)
        self._state, self._last, self._keys = (_rows_of(x, index) for x in (self._state, self._last, self._keys))
        if "head" in self._state and not any(r.drafts for r in self._rows):
            del self._state["head"], self._state["head_offset"]
        if "counts" in self._state and not any(r.strategy.history for r in self._rows):
            del self._state["counts"], self._state["prompt_seen"]

    # ---- decoding -----------------------------------------------------------------------------------------
    def _width(self) -> int:
        """The next step's width: the widest fixed n_draft among the rows, or the planner's choice with an
        "auto" row (at least that widest)."""
        decoding_rows = [r for r in self._rows if r._feed_at is None]  # a prompt's row reads what the step gives
        fixed = max((r.settings.n_draft for r in decoding_rows if r.settings.n_draft != "auto"), default=1)
        if "head" not in self._state:
            return 1
        auto = next((r for r in decoding_rows if r.settings.n_draft == "auto"), None)
        if auto is None:
            return fixed
        if self._planner is None:  # from the acceptance the last generations with this drafter counted
            proposed, accepted = self.model.__dict__.setdefault("_draft_counts", {}).get(
                (id(self.drafter), auto.strategy.key), ([], []))
            self._planner = DraftPlanner(learned=adaptive.StepCosts(), proposed=proposed, accepted=accepted)
        if self._planner.learned is not None:
            self._planner.learned = self._costs.setdefault(len(self._rows), adaptive.StepCosts())
        return max(fixed, self._planner.choose())

    def _compiled(self, k: int, strategies: tuple, caps: tuple, follows: bool, feeding: tuple = ()):
        engine = self.engine
        return decoding.compiled_step(self.model, self.drafter, k, strategies, caps, engine.hidden, self._record,
                                      (engine.head_cache, engine.chain), follows, feeding, compiled=engine.compiled)

    def _fit(self, width: int, behind: _Pass | None) -> None:
        """KV buffers long enough for this step's `width` tokens on every row (after the unread step `behind`),
        grown to the next power of two when they are not. Attention reads its whole buffer every step, so
        buffers sized for max_tokens up front cost every step from the first: a request that leaves max_tokens
        out asks for the rest of the context (262,144 positions for Qwen3.6-35B-A3B: GBs a row, read at every
        token). Growing by doubling retraces the compiled step a few times over a long generation."""
        unread = {id(r) for r in behind.rows} if behind is not None else set()
        ahead = behind.width if behind is not None else 0
        needed = max((len(r.prompt_tokens) + len(r._decoded) + (ahead if id(r) in unread else 0))
                     if r._feed_at is None else r._feed_at for r in self._rows) + width + 1
        if needed > self._capacity:
            self._capacity = decoding.capacity_for(needed)
            self._state = decoding.grow_state(self.model, self._state, self._capacity)

    def _queue_step(self, behind: _Pass | None = None) -> _Pass:
        """Queue the next step for every row on the device (`mx.async_eval`): from the latest state, which is
        `behind`'s outputs when that step is not read yet."""
        width = self._width()
        self._fit(width, behind)
        k, rows = width - 1, list(self._rows)
        feeding = tuple(r._feed_at is not None for r in rows)
        caps = tuple(0 if fed else r.cap(width) for r, fed in zip(rows, feeding))
        # a plain step's head reads the pass, so that drafting can resume, unless the planner gave drafting up
        follows = k == 0 and "head" in self._state and not (self._planner is not None and self._planner.plain)
        step = self._compiled(k, tuple(r.strategy for r in rows), caps, follows, feeding)
        feed = (self._feed(width),) if any(feeding) else ()
        inputs = (self._state, self._last)
        with self._timer("build"):
            self._state, self._last, report, experts, self._keys = step(self._state, self._last, self._keys, *feed)
            mx.async_eval(report)
        if "head" in inputs[0] and "head" not in self._state:  # a plain step whose head no longer follows: its
            self._state = {**self._state, "head": inputs[0]["head"],  # buffers stay, behind the trunk
                           "head_offset": inputs[0]["head_offset"]}
        return _Pass(rows, width, caps, inputs, (self._state, self._last), report, experts, time.perf_counter())

    def _queues_behind(self, current: _Pass) -> bool:
        """Whether the next step can be queued before `current` is read: no row reads a prompt (its next piece
        depends on what this one read), its kept tokens need no replay, and some row goes on past it."""
        return (self.engine.queue_ahead and (self._record or current.width == 1)
                and all(r._feed_at is None for r in self._rows)
                and any(len(r._decoded) + current.width < r.settings.max_tokens for r in current.rows
                        if not r.done.is_set()))

    def _decode_step(self) -> None:
        try:
            current = self._queued if self._queued is not None else self._queue_step()
            self._queued = None
            if self._queues_behind(current):
                self._queued = self._queue_step(behind=current)
            with self._timer("sync"):
                report = decoding.read_report(current.report, current.width)
        except Exception as error:  # a step is shared: the rows in it fail, the engine goes on with new ones
            for request in self._rows:
                request._finish("error", error)
            self._remove(list(range(len(self._rows))))
            return
        with self._timer("host"):
            self._book(current, report)

    def _observe(self, done: _Pass) -> None:
        """The step just read: its cost for the planner (per batch size) and for the prefill chunks' budget.

        A step's cost is the interval since the last read, when the step read then had the same width, the
        same rows and the same step queued behind it (or none, both times), with no prefill chunk between: a
        step queued before the read runs partly inside the interval, so beside a change it would time a
        neighbour."""
        now = time.perf_counter()
        this = (done.width, self._queued.width if self._queued is not None else None, len(done.rows))
        self._step_seconds = now - max(done.queued, self._read_at or done.queued)
        if this == self._previous and self._planner is not None and self._planner.learned is not None:
            seconds = now - self._read_at
            if self._agree is not None:
                seconds = self._agree(seconds)
            self._costs.setdefault(len(done.rows), adaptive.StepCosts()).observe(done.width, seconds)
        self._read_at, self._previous = now, this

    def _book(self, done: _Pass, report: list[decoding.RowReport]) -> None:
        """The host's share of a step: counters, the planner, every row's tokens; finished rows leave."""
        self._observe(done)
        if not self._record and done.width > 1:
            self._replay(done, report)
        rows = len(done.rows)
        self.counters["steps"] += 1
        self.counters["prompt_rows_stepped"] += sum(r._feed_at is not None for r in done.rows)
        self.counters["rows_stepped"] += rows
        self.counters["max_rows_in_a_step"] = max(self.counters["max_rows_in_a_step"], rows)
        for b, (request, row) in enumerate(zip(done.rows, report)):
            if request.done.is_set():  # it left while this step ran (finished the step before, or cancelled)
                continue
            fed = request._feed_at is not None
            if not (self._fed(done, b, request, row) if fed else self._advance(done, b, request, row)):
                continue
            if request.error is None:
                if request.prefix_cache is not None:
                    self._settle(done, b, request, row.keep)
                self._hold(done, b)
            if request.settings.n_draft == "auto" and self._planner is not None:
                self.model.__dict__.setdefault("_draft_counts", {})[(id(self.drafter), request.strategy.key)] = (
                    list(self._planner.proposed), list(self._planner.accepted))
        self._remove([b for b, r in enumerate(self._rows) if r.done.is_set()])

    def _replay(self, done: _Pass, report: list[decoding.RowReport]) -> None:
        """Engine(rollback="replay"): the step left each row's layers past its whole pass; a row that kept fewer
        tokens runs its kept ones again from where the step started, alone (batch 1: no padding enters its
        linear-attention state)."""
        (before, _), (state, last) = done.inputs, done.outputs
        hidden, rows = last[0], len(done.rows)
        layers = state["layers"]
        with self._timer("replay"):
            for b, row in enumerate(report):
                if row.keep == done.width or done.rows[b]._feed_at is not None:
                    continue
                index = mx.array([b], mx.int32)
                pre, post, _, replayed = decoding.trunk_step(
                    self.model, mx.array([row.tokens[:row.keep]], mx.int32), _rows_of(before, index), record=False)
                h = _pad_axis(post if self.engine.hidden == "post" else pre, 1, done.width)
                layers = _put_row(layers, b, replayed, rows)
                hidden = _put_row(hidden, b, h, rows)
        state, last = {**state, "layers": layers}, (hidden, last[1], last[2])
        done.outputs = (state, last)
        self._state, self._last = state, last

    # ---- the prefix caches --------------------------------------------------------------------------------
    def _settle(self, done: _Pass, b: int, request: Request, keep: int) -> None:
        """A finished row's state into its conversation's cache (`PrefixCache.settle`), with where its last step
        started."""
        index = mx.array([b], mx.int32)
        (before, last_before), (state, last) = done.inputs, done.outputs
        cache = request.prefix_cache
        cache.hold(_rows_of(state, index), _rows_of(last, index), request._decoded, request._held,
                   (request._held - keep, _rows_of(before["layers"], index), _rows_of(last_before, index)))
        cache.settle(request.prompt_tokens)

    def _hold(self, done: _Pass, b: int, ids: tuple[int, ...] | None = None) -> None:
        """Keep row b of step `done` (it just finished, or a prompt's row reached `ids`) for a later prompt that
        continues its ids; the least recently used entry goes when more than `cache_entries` are held."""
        if self.cache_entries < 1:
            return
        self._put(self._held(done, b, ids))

    def _held(self, done: _Pass, b: int, ids: tuple[int, ...] | None = None) -> _Held:
        """Row b of the state `done` made as a held one: its ids (by default its prompt and tokens but the
        last), batch 1, and the kept positions of its last pass, which its head has not read."""
        request = done.rows[b]
        index = mx.array([b], mx.int32)
        state, last = (_rows_of(x, index) for x in done.outputs)
        state.pop("counts", None), state.pop("prompt_seen", None)  # this request's generation: not the next one's
        if ids is None:
            ids = tuple(request.prompt_tokens + request._decoded[:-1])
        pending = last[0][:, :int(last[2].item())] if request.drafts and "head" in state else None
        return _Held(ids, state, pending, request.drafts)

    def _put(self, held: _Held) -> None:
        self._cache[held.ids] = held
        self._cache.move_to_end(held.ids)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)

    def _lookup(self, request: Request) -> _Held | None:
        """The held state with the longest ids that the prompt continues (and a head when the request drafts)."""
        prompt, best = request.prompt_tokens, None
        for ids, held in self._cache.items():
            if ((best is None or len(ids) > len(best.ids)) and (held.head or not request.drafts)
                    and held.continued_by(prompt)):
                best = held
        if best is not None:
            self._cache.move_to_end(best.ids)
        return best

    def _advance(self, done: _Pass, b: int, request: Request, row: decoding.RowReport) -> bool:
        """A row's share of a step's report: its tokens and statistics; whether it is done."""
        tokens, keep, finite, cap = row.tokens, row.keep, row.finite, done.caps[b]
        if finite < keep:  # a kept token was chosen from NaN or Inf logits: this row ends, the others go on
            position = len(request.prompt_tokens) + len(request.tokens) - 1 + finite
            request._finish("error", _nonfinite(self.model, position, tokens[finite], drafts=tokens[1:1 + cap]))
            return True
        drafts = tokens[1:1 + cap]
        proposed = row.draft_finite[: min(keep, cap)]
        stats = request.stats
        for i in range(min(keep, cap)):
            stats.drafted[i] += 1
        for i in range(keep - 1):
            stats.accepted[i] += 1
        if self._planner is not None and cap and request.settings.n_draft == "auto":
            self._planner.observe(cap, keep - 1)
        if request.recorder is not None:
            request.recorder.record(done.experts, b)
        request._held += keep
        emitted = row.emitted
        stats.steps.append(Step(drafts, keep - 1, emitted, proposed.count(0)))
        self.counters["generated"] += len(emitted)
        if request._take(self.model, emitted):
            request._finish()
            return True
        return False


def _put_row(tree, b: int, row, rows: int):
    """`tree` (a batch's arrays) with row b replaced by `row`'s (batch 1)."""
    if rows == 1:
        return row
    return _map2(lambda a, r: mx.concatenate([a[:b], r, a[b + 1:]], axis=0), tree, row)
