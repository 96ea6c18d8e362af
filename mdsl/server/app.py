"""The OpenAI-compatible HTTP server over `mdsl.LLM`: a Starlette app, served by uvicorn (`mdsl serve`).

    POST /v1/completions        prompt: text or token ids; stream or not
    POST /v1/chat/completions   messages through the checkpoint's chat template; stream or not
    GET  /v1/models             the served model
    GET  /health                200 while the engine serves, 503 once it stopped or the server drains
    GET  /metrics               Prometheus text format (mdsl.server.metrics)

The server talks to the engine only through its public API: `submit`, then the handle's `subscribe`
(the engine's host thread wakes the event loop) and `poll` (the tokens so far), `cancel`, `stats`,
`close`. Each token the engine produces becomes one server-sent event, in order, read by index from
the handle: none is dropped or sent twice. Each choice carries the tokens as `token_ids` (an extension:
models without a tokenizer have no text). A request whose client disconnects is cancelled, which frees
its KV pages. On SIGTERM or SIGINT the server stops accepting connections, lets running requests finish
for the shutdown timeout, cancels those still running (they end with finish_reason "cancelled"), closes
the engine and exits 0."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from functools import partial
from typing import Optional

import anyio
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mdsl.server.api import ApiError, Job, ServedModel, chat_job, completion_job
from mdsl.server.metrics import CONTENT_TYPE, Metrics
from mdsl.server.text import TextStream
from mdsl.serving import ServingError

_log = logging.getLogger(__name__)

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


@attrs.frozen
class Piece:
    """What one step of a request adds: its token (None for the end), the text it releases, and the
    finish reason on the last piece."""

    token: Optional[int]
    text: str
    reason: Optional[str] = None


class Generation:
    """One job on the engine, followed from the event loop."""

    def __init__(self, server: "Server", job: Job):
        llm = server.model.llm
        self.server, self.job = server, job
        self.id = f"{'chatcmpl' if job.chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.submitted = time.monotonic()
        self.handle = llm.submit(job.prompt, job.params)
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.handle.subscribe(lambda: loop.call_soon_threadsafe(self._wake.set))
        eos = () if job.params.ignore_eos else llm.eos_token_ids
        self.text = TextStream(llm.tokenizer, job.stop_strings, frozenset(job.params.stop_token_ids) | frozenset(eos))
        self.tokens: list = []
        self.reason: Optional[str] = None
        self._first = self._last = None
        server.active.add(self)
        server.metrics.request(len(job.prompt))

    async def pieces(self):
        """A piece per token as the engine produces it, then the end. Raises the engine's ServingError."""
        while True:
            self._wake.clear()
            new, reason = self.handle.poll(len(self.tokens))
            if new:
                self._last = time.monotonic()
                self._first = self._first or self._last
            for token in new:
                self.tokens.append(token)
                self.server.metrics.tokens(1, self._last)
                text = self.text.push(token)
                if self.text.stopped:          # a stop string: the rest of the engine's tokens are not wanted
                    self.handle.cancel()
                    yield Piece(token, text)
                    await self._ended()
                    yield self._end("stop")
                    return
                yield Piece(token, text)
            if reason is not None:
                yield self._end(reason)
                return
            await self._wake.wait()

    async def _ended(self) -> None:
        """Wait for the engine to end the request (a cancelled one ends at its next step): what it reports
        at the end (the prompt's cached tokens) is then known."""
        while True:
            self._wake.clear()
            if self.handle.done():
                return
            await self._wake.wait()

    def _end(self, reason: str) -> Piece:
        self._record(reason)
        return Piece(None, self.text.finish(), reason)

    def close(self, reason: str = "cancelled") -> None:
        """The response is over: a request that has not ended is cancelled (its client left)."""
        if self.reason is None:
            self.handle.cancel()
            self._record(reason)

    def _record(self, reason: str) -> None:
        self.reason = reason
        self.server.active.discard(self)
        self.server.metrics.end(reason, self.submitted, self._first, self._last, len(self.tokens), time.monotonic())

    def usage(self) -> dict:
        """OpenAI's usage: the prompt's tokens (of which `cached_tokens` read from the prefix cache) and
        the tokens generated."""
        return {"prompt_tokens": len(self.job.prompt), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.job.prompt) + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.handle.cached_tokens}}


class _GenerationResponse:
    """The ASGI response of one generation: `respond(send)` writes it while a second task waits for the
    client's disconnect, which cancels the response and, through `close`, the engine's request."""

    def __init__(self, generation: Generation, respond):
        self.generation, self.respond = generation, respond

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch, receive, tasks.cancel_scope)
                await self.respond(send)
                tasks.cancel_scope.cancel()
        finally:
            self.generation.close()

    @staticmethod
    async def _watch(receive, scope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()


def _event(payload) -> dict:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True}


