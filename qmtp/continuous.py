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

import mlx.core as mx
import numpy as np

from . import acceptance, adaptive, chat, decoding
from .adaptive import DraftPlanner
from .errors import UsageError
from .model import COMPILE, Model, release_at_thread_exit
from .options import DEFAULT_ENGINE, MAX_N_DRAFT, Engine, Settings
from .speculative import Generation, Stats, Step, _end_set, _untimed, _nonfinite, _validate
from .text import ReplyText

PREFILL_CHUNK = 8  # tokens of a joining prompt's first chunk while rows run, before any chunk is timed
CHUNK_SHARE = 0.8  # a chunk's time, as a share of one decoding step's: the rows' interval stays under twice theirs
MIN_CHUNK, MAX_CHUNK = 1, 1024
IDLE_CHUNK = 1024  # with no row running, nobody waits: a prompt is prefilled in big pieces
# A joining prompt rides in the rows' own pass (a row that reads the prompt's next tokens, width a step) when
# a chunk of its own within the step's budget would read fewer than this many times the width: a pass's fixed
# cost (dispatch, on a small model or a CPU) then dominates a chunk, and a row costs the step far less.
FEED_OVER_CHUNK = 4


class Request:
    """One row's life: its prompt and settings, what it produced so far, and how it ended."""

    def __init__(self, prompt_tokens: list[int], settings: Settings, on_tokens, strategy, eos: frozenset[int],
                 tokenizer=None, on_done=None):
        self.prompt_tokens = list(prompt_tokens)
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
        self.done.set()
        if self.on_done is not None:
            self.on_done()


