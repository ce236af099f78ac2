"""A stand-in for the continuous batch (`qmtp.continuous.ContinuousBatch`), with its interface: requests
are decoded one at a time, each by `qmtp.decode`, by the thread that calls `run` (or `step`).

It lets the server be built and tested before the batch lands; it does not share decoding steps between
requests (`counters["max_rows_in_a_step"]` stays 1). A row is cancelled at its next step: `on_tokens`, called
by `decode` after every step, raises a private exception once `cancel()` was called. Each of a few
`PrefixCache`s keeps the state one request left; a request resumes from the one sharing the longest prefix of
its prompt, so a conversation's next turn prefills only what it adds (`cached_tokens`).
"""

from __future__ import annotations

import collections
import threading
import time

from ..errors import UsageError
from ..model import Model
from ..options import DEFAULT_ENGINE, Engine, Settings
from ..prefix_cache import PrefixCache, common_prefix
from ..speculative import Generation, Stats, _validate, decode

IDLE_WAIT = 0.1  # seconds `run` sleeps between looks at its stop event when nothing is queued


class _Cancelled(Exception):
    """Raised inside `decode`'s on_tokens to leave a cancelled row at its step boundary."""


class Request:
    """One request's life: its tokens and text so far, and how it ended (see `qmtp.continuous`)."""

    def __init__(self, model: Model, prompt_tokens: list[int], settings: Settings, on_tokens):
        self._model = model
        self.prompt_tokens, self.settings, self._on_tokens = prompt_tokens, settings, on_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "end" | "stop" | "length" | "cancelled" | "error"
        self.error: Exception | None = None
        self.stats = Stats(n_draft=settings.n_draft, prompt_tokens=len(prompt_tokens))
        self.cached_tokens = 0
        self.done = threading.Event()
        self._cancelled = threading.Event()
        self._generation: Generation | None = None

    def cancel(self) -> None:
        """Thread-safe: the row leaves at its next step (at once if it is still queued)."""
        self._cancelled.set()

    def generation(self) -> Generation:
        """What `generate` would have returned (once `done`; a cancelled or failed row: what it had)."""
        if self._generation is not None:
            return self._generation
        return Generation(text=self.text, tokens=list(self.tokens), prompt_tokens=self.prompt_tokens,
                          stats=self.stats, finish_reason=self.finish_reason or "length")

    def _finish(self, reason: str, generation: Generation | None = None, error: Exception | None = None) -> None:
        self._generation, self.error = generation, error
        if generation is not None:
            self.tokens, self.text, self.stats = generation.tokens, generation.text, generation.stats
        self.finish_reason = reason
        self.done.set()


class SequentialBatch:
    """`ContinuousBatch`'s interface over one request at a time. `max_batch` is accepted and unused."""

    def __init__(self, model: Model, max_batch: int = 8, engine: Engine = DEFAULT_ENGINE, cache_entries: int = 16):
        if not isinstance(engine, Engine):
            raise UsageError(f"engine: give a qmtp.Engine, not {type(engine).__name__}")
        if isinstance(cache_entries, bool) or not isinstance(cache_entries, int) or cache_entries < 1:
            raise UsageError(f"cache_entries={cache_entries!r:.40} must be an integer >= 1")
        self.model, self.max_batch, self.engine = model, max_batch, engine
        self._queue: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._caches = [PrefixCache() for _ in range(cache_entries)]
        self._used = [0.0] * cache_entries  # when each cache was last used: the oldest is replaced
        self._running: Request | None = None
        self._stopping: threading.Event | None = None
        tokenizer = model.tokenizer
        self._opener = tokenizer.token_to_id("<|im_start|>") if tokenizer is not None else None
        self.counters = {"steps": 0, "rows_stepped": 0, "max_rows_in_a_step": 0, "requests": 0}

    @property
    def active(self) -> int:
        return 1 if self._running is not None else 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def submit(self, prompt_tokens: list[int], settings: Settings, on_tokens=None) -> Request:
        """Check the request now (a UsageError naming what is wrong) and queue it; thread-safe."""
        if not isinstance(settings, Settings):
            raise UsageError(f"settings: give a qmtp.Settings (Settings.of(...)), not {type(settings).__name__}")
        if on_tokens is not None and not callable(on_tokens):
            raise UsageError(f"on_tokens={on_tokens!r:.40} must be a function of a list of token ids (or None)")
        prompt_tokens = [int(t) for t in prompt_tokens]
        settings.check_for(self.model)
        _validate(self.model, prompt_tokens, settings)
        request = Request(self.model, prompt_tokens, settings, on_tokens)
        with self._wake:
            self._queue.append(request)
            self._wake.notify()
        return request

    def step(self) -> bool:
        """Decode the next queued request to its end (engine thread only); False when none was queued."""
        with self._wake:
            request = self._queue.popleft() if self._queue else None
            self._running = request
        if request is None:
            return False
        try:
            if request._cancelled.is_set():
                request._finish("cancelled")
            else:
                self._decode(request)
        finally:
            self._running = None
        return True

    def run(self, stop: threading.Event) -> None:
        """The engine thread's loop: decode while requests are queued, else wait for one, until `stop`."""
        self._stopping = stop
        while not stop.is_set():
            if not self.step():
                with self._wake:
                    if not self._queue:
                        self._wake.wait(IDLE_WAIT)
        with self._wake:  # requests left queued at shutdown end cancelled: nobody waits on them forever
            left, self._queue = list(self._queue), collections.deque()
        for request in left:
            request._finish("cancelled")

    def _decode(self, request: Request) -> None:
        def on_tokens(tokens: list[int]) -> None:
            if request._cancelled.is_set() or (self._stopping is not None and self._stopping.is_set()):
                raise _Cancelled
            self.counters["steps"] += 1
            self.counters["rows_stepped"] += 1
            self.counters["max_rows_in_a_step"] = max(self.counters["max_rows_in_a_step"], 1)
            request.tokens.extend(tokens)
            if request._on_tokens is not None:
                request._on_tokens(list(tokens))

        cache = self._cache_for(request.prompt_tokens)
        turn = self._turn_start(request.prompt_tokens)
        if turn:  # where the next turn's history parts from this prompt (its generation prompt): a snapshot
            cache.mark(turn)
        self.counters["requests"] += 1
        try:
            generation = decode(self.model, request.prompt_tokens, request.settings, self.engine, cache, on_tokens)
        except _Cancelled:
            request._finish("cancelled")
        except Exception as error:  # non-finite logits, a callback's failure: this request fails, not the server
            request._finish("error", error=error)
        else:
            request.cached_tokens = generation.stats.prompt_tokens - generation.stats.prefilled_tokens
            request._finish(generation.finish_reason, generation)

    def _turn_start(self, prompt_tokens: list[int]) -> int:
        """Where a ChatML prompt's last turn (its generation prompt) starts, or 0: a chat's next turn renders
        this reply differently (Qwen's template drops its thinking), so it shares the prompt only up to there."""
        opener = self._opener
        if opener is None or opener not in prompt_tokens:
            return 0
        return len(prompt_tokens) - 1 - prompt_tokens[::-1].index(opener)

    def _cache_for(self, prompt_tokens: list[int]) -> PrefixCache:
        """The cache holding the longest prefix of the prompt, else the one used longest ago."""
        shared = [common_prefix(c.tokens, prompt_tokens) for c in self._caches]
        best = max(range(len(self._caches)), key=lambda i: (shared[i], -self._used[i]))
        if shared[best] == 0:
            best = min(range(len(self._caches)), key=lambda i: self._used[i])
        self._used[best] = time.monotonic()
        return self._caches[best]