class Server:
    """The app's state: the served model, the metrics, the generations in flight, and whether it drains."""

    def __init__(self, model: ServedModel, *, api_key: Optional[str] = None, shutdown_timeout: float = 30.0):
        self.model, self.api_key, self.shutdown_timeout = model, api_key, shutdown_timeout
        self.metrics = Metrics(model.llm)
        self.created = int(time.time())
        self.active: set = set()
        self.draining = False
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- shutdown

    def drain(self) -> None:
        """Shutdown began: refuse new requests, and cancel those still running after the shutdown timeout."""
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(self.shutdown_timeout, self.cancel_all)

    def cancel_all(self) -> None:
        for generation in list(self.active):
            generation.handle.cancel()

    # ---- requests

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "You didn't provide an API key", code="invalid_api_key",
                           hint="send the header 'Authorization: Bearer KEY' with the key given to mdsl serve")
        if not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def check_engine(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        status = self.model.llm.stats().status
        if status in ("stopped", "failed"):
            raise ApiError(503, f"the serving device has {status}", hint="see the server's log; restart it")

    async def generate(self, request: Request, parse) -> _GenerationResponse:
        self.authorize(request)
        self.check_engine()
        job = parse(await _json_body(request), self.model)
        try:
            generation = Generation(self, job)
        except ServingError as e:
            self.check_engine()    # closed or stopped meanwhile: 503; else the engine refuses the request
            raise ApiError.bad(e) from None
        respond = self._stream if job.stream else self._whole
        return _GenerationResponse(generation, partial(respond, generation))

    async def _whole(self, generation: Generation, send) -> None:
        texts, reason = [], None
        try:
            async with contextlib.aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    texts.append(piece.text)
                    reason = piece.reason
        except ServingError as e:
            generation.close("error")
            await _send(send, _error_response(ApiError(500, e.message, hint=e.hint)))
            return
        text, tokens = "".join(texts), list(generation.tokens)
        if generation.job.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason, "token_ids": tokens}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": tokens}
        body = {**self._head(generation, "chat.completion" if generation.job.chat else "text_completion"),
                "choices": [choice], "usage": generation.usage()}
        await _send(send, JSONResponse(body))

    async def _stream(self, generation: Generation, send) -> None:
        chat = generation.job.chat
        head = self._head(generation, "chat.completion.chunk" if chat else "text_completion")
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if chat:
            await send(_event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None, "token_ids": []}]}))
        try:
            async with contextlib.aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    tokens = [] if piece.token is None else [piece.token]
                    if chat:
                        choice = {"index": 0, "delta": {"content": piece.text} if piece.text or piece.token is not None
                                  else {}, "logprobs": None, "finish_reason": piece.reason, "token_ids": tokens}
                    else:
                        choice = {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.reason,
                                  "token_ids": tokens}
                    await send(_event({**head, "choices": [choice]}))
        except ServingError as e:
            generation.close("error")
            await send(_event(ApiError(500, e.message, hint=e.hint).body()))
        if generation.job.include_usage:
            await send(_event({**head, "choices": [], "usage": generation.usage()}))
        await send(_event("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _head(self, generation: Generation, kind: str) -> dict:
        return {"id": generation.id, "object": kind, "created": generation.created, "model": self.model.name}


async def _json_body(request: Request):
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the request") from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}",
                       hint="send a JSON object with Content-Type: application/json") from None


async def _send(send, response: Response) -> None:
    async def no_receive():    # a complete response does not read the request
        return {"type": "http.disconnect"}

    await response({"type": "http"}, no_receive, send)


def _error_response(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def create_app(model: ServedModel, *, api_key: Optional[str] = None, shutdown_timeout: float = 30.0) -> Starlette:
    """The app; `app.state.server` is its `Server`. Its shutdown closes the engine."""
    server = Server(model, api_key=api_key, shutdown_timeout=shutdown_timeout)

    async def completions(request: Request):
        return await server.generate(request, completion_job)

    async def chat_completions(request: Request):
        return await server.generate(request, chat_job)

    async def models(request: Request):
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model.name, "object": "model", "created": server.created, "owned_by": "mdsl",
             "max_model_len": model.context}]})

    async def health(request: Request):
        status = "draining" if server.draining else model.llm.stats().status
        return JSONResponse({"status": "ok" if status == "serving" else status},
                            status_code=200 if status == "serving" else 503)

    async def metrics(request: Request):
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    async def api_error(request: Request, error: ApiError):
        server.metrics.reject(error.status)
        return _error_response(error)

    async def http_error(request: Request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = (f"no route {request.method} {request.url.path}" if error.status_code in (404, 405)
                   else str(error.detail))
        return await api_error(request, ApiError(error.status_code, message, code=code))

    async def server_error(request: Request, error: Exception):
        _log.exception("request %s %s failed", request.method, request.url.path, exc_info=error)
        return await api_error(request, ApiError(500, f"internal error: {type(error).__name__}: {error}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        yield
        await asyncio.to_thread(model.llm.close)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.server = server
    return app
