"""The HTTP app: OpenAI's routes on Starlette, talking to the scheduler only through `submit` and event queues.

`make_app` builds it. A completion request is read (bounded in bytes),
validated into a `GenerationRequest` (protocol.py), submitted, and its events
become one JSON response or a stream of server-sent events. A client that goes
away is cancelled at once, so its row leaves the batch at the next step. Every
error, whatever raised it, is answered by `_error_response` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from umakit.serve import DEFAULT_MAX_BODY_BYTES
from umakit.serve.protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
                       ChatMessageOut, ChatRequest, Completion, CompletionChoice, CompletionRequest, UsageInfo,
                       chat_logprobs, completion_logprobs, generation_request, parse_request)
from umakit.serve.scheduler import QueueFull
from umakit.serve.types import ErrorEvent, FinalEvent, SchedulerSettings, TokenEvent

log = logging.getLogger("umakit.serve")

TIMEOUT_GRACE_S = 5.0  # the scheduler times requests out itself; this bounds the wait if it cannot
_GONE = object()  # put on a request's queue when its client disconnects
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

METRIC_HELP = {
    "requests_total": "Completion requests accepted by the scheduler.",
    "requests_failed_total": "Accepted requests that ended in an error (worker failure, timeout).",
    "requests_cancelled_total": "Accepted requests whose client went away before the end.",
    "requests_rejected_total": "Requests refused because the queue was full (429).",
    "generated_tokens_total": "Tokens generated, all requests.",
    "prompt_tokens_total": "Prompt tokens of finished requests.",
    "cached_tokens_total": "Prompt tokens found in the prompt cache instead of prefilled.",
    "worker_restarts_total": "Times the generation worker failed and was restarted.",
    "decode_steps_total": "Batched decode steps run.",
    "queue_depth": "Requests waiting for a row.",
    "active_rows": "Rows decoding now.",
    "prefilling_requests": "Requests prefilling their prompt now.",
    "max_active_rows": "Most rows decoded together in one step since start.",
    "tokens_per_second": "Tokens generated per second, over the last few seconds.",
    "achieved_gbps": "Bytes the engine read per second (GB/s), over the last few seconds.",
    "peak_gbps": "The device's peak memory bandwidth (GB/s).",
    "prompt_cache_hit_ratio": "Share of requests that found a cached prefix.",
    "prompt_cache_bytes": "Bytes held by the prompt cache.",
    "prompt_cache_entries": "Caches held by the prompt cache.",
    "healthy": "1 when the generation worker runs.",
}


def make_app(model, scheduler, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             request_timeout_s: float | None = SchedulerSettings.request_timeout_s) -> Starlette:
    """The OpenAI-compatible app serving ``model`` through ``scheduler`` (started and stopped by the caller).

    With ``api_key`` every route but /health needs ``Authorization: Bearer <api_key>``.
    """
    server = _Server(model, scheduler, api_key, max_body_bytes, request_timeout_s)
    routes = [
        Route("/v1/chat/completions", partial(server.complete, ChatRequest), methods=["POST"]),
        Route("/v1/completions", partial(server.complete, CompletionRequest), methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model_card, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: server.http_error})


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Server:
    def __init__(self, model, scheduler, api_key, max_body_bytes, request_timeout_s):
        self.model, self.scheduler = model, scheduler
        self.api_key, self.max_body_bytes, self.timeout_s = api_key, max_body_bytes, request_timeout_s
        self.name = model.info.name
        self.created = int(time.time())
        self.responses: Counter[int] = Counter()  # HTTP status -> responses sent

    # -- plain routes -----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ok = self.scheduler.healthy
        return self._count(JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503))

    async def models(self, request: Request) -> Response:
        return await self._guarded(request, lambda: JSONResponse({"object": "list", "data": [self._card()]}))

    async def model_card(self, request: Request) -> Response:
        def card():
            if request.path_params["model_id"] != self.name:
                raise APIError(404, f"the model '{request.path_params['model_id']}' does not exist; "
                                    f"this server serves '{self.name}'", param="model")
            return JSONResponse(self._card())
        return await self._guarded(request, card)

    async def metrics(self, request: Request) -> Response:
        return await self._guarded(request, lambda: PlainTextResponse(
            prometheus(self.scheduler.metrics(), self.responses), media_type="text/plain; version=0.0.4"))

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return self._count(_error_response(APIError(exc.status_code, message, code=code)))

    def _card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "umakit"}

    async def _guarded(self, request: Request, respond) -> Response:
        try:
            self._authorize(request)
            return self._count(respond())
        except APIError as e:
            return self._count(_error_response(e))
        except Exception as e:  # a bug of ours: still an answer in OpenAI's shape, and a traceback in the log
            log.exception("%s %s failed", request.method, request.url.path)
            return self._count(_error_response(APIError(500, f"internal error ({type(e).__name__}: {e})")))

    def _count(self, response: Response) -> Response:
        self.responses[response.status_code] += 1
        return response

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise APIError(401, "you didn't provide an API key: send 'Authorization: Bearer YOUR_KEY'",
                           headers={"WWW-Authenticate": "Bearer"})
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", headers={"WWW-Authenticate": "Bearer"})

    # -- completions ----------------------------------------------------------------------------------
    async def complete(self, kind: type, request: Request) -> Response:
        out = (_ChatOutput if kind is ChatRequest else _CompletionOutput)(self)
        t0 = time.perf_counter()
        try:
            self._authorize(request)
            req = parse_request(kind, await self._json(request))
            gen = generation_request(req, self.model, id=out.id, timeout_s=self.timeout_s)
            try:
                handle = self.scheduler.submit(gen, asyncio.get_running_loop())
            except QueueFull as e:
                raise APIError(429, str(e), headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from e
            watcher = asyncio.create_task(_watch_disconnect(request, handle))
            events = _events(handle, None if self.timeout_s is None else self.timeout_s + TIMEOUT_GRACE_S)
            try:
                first = await anext(events)  # before any byte is sent, so an early failure keeps its status
            except BaseException:
                watcher.cancel()
                handle.cancel()
                raise
            if req.stream:
                return self._count(StreamingResponse(
                    self._stream(out, first, events, handle, watcher, req.include_usage, t0),
                    media_type="text/event-stream", headers=SSE_HEADERS))
            try:
                response = await self._collect(out, first, events)
            finally:
                watcher.cancel()
            _log(out.id, 200, out.final, t0)
            return self._count(JSONResponse(response.model_dump(mode="json")))
        except APIError as e:
            _log(out.id, e.status, None, t0, e.message)
            return self._count(_error_response(e))
        except _ClientGone:
            _log(out.id, 499, None, t0, "the client went away")
            return Response(status_code=499)
        except Exception as e:  # a bug of ours: still an answer in OpenAI's shape, and a traceback in the log
            log.exception("%s failed", out.id)
            return self._count(_error_response(APIError(500, f"internal error ({type(e).__name__}: {e})")))

    async def _json(self, request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.max_body_bytes:
                raise self._too_large()
        try:
            return json.loads(body)
        except ValueError as e:  # UnicodeDecodeError too
            raise APIError(400, f"the request body is not valid JSON ({e})") from e

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
                             "(umakit serve --max-body-bytes)")

    async def _collect(self, out, first, events):
        tokens = [first]
        async for event in events:
            tokens.append(event)
        final = tokens.pop()
        return out.full(tokens, final)

    async def _stream(self, out, first, events, handle, watcher, include_usage, t0):
        final, status, error = None, 200, None
        try:
            start = out.start()
            if start is not None:
                yield _sse(start)
            event = first
            while True:
                if isinstance(event, TokenEvent):
                    chunk = out.token(event)
                    if chunk is not None:
                        yield _sse(chunk)
                else:
                    final = event
                    break
                event = await anext(events)
            if final.text:
                yield _sse(out.piece(final.text, []))
            yield _sse(out.end(final))
            if include_usage:
                yield _sse(out.usage_chunk(final.usage))
            yield b"data: [DONE]\n\n"
        except APIError as e:  # after the status line went out: the error travels as an event, as OpenAI's does
            status, error = e.status, e.message
            yield f"data: {json.dumps(e.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except _ClientGone:
            status, error = 499, "the client went away"
        finally:
            watcher.cancel()
            if final is None:
                handle.cancel()
                status, error = (499, "the client went away") if status == 200 else (status, error)
            _log(out.id, status, final, t0, error)


class _ClientGone(Exception):
    pass


async def _watch_disconnect(request: Request, handle) -> None:
    """Cancel ``handle`` as soon as the client disconnects (the body has been read: only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
    handle.queue.put_nowait(_GONE)


async def _events(handle, timeout_s: float | None):
    """The request's events up to and including its last one; an `ErrorEvent` raises its `APIError`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            event = await asyncio.wait_for(handle.queue.get(), None if deadline is None
                                           else max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            handle.cancel()
            raise APIError(504, f"no answer from the generation worker within {timeout_s:g} s") from None
        if event is _GONE:
            raise _ClientGone()
        if isinstance(event, ErrorEvent):
            raise APIError(event.status, event.message, code=event.code)
        yield event
        if isinstance(event, FinalEvent):
            return


def _sse(chunk) -> bytes:
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


class _Output:
    """What one request's events become: the chunks of a stream, or one whole response."""

    prefix = ""
    chunk_type: type = Completion

    def __init__(self, server: _Server):
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.name, self.tokenizer = server.name, server.model.tokenizer
        self.created = int(time.time())
        self.final: FinalEvent | None = None

    def _meta(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.name}

    def start(self):
        return None

    def token(self, e: TokenEvent):
        if not e.text and e.logprob is None:
            return None  # text held back while a stop string may still form
        return self.piece(e.text, [] if e.logprob is None else [e])

    def end(self, final: FinalEvent):
        self.final = final
        return self.piece(None, [], final.finish_reason)

    def usage_chunk(self, usage):
        return self.chunk_type(**self._meta(), choices=[], usage=UsageInfo.of(usage))

    def full(self, tokens: list[TokenEvent], final: FinalEvent):
        self.final = final
        text = "".join(e.text for e in tokens) + final.text
        return self.whole(text, [e for e in tokens if e.logprob is not None], final)

    def piece(self, text: str | None, scored: list[TokenEvent], finish: str | None = None):
        raise NotImplementedError

    def whole(self, text: str, scored: list[TokenEvent], final: FinalEvent):
        raise NotImplementedError


class _ChatOutput(_Output):
    prefix, chunk_type = "chatcmpl", ChatCompletionChunk

    def start(self):
        return ChatCompletionChunk(**self._meta(), choices=[ChatChunkChoice(delta=ChatDelta(role="assistant",
                                                                                            content=""))])

    def piece(self, text, scored, finish=None):
        return ChatCompletionChunk(**self._meta(), choices=[ChatChunkChoice(
            delta=ChatDelta(content=text), finish_reason=finish,
            logprobs=chat_logprobs(self.tokenizer, scored) if scored else None)])

    def whole(self, text, scored, final):
        return ChatCompletion(**self._meta(), usage=UsageInfo.of(final.usage), choices=[ChatChoice(
            message=ChatMessageOut(content=text), finish_reason=final.finish_reason,
            logprobs=chat_logprobs(self.tokenizer, scored) if scored else None)])


class _CompletionOutput(_Output):
    prefix, chunk_type = "cmpl", Completion

    def __init__(self, server: _Server):
        super().__init__(server)
        self.sent = 0  # characters streamed so far: the logprobs' text_offset

    def piece(self, text, scored, finish=None):
        logprobs = completion_logprobs(self.tokenizer, scored, self.sent) if scored else None
        self.sent += len(text or "")
        return Completion(**self._meta(), choices=[CompletionChoice(text=text or "", logprobs=logprobs,
                                                                    finish_reason=finish)])

    def whole(self, text, scored, final):
        return Completion(**self._meta(), usage=UsageInfo.of(final.usage), choices=[CompletionChoice(
            text=text, finish_reason=final.finish_reason,
            logprobs=completion_logprobs(self.tokenizer, scored) if scored else None)])


def _log(rid: str, status: int, final: FinalEvent | None, t0: float, error: str | None = None) -> None:
    """The request's one line in the server log."""
    elapsed = time.perf_counter() - t0
    if final is None:
        log.log(logging.WARNING if status >= 500 else logging.INFO, "%s %d %.2fs %s", rid, status, elapsed, error)
        return
    u = final.usage
    log.info("%s %d %s prompt=%d cached=%d completion=%d ttft=%.3fs %.1f tok/s rows=%.1f %.2fs", rid, status,
             final.finish_reason, u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.ttft_s, u.decode_tps,
             u.batch_rows, elapsed)


def prometheus(metrics: dict[str, float], responses: Counter) -> str:
    """Prometheus text format: the scheduler's figures and the HTTP responses by status, named ``umakit_*``."""
    lines = []
    for name, value in metrics.items():
        full = f"umakit_{name}"
        lines += [f"# HELP {full} {METRIC_HELP.get(name, name.replace('_', ' ') + '.')}",
                  f"# TYPE {full} {'counter' if name.endswith('_total') else 'gauge'}",
                  f"{full} {_number(value)}"]
    lines += ["# HELP umakit_http_responses_total HTTP responses sent, by status.",
              "# TYPE umakit_http_responses_total counter"]
    lines += [f'umakit_http_responses_total{{status="{s}"}} {n}' for s, n in sorted(responses.items())]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() else repr(value)
