"""The ASGI application: the OpenAI API's routes over an engine with the continuous batch's interface.

One thread, started with the app and stopped with it, runs `engine.run(stop)` and so owns MLX. A request is
checked on the event loop (`protocol`), handed to the engine with `engine.submit`, and its tokens come back
from the engine thread through `loop.call_soon_threadsafe` into an asyncio queue: the event loop never waits
on a decoding step. A client that goes away cancels its row, which leaves the batch at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .. import chat
from ..errors import UsageError
from . import protocol
from .protocol import ApiError, Parsed, Served, Shapes
from ..text import ReplyText, ThinkingSplit, split_reply

ENGINE_CHECK_SECONDS = 0.1  # how often the watcher looks whether the engine thread is still alive
MAX_BODY_BYTES = 32 * 2**20


class _ErrorResponse(JSONResponse):
    """An error's JSON in ASCII: a message quoting the client's text may hold a lone surrogate (a `model` of
    "\\ud800"), which no UTF-8 encodes, and it goes back as its \\u escape."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(error: ApiError) -> JSONResponse:
    return _ErrorResponse(error.body(), status_code=error.status)


_END = object()  # put in a row's queue after its last tokens


class _Live:
    """A row's tokens, handed from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.row = None

    def push(self, tokens: list[int]) -> None:  # on the engine thread
        self._put(tokens)

    def end(self) -> None:  # on the engine thread, once the row has ended (after its last `push`)
        self._put(_END)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody reads this row any more
            if self.row is not None:
                self.row.cancel()

    async def updates(self):
        """Each step's tokens as they come, until the row is done."""
        while True:
            item = await self.queue.get()
            if item is _END:
                if not self.row.done.is_set():  # the engine thread died: this row will never end
                    raise ApiError("the engine stopped", None, status=503, kind="server_error",
                                   code="engine_stopped")
                return
            yield item


class _Watcher:
    """One task for all rows: a row's queue ends when the row does (its `on_done`, `_Live.end`); if the engine
    thread died, nobody would end them, so this ends every open row's queue then, and a request waits on its
    queue alone."""

    def __init__(self):
        self.rows: set[_Live] = set()

    async def run(self, engine_alive) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(ENGINE_CHECK_SECONDS)
            self.rows = {live for live in self.rows if not live.row.done.is_set()}
            if not engine_alive():
                for live in self.rows:  # after the tokens the engine pushed before it died (already scheduled)
                    loop.call_soon(live.queue.put_nowait, _END)
                self.rows = set()