def _prefill_row(model: Model, head, tokens: list[int], capacity: int, strategy, hidden: str, key, chunk,
                 resume: _Held | None = None, mark: int = 0, on_mark=None):
    """A joining prompt through the trunk alone (batch 1), `chunk()` tokens at a time, yielding between chunks
    (and the head over its positions but the last, when it drafts); from `resume`'s state when given (only the
    tokens after the ones it holds are run). A chunk ends at `mark` when it is inside the prompt, and
    `on_mark(state)` gets the state there (the head has read position mark - 1 with the token at mark).
    Yields (the tokens done, the state, the trunk state at the last position done). Returns (state, the trunk state at the last position [1, 1, H], the first token, whether its logits were
    finite)."""
    state, at, length = _resumed(model, head, tokens, capacity, resume), 0, len(tokens)
    at = len(resume.ids) if resume is not None else 0
    trunk_pass, head_pass = _chunk_passes(model, head)
    while at < length:
        end = min(length, at + chunk())
        if at < mark < end:
            end = mark
        end = at + _power_of_two_at_most(end - at)
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
            if at == mark and on_mark is not None:
                on_mark({**state, "head_offset": mx.array([at], mx.int32)} if head is not None else dict(state))
            yield at, state, h[:, -1:]
    if head is not None:
        state["head_offset"] = mx.array([length - 1], mx.int32)
    logits = model.logits(post[:, -1:])[0].astype(mx.float32)
    if getattr(strategy, "by_position", False):  # coupled sampling: the first token's key is its position's
        key = strategy.key_at(key, length)
    history = None
    if strategy.history:  # penalties: nothing generated yet, and the prompt's tokens (a held state's are not
        state.update(_fresh_history(logits.shape[-1], tokens))  # this request's: `_hold` drops them)
        history = (state["counts"], state["prompt_seen"][0])
    first, _ = strategy.pick(logits, key, history)
    finite = mx.isfinite(logits).all()
    mx.eval(first, finite, state)
    return state, h[:, -1:], int(first.item()), bool(finite.item())


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _chunk_passes(model: Model, head):
    """The trunk over a chunk of a joining prompt, and the head over its positions, compiled once per model and
    chunk size (chunks are cut to powers of two, so a prompt of any length needs at most a few traces). On a
    dispatch-bound machine a chunk run op by op cost more than the rows' whole compiled step, so that the rows
    waited more than twice as long even for the smallest chunk, and the chunks shrank to a token each."""
    def trunk(layers, offset, tokens):
        pre, post, _, layers = decoding.trunk_step(model, tokens, {"layers": layers, "offset": offset}, record=False)
        return pre, post, layers

    def head_over(hidden, tokens, buffers, at):
        return decoding.head_step(model, head, hidden, tokens, buffers, at)[1]

    if not COMPILE:
        return trunk, head_over
    passes = model.__dict__.setdefault("_chunk_passes", {})
    key = id(head)
    if key not in passes:
        passes[key] = (mx.compile(trunk, inputs=[model.state]),
                       mx.compile(head_over, inputs=[model.state] + ([head.state] if head is not None
                                                                       and head is not model.mtp else [])))
    return passes[key]


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
    state holds, the state (batch 1), and either the last pass (what its head has not read yet: a finished
    row) or None with the token its head read after the ids (a prompt's state at its last turn's start)."""

    def __init__(self, ids: tuple[int, ...], state: dict, last, head: bool, read_next: int | None = None):
        self.ids, self.state, self.last, self.head, self.read_next = ids, state, last, head, read_next

    def continued_by(self, prompt: list[int]) -> bool:
        ids = self.ids
        return (len(ids) < len(prompt) and tuple(prompt[:len(ids)]) == ids
                and (self.read_next is None or prompt[len(ids)] == self.read_next))


def turn_start(opener: int | None, prompt_tokens: list[int]) -> int:
    """Where a ChatML prompt's last turn (its generation prompt) starts, or 0: a chat's next turn renders this
    reply otherwise than it was generated (Qwen's template drops its thinking), so the two share the prompt
    only up to there."""
    if opener is None or opener not in prompt_tokens:
        return 0
    return len(prompt_tokens) - 1 - prompt_tokens[::-1].index(opener)


def _resumed(model: Model, head, tokens: list[int], capacity: int, resume: _Held | None) -> dict:
    """The state a prefill starts from: empty, or a held row's, grown to `capacity`, its head (when drafting)
    having read the held row's last pass, the prompt's next token after its last position."""
    if resume is None:
        return decoding.empty_state(model, capacity, head=head is not None)
    state = dict(resume.state)
    if decoding.capacity_of(model, state) < capacity:
        state = decoding.grow_state(model, state, capacity)
    if head is None:
        state.pop("head", None)
        state.pop("head_offset", None)
        return state
    if resume.last is None:  # its head read the last held position with the prompt's next token (`continued_by`)
        return state
    hidden, after, keep = resume.last
    keep = int(keep.item())
    at = len(resume.ids)
    read = mx.concatenate([after[:, :keep - 1], mx.array([[tokens[at]]], mx.int32)], axis=1)
    _, state["head"] = decoding.head_step(model, head, hidden[:, :keep], read, state["head"], state["head_offset"])
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


class ContinuousBatch:
    """Rows decoding together; requests join at step boundaries (`submit`, `step`, `run`).

    max_batch: rows decoding at once (more requests wait). cache_entries: finished rows' states kept for a
    later request whose prompt continues one of them (`qmtp.continuous` docs: a conversation's next turn),
    the least recently used evicted first. join: how a prompt joins running rows: "auto" (the cheaper way,
    measured), "chunks" (passes of its own between the rows' steps) or "rows" (as a row of their pass)."""

    JOINS = ("auto", "chunks", "rows")

    def __init__(self, model: Model, max_batch: int = 8, engine: Engine = DEFAULT_ENGINE, cache_entries: int = 16,
                 join: str = "auto"):
        if not isinstance(model, Model):
            raise UsageError(f"model: give a qmtp Model, not {type(model).__name__}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise UsageError(f"max_batch={max_batch!r:.40} must be an integer >= 1")
        if not isinstance(engine, Engine):
            raise UsageError(f"engine: give a qmtp.Engine, not {type(engine).__name__}")
        if engine.rollback != "record":  # rows keep different counts: replaying each would be a pass of its own
            raise UsageError("Engine(rollback='replay') replays a single generation's kept tokens: a batch rolls back "
                             "with rollback='record' only")
        self.model, self.max_batch, self.engine = model, max_batch, engine
        self._timer = engine.timer or _untimed
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
        self._joining: list = []  # [request, prefill generator, seconds spent]
        self._rows: list[Request] = []
        self._state = self._last = self._keys = None
        self._capacity = 0
        # step costs per batch size, kept with the model (as `generate`'s are): a later batch starts from them
        self._costs: dict[int, adaptive.StepCosts] = model.__dict__.setdefault(
            "_batch_step_costs", {}).setdefault((id(self.drafter), engine.hidden, engine.chain), {})
        self._planner = None
        self._step_seconds = None  # the last step's time: what a prefill chunk may take
        self.chunk_costs = ChunkCosts()  # what a prefill chunk costs, by its tokens
        self._budget = None  # prefill tokens this step may still run
        tokenizer = model.tokenizer
        self._opener = tokenizer.token_to_id("<|im_start|>") if tokenizer is not None else None
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

    def submit(self, prompt_tokens: list[int], settings: Settings, on_tokens=None, on_done=None) -> Request:
        """Check the request now (a UsageError naming what is wrong) and queue it; thread-safe. `on_tokens`
        gets each step's new tokens, `on_done` is called once the row has ended, both on the engine thread."""
        request = self.check(prompt_tokens, settings, on_tokens, on_done)
        with self._lock:
            self._queue.append(request)
        self._wake.set()
        return request

    def enqueue(self, requests: list[Request]) -> None:
        """Queue requests made by `check` (in order)."""
        with self._lock:
            self._queue.extend(requests)
        self._wake.set()

    def check(self, prompt_tokens, settings: Settings, on_tokens=None, on_done=None) -> Request:
        """The request for a prompt and settings, every check done (nothing queued)."""
        if not isinstance(settings, Settings):
            raise UsageError(f"settings: give a qmtp.Settings (Settings.of(...)), not {type(settings).__name__}")
        if on_tokens is not None and not callable(on_tokens):
            raise UsageError(f"on_tokens={on_tokens!r:.40} must be a function of a list of token ids (or None)")
        if on_done is not None and not callable(on_done):
            raise UsageError(f"on_done={on_done!r:.40} must be a function of no argument (or None)")
        if settings.n_draft != 1 and self.drafter is None:
            self.model.require_head()
        sampler = settings.check_for(self.model)
        prompt_tokens = list(prompt_tokens) if not isinstance(prompt_tokens, str) else prompt_tokens
        if isinstance(prompt_tokens, str) or not all(isinstance(t, int) for t in prompt_tokens):
            raise UsageError("prompt_tokens: give a list of integer token ids")
        _validate(self.model, prompt_tokens, settings)
        eos = chat.end_ids(self.model) if settings.stop_at_eos else frozenset()
        return Request(prompt_tokens, settings, on_tokens, acceptance.strategy_for(sampler, self.engine.acceptance),
                       _end_set(eos), self.model.tokenizer, on_done)

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
        self._state = self._last = self._keys = None
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
            self._budget = None
            self._budget = self._chunk()
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

    def _chunk(self) -> int:
        """Tokens of the next prefill chunk: what is left of this step's budget, about one decoding step's time
        while rows run."""
        if self._budget is not None:
            return max(1, self._budget)
        if not self._rows:
            return IDLE_CHUNK
        tokens = None if self._step_seconds is None else self.chunk_costs.tokens_within(CHUNK_SHARE * self._step_seconds)
        return PREFILL_CHUNK if tokens is None else max(MIN_CHUNK, min(MAX_CHUNK, tokens))

    def _start_prefill(self, request: Request) -> list:
        settings = request.settings
        # the prompt and a step's room: the buffers grow as the row decodes (`_fit`), not to max_tokens up front
        capacity = decoding.capacity_for(len(request.prompt_tokens) + 2 * MAX_N_DRAFT)
        head = self.drafter if request.drafts else None
        key = mx.random.key(settings.seed)
        resume = self._lookup(request)
        if resume is not None:
            request.cached_tokens = len(resume.ids)
            request.stats.prefilled_tokens -= len(resume.ids)
        prompt = request.prompt_tokens
        mark = turn_start(self._opener, prompt)
        if resume is not None and mark <= len(resume.ids):
            mark = 0

        def hold_turn_start(state: dict) -> None:
            ids = tuple(prompt[:mark])
            self._put(_Held(ids, state, None, request.drafts, read_next=prompt[mark]))

        prefill = _prefill_row(self.model, head, prompt, capacity, request.strategy, self.engine.hidden, key,
                               self._chunk, resume, mark, hold_turn_start if mark and self.cache_entries else None)
        return _Joining(request, prefill, key, mark if self.cache_entries else 0)

    def _prefill_chunk(self) -> int:
        """One chunk of the first joining prompt (at most the step's budget of tokens); a prompt done joins the
        batch. The tokens it ran."""
        joining = self._joining[0]
        request = joining.request
        started = time.perf_counter()
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
        if not finite:
            request._finish("error", _nonfinite(self.model, len(request.prompt_tokens) - 1,
                                                request.prompt_tokens[-1], "for the prompt "))
            return ran
        finished = request._take(self.model, [first])
        self.counters["generated"] += 1
        if finished:
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
        know."""
        if (self.join == "chunks" or request.strategy.history or self._step_seconds is None
                or not any(r._feed_at is None for r in self._rows)):
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

    def _fed(self, b: int, request: Request, row: decoding.RowReport) -> bool:
        """A prompt's row's share of a step: its position moves on; at its last piece, its first token (whether
        the row is done)."""
        keep, finite, first = row.keep, row.finite, row.next_token
        at, prompt = request._feed_at + keep, request.prompt_tokens
        if at < len(prompt):
            request._feed_at = at
            if at == request._mark:
                self._hold(b, tuple(prompt[:at]))
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
        """No row decodes any more: the prompts' rows go back to chunks of their own (nobody waits on them)."""
        joinings = []
        for b, request in enumerate(self._rows):
            at = request._feed_at
            held = self._held(b, tuple(request.prompt_tokens[:at]))
            capacity = decoding.capacity_for(len(request.prompt_tokens) + 2 * MAX_N_DRAFT)
            prefill = _prefill_row(self.model, self.drafter if request.drafts else None, request.prompt_tokens,
                                   capacity, request.strategy, self.engine.hidden, request._seed_key, self._chunk,
                                   held, request._mark, self._turn_holder(request) if request._mark else None)
            joining = _Joining(request, prefill, request._seed_key, request._mark)
            joining.done, joining.seconds = at, time.perf_counter() - request._prefill_started
            request._feed_at = None
            joinings.append(joining)
        self._remove(list(range(len(self._rows))))
        self._joining[:0] = joinings

    def _turn_holder(self, request: Request):
        prompt, mark = request.prompt_tokens, request._mark

        def hold_turn_start(state: dict) -> None:
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
        if not kept:
            self._state = self._last = self._keys = None
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
        """This step's width: the widest fixed n_draft among the rows, or the planner's choice with an "auto"
        row (at least that widest)."""
        decoding_rows = [r for r in self._rows if r._feed_at is None]  # a prompt's row reads what the step gives
        fixed = max((r.settings.n_draft for r in decoding_rows if r.settings.n_draft != "auto"), default=1)
        if not any(r.settings.n_draft == "auto" for r in decoding_rows) or "head" not in self._state:
            return fixed if "head" in self._state else 1
        if self._planner is None:
            self._planner = DraftPlanner(learned=adaptive.StepCosts())
        self._planner.learned = self._costs.setdefault(len(self._rows), adaptive.StepCosts())
        return max(fixed, self._planner.choose())

    def _compiled(self, k: int, strategies: tuple, caps: tuple, follows: bool, feeding: tuple = ()):
        engine = self.engine
        return decoding.compiled_step(self.model, self.drafter, k, strategies, caps, engine.hidden, True,
                                      (engine.head_cache, engine.chain), follows, feeding, compiled=engine.compiled)

    def _fit(self, width: int) -> None:
        """KV buffers long enough for this step's `width` tokens on every row, grown to the next power of two
        when they are not. Attention reads its whole buffer every step, so buffers sized for max_tokens up front
        cost every step from the first: a request that leaves max_tokens out asks for the rest of the context
        (262,144 positions for Qwen3.6-35B-A3B: GBs a row, read at every token). Growing by doubling retraces
        the compiled step a few times over a long generation."""
        needed = max(len(r.prompt_tokens) + len(r._decoded) if r._feed_at is None else r._feed_at
                     for r in self._rows) + width + 1
        if needed > self._capacity:
            self._capacity = decoding.capacity_for(needed)
            self._state = decoding.grow_state(self.model, self._state, self._capacity)

    def _decode_step(self) -> None:
        width = self._width()
        self._fit(width)
        k = width - 1
        feeding = tuple(r._feed_at is not None for r in self._rows)
        caps = tuple(0 if fed else r.cap(width) for r, fed in zip(self._rows, feeding))
        follows = k == 0 and "head" in self._state
        step = self._compiled(k, tuple(r.strategy for r in self._rows), caps, follows, feeding)
        feed = (self._feed(width),) if any(feeding) else ()
        started = time.perf_counter()
        try:
            with self._timer("step"):
                self._state, self._last, report, _, self._keys = step(self._state, self._last, self._keys, *feed)
                report = decoding.read_report(report, width)
        except Exception as error:  # a step is shared: the rows in it fail, the engine goes on with new ones
            for request in self._rows:
                request._finish("error", error)
            self._remove(list(range(len(self._rows))))
            return
        seconds = time.perf_counter() - started
        with self._timer("host"):
            self._book(report, width, caps, seconds)

    def _book(self, report: list[decoding.RowReport], width: int, caps: tuple, seconds: float) -> None:
        """The host's share of a step: counters, the planner, every row's tokens; finished rows leave."""
        self._step_seconds = seconds
        rows = len(self._rows)
        if self._planner is not None and any(r.settings.n_draft == "auto" for r in self._rows):
            self._planner.observe_cost(width, seconds)
        self.counters["steps"] += 1
        self.counters["prompt_rows_stepped"] += sum(r._feed_at is not None for r in self._rows)
        self.counters["rows_stepped"] += rows
        self.counters["max_rows_in_a_step"] = max(self.counters["max_rows_in_a_step"], rows)
        finished = [b for b, (request, row) in enumerate(zip(self._rows, report))
                    if (self._fed(b, request, row) if request._feed_at is not None
                        else self._advance(request, row, caps[b]))]
        for b in finished:
            if self._rows[b].error is None:
                self._hold(b)
        self._remove(finished)

    # ---- the prefix cache ---------------------------------------------------------------------------------
    def _hold(self, b: int, ids: tuple[int, ...] | None = None) -> None:
        """Keep row b's state (it just finished, or a prompt's row reached `ids`) for a later prompt that
        continues its ids; the least recently used entry goes when more than `cache_entries` are held."""
        if self.cache_entries < 1:
            return
        self._put(self._held(b, ids))

    def _held(self, b: int, ids: tuple[int, ...] | None = None) -> _Held:
        """Row b's state as a held one: its ids (by default its prompt and tokens but the last), batch 1."""
        request = self._rows[b]
        index = mx.array([b], mx.int32)
        state = _rows_of(self._state, index)
        state.pop("counts", None), state.pop("prompt_seen", None)  # this request's generation: not the next one's
        if ids is None:
            ids = tuple(request.prompt_tokens + request._decoded[:-1])
        return _Held(ids, state, _rows_of(self._last, index), request.drafts)

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

    def _advance(self, request: Request, row: decoding.RowReport, cap: int) -> bool:
        """A row's share of a step's report: its tokens and statistics; whether it is done."""
        tokens, keep, finite = row.tokens, row.keep, row.finite
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
        emitted = row.emitted
        stats.steps.append(Step(drafts, keep - 1, emitted, proposed.count(0)))
        self.counters["generated"] += len(emitted)
        if request._take(self.model, emitted):
            request._finish()
            return True
        return False