async def _cancel_on_disconnect(request: Request, row) -> None:
    """A client that leaves before its whole (not streamed) response cancels its row."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    row.cancel()


class Server:
    """The routes' shared state: what is served, the engine, the queue's limit, the API key."""

    def __init__(self, served: Served, engine, api_key: str | None, max_queue: int):
        self.served, self.engine, self.api_key, self.max_queue = served, engine, api_key, max_queue
        self.eos = chat.end_ids(served.model)
        self.started = int(time.time())
        self.thread: threading.Thread | None = None  # the engine's, while the app runs
        self.watcher = _Watcher()

    def authorise(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError("a valid API key is required: send Authorization: Bearer KEY", None, status=401,
                           code="invalid_api_key")

    async def body(self, request: Request):
        self.authorise(request)
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", None, status=413)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as error:  # RecursionError: nested too deep
            raise ApiError(f"the request body is not JSON: {str(error)[:200]}") from None

    def submit(self, parsed: Parsed) -> _Live:
        if self.thread is None or not self.thread.is_alive():
            raise ApiError("the engine is not running", None, status=503, kind="server_error", code="engine_stopped")
        if self.engine.waiting >= self.max_queue:
            raise ApiError(f"the server is busy: every row is taken (--max-batch {self.engine.max_batch}) and "
                           f"{self.engine.waiting} requests wait for one (--max-queue {self.max_queue}); try again "
                           "later", None, status=429, kind="rate_limit_error",
                           code="queue_full")
        live = _Live(asyncio.get_running_loop())
        try:
            live.row = self.engine.submit(parsed.prompt_tokens, parsed.settings, live.push, on_done=live.end,
                                          marks=parsed.marks)
        except UsageError as error:  # what the engine checks itself (protocol checked the fields before)
            raise ApiError(str(error), None) from None
        self.watcher.rows.add(live)
        return live

    async def answer(self, request: Request, parsed: Parsed):
        live = self.submit(parsed)
        shapes = Shapes(parsed.kind, self.served.name)
        if parsed.stream:
            return EventSourceResponse(self.events(live, parsed, shapes), ping=15)
        row = live.row
        listening = asyncio.create_task(_cancel_on_disconnect(request, row))
        try:
            async for _ in live.updates():
                pass
        finally:
            listening.cancel()
            if not row.done.is_set():  # the handler was cancelled (shutdown) or failed
                row.cancel()
        if row.finish_reason == "cancelled":
            return JSONResponse({}, status_code=499)  # the client left: nobody reads this
        if row.finish_reason == "error":
            return _error(_failed(row))
        generation = row.generation()
        reasoning, content = split_reply(generation.text, parsed.opened_thinking)
        counts = protocol.usage(len(parsed.prompt_tokens), len(generation.tokens), row.cached_tokens)
        reply = shapes.whole(reasoning if parsed.opened_thinking else None, content,
                             protocol.finish_reason(row.finish_reason), counts)
        return JSONResponse(reply)

    async def events(self, live: _Live, parsed: Parsed, shapes: Shapes):
        """The server-sent events of a streamed response, `[DONE]` last; a client that leaves cancels the row."""
        row = live.row
        text = ReplyText(self.served.model.tokenizer, self.eos if parsed.settings.stop_at_eos else (),
                         parsed.settings.stop)
        split = ThinkingSplit(parsed.opened_thinking)
        try:
            if parsed.kind == "chat":
                yield _data(shapes.chunk(role=True))
            try:
                async for tokens in live.updates():
                    text.take(tokens)
                    reasoning, content = split.feed(text.delta())
                    if reasoning or content:
                        yield _data(shapes.chunk(reasoning, content))
            except ApiError as error:  # the engine stopped
                row.error, row.finish_reason = error, "error"
            if row.finish_reason == "error":
                yield {"data": json.dumps(_failed(row).body(), separators=(",", ":"))}  # ASCII, as _error
                yield {"data": "[DONE]"}
                return
            generation = row.generation()
            reasoning, content = split.feed(text.finish(generation.text))
            held, _ = split.finish()
            if reasoning + held or content:
                yield _data(shapes.chunk(reasoning + held, content))
            yield _data(shapes.chunk(finish=protocol.finish_reason(row.finish_reason)))
            if parsed.include_usage:
                counts = protocol.usage(len(parsed.prompt_tokens), len(generation.tokens), row.cached_tokens)
                yield _data(shapes.usage_chunk(counts))
            yield {"data": "[DONE]"}
        finally:
            if not row.done.is_set():
                row.cancel()

    def health(self) -> dict:
        engine = self.engine
        running = self.thread is not None and self.thread.is_alive()
        return {"status": "ok" if running else "engine stopped", "model": self.served.name, "active": engine.active,
                "waiting": engine.waiting, "max_queue": self.max_queue, "counters": dict(engine.counters)}


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}


def _failed(row) -> ApiError:
    error = row.error
    return ApiError(f"the request failed: {type(error).__name__}: {error}", None, status=500, kind="server_error",
                    code="generation_failed")


def create_app(served: Served, engine, api_key: str | None = None, max_queue: int = 64) -> Starlette:
    """The app serving `served` through `engine` (a `qmtp.continuous.ContinuousBatch`): the engine's
    thread starts with the app and stops with it."""
    server = Server(served, engine, api_key, max_queue)

    async def chat_completions(request: Request):
        return await server.answer(request, protocol.parse_chat(await server.body(request), served))

    async def completions(request: Request):
        return await server.answer(request, protocol.parse_completion(await server.body(request), served))

    entry = {"id": served.name, "object": "model", "created": server.started, "owned_by": "qmtp",
             "max_model_len": served.model.config.max_position_embeddings, **protocol.describe_defaults(served)}

    async def models(request: Request):
        server.authorise(request)
        return JSONResponse({"object": "list", "data": [entry]})

    async def model(request: Request):
        server.authorise(request)
        name = request.path_params["name"]
        if name != served.name:
            raise ApiError(f"The model `{name[:80]}` does not exist: this server serves `{served.name}`", "model",
                           status=404, code="model_not_found")
        return JSONResponse(entry)

    async def health(request: Request):
        state = server.health()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        stop = threading.Event()
        thread = threading.Thread(target=engine.run, args=(stop,), name="qmtp-engine", daemon=True)
        server.thread = thread
        thread.start()
        watching = asyncio.create_task(server.watcher.run(thread.is_alive))
        try:
            yield
        finally:
            watching.cancel()
            stop.set()
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),  # a name may hold a slash: Qwen/...
              Route("/health", health, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ApiError: lambda request, error: _error(error),
        HTTPException: lambda request, error: _error(ApiError(str(error.detail), None, status=error.status_code,
                                                              code="not_found" if error.status_code == 404 else None)),
        Exception: lambda request, error: _error(ApiError(f"internal error: {type(error).__name__}: {error}", None,
                                                          status=500, kind="server_error")),
    })
    app.state.server = server
    return app
