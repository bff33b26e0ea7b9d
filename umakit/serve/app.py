"""The HTTP app: OpenAI's routes on Starlette, talking to the scheduler only through `submit` and event queues.

`make_app` builds it. A completion request is read (bounded in bytes),
validated into a `GenerationRequest` (protocol.py), submitted, and its events
become one JSON response or a stream of server-sent events. A client that goes
away is cancelled at once, so its row leaves the batch at the next step. Every
error, whatever raised it, is answered by `_error_response` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from datetime import datetime, timezone
from functools import partial

from dataclasses import dataclass
from typing import Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from umakit.serve import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, anthropic, openai_responses, tokenizer_routes
from umakit.serve.outputs import ChatOutput, CompletionOutput, Output, Submission, request_id
from umakit.serve.api_errors import APIError, internal
from umakit.serve.choices import Choices, ChoicesOutput, submit
from umakit.serve.generation import openai_choices
from umakit.serve.protocol import ChatRequest, CompletionRequest, parse_request
from umakit.errors import UmakitError
from umakit.serve.host import OneModel, parse_keep_alive
from umakit.serve.metrics import prometheus
from umakit.serve.guard import HostGuard, Keys, parse_json
from umakit.serve.events import ClientGone, request_events, scheduler_refusals, watch_disconnect
from umakit.serve.types import FinalEvent, SchedulerSettings

log = logging.getLogger("umakit.serve")

TIMEOUT_GRACE_S = 5.0  # the scheduler times requests out itself; this bounds the wait if it cannot
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class API:
    """One API's routes' ways: its request reader and its error body."""

    prefix: str  # of request ids
    read: Callable  # (model, decoded JSON, request id, timeout_s) -> Submission
    error_body: Callable[[APIError], dict] = APIError.body


def _openai(kind: type, output: type) -> Callable:
    def read(model, data, rid: str, timeout_s: float | None) -> Submission:
        req = parse_request(kind, data)
        made = openai_choices(req, model, id=rid, timeout_s=timeout_s)
        outs = [output(rid, model.info.name, model.tokenizer, c.prepared.parser() if c.prepared else None, c.echo)
                for c in made]
        if len(made) == 1:
            return Submission(made[0].request, outs[0], bool(req.stream), req.include_usage)
        firsts = frozenset(i for i, c in enumerate(made) if c.first)
        return Submission(Choices([c.request for c in made], firsts), ChoicesOutput(outs), bool(req.stream),
                          req.include_usage)
    return read


OPENAI_CHAT = API("chatcmpl", _openai(ChatRequest, ChatOutput))
OPENAI_COMPLETIONS = API("cmpl", _openai(CompletionRequest, CompletionOutput))
ANTHROPIC_MESSAGES = API("msg", anthropic.read, anthropic.error_body)
OPENAI_RESPONSES = API("resp", openai_responses.read)


def make_app(model, scheduler=None, *, api_key: str | Sequence[str] | None = None,
             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             request_timeout_s: float | None = SchedulerSettings.request_timeout_s,
             allowed_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = (),
             body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> Starlette:
    """The app serving ``model`` through ``scheduler`` (started and stopped by the caller), or, without a
    scheduler, the models of a `umakit.serve.host.ModelHost` by name: OpenAI's chat completions, completions
    and responses, Anthropic's messages, and the tokenizer's routes (vLLM's /tokenize and friends).

    With ``api_key`` (one key, or several) every route but /health needs ``Authorization: Bearer KEY`` (or
    Anthropic's ``x-api-key: KEY``), and each key's requests share the prompt cache only among themselves. ``allowed_origins`` (``"*"`` for any) may call it from a browser page:
    CORS preflights are answered for them, and for no origin by default. A request whose Host header is not a
    localhost name, an IP address or one of ``allowed_hosts`` (``"*"``: any) is refused (`umakit.serve.guard`).
    """
    models = OneModel(model, scheduler) if scheduler is not None else model
    server = _Server(models, api_key, max_body_bytes, request_timeout_s, body_timeout_s)
    routes = [
        Route("/v1/chat/completions", server.endpoint(OPENAI_CHAT), methods=["POST"]),
        Route("/v1/completions", server.endpoint(OPENAI_COMPLETIONS), methods=["POST"]),
        Route("/v1/messages", server.endpoint(ANTHROPIC_MESSAGES), methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
        Route("/v1/responses", server.endpoint(OPENAI_RESPONSES), methods=["POST"]),
        Route("/v1/models", server.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model_card, methods=["GET"]),
        Route("/tokenize", partial(server.tool, work=tokenizer_routes.tokenize), methods=["POST"]),
        Route("/detokenize", partial(server.tool, work=tokenizer_routes.detokenize), methods=["POST"]),
        Route("/tokenizer_info", partial(server.tool, work=tokenizer_routes.tokenizer_info), methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(HostGuard, allowed=allowed_hosts)]
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["*"], max_age=600))
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: server.http_error})


def _error_response(err: APIError, api: API = OPENAI_CHAT) -> JSONResponse:
    return JSONResponse(api.error_body(err), status_code=err.status, headers=err.headers)


class _Server:
    def __init__(self, models, api_key, max_body_bytes, request_timeout_s, body_timeout_s):
        self.models = models  # OneModel or ModelHost (host.py)
        self.body_timeout_s = body_timeout_s
        self.keys, self.max_body_bytes, self.timeout_s = Keys(api_key), max_body_bytes, request_timeout_s
        self.created = int(time.time())
        self.responses: Counter[int] = Counter()  # HTTP status -> responses sent

    # -- plain routes -----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ok = self.models.healthy  # "server": what a CLI looks for before it attaches (umakit/cli/attach.py)
        status = "ok" if ok else "loading" if self.models.loading else "unhealthy"
        return self._count(JSONResponse({"status": status, "server": "umakit"},
                                        status_code=200 if ok else 503))

    async def list_models(self, request: Request) -> Response:
        cards = await asyncio.to_thread(self.models.cards)  # may list the disks' models: off the event loop
        return await self._guarded(request, lambda: JSONResponse(
            {"object": "list", "data": [self._card(c) for c in cards]}))

    async def model_card(self, request: Request) -> Response:
        cards = await asyncio.to_thread(self.models.cards)

        def card():
            wanted = request.path_params["model_id"]
            for c in cards:
                if c["id"] == wanted:
                    return JSONResponse(self._card(c))
            raise APIError(404, f"the model '{wanted}' is not loaded or known here", param="model")
        return await self._guarded(request, card)

    async def metrics(self, request: Request) -> Response:
        def text():
            totals, per_model = self.models.metrics()
            return PlainTextResponse(prometheus(totals, self.responses, per_model),
                                     media_type="text/plain; version=0.0.4")
        return await self._guarded(request, text)

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return self._count(_error_response(APIError(exc.status_code, message, code=code)))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token count of a Messages request (Claude Code asks before it sends)."""
        try:
            self._authorize(request)
            data = await self._json(request)
            lease = await self.models.acquire(_model_name(data), self.timeout_s)
            try:
                return self._count(JSONResponse(await asyncio.to_thread(anthropic.count_tokens, lease.model, data)))
            finally:
                self.models.release(lease)
        except APIError as e:
            return self._count(_error_response(e, ANTHROPIC_MESSAGES))
        except ClientGone:
            return Response(status_code=499)

    async def tool(self, request: Request, work) -> Response:
        """A route answered from the model's tokenizer (tokenizer_routes.py): ``work(model, data)`` on a thread, with
        the request's JSON (a GET's query), for the model it names, or else the one this server serves or knows."""
        try:
            self._authorize(request)
            data = await self._json(request) if request.method == "POST" else dict(request.query_params)
            if not isinstance(data, dict):
                raise APIError(400, "the request body must be a JSON object")
            name = data.get("model")
            if name is None and len(cards := await asyncio.to_thread(self.models.cards)) == 1:
                name = cards[0]["id"]  # the one model served, or the only one a host knows
            if not isinstance(name, str):
                raise APIError(400, "name the model ('model'): this server serves several", param="model")
            lease = await self.models.acquire(name, self.timeout_s)
            try:
                return self._count(JSONResponse(await asyncio.to_thread(work, lease.model, data)))
            finally:
                self.models.release(lease)
        except APIError as e:
            return self._count(_error_response(e))
        except ClientGone:
            return Response(status_code=499)

    def _card(self, card: dict) -> dict:
        """A model as OpenAI's list describes it, and Anthropic's (``type``, ``display_name``, ``created_at``),
        with whether it is loaded now."""
        created = datetime.fromtimestamp(self.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"id": card["id"], "object": "model", "created": self.created, "owned_by": "umakit", "type": "model",
                "display_name": card["id"], "created_at": created, **{k: v for k, v in card.items() if k != "id"}}

    async def _guarded(self, request: Request, respond) -> Response:
        try:
            self._authorize(request)
            return self._count(respond())
        except APIError as e:
            return self._count(_error_response(e))
        except Exception as e:  # a bug of ours: still an answer in OpenAI's shape, and a traceback in the log
            log.exception("%s %s failed", request.method, request.url.path)
            return self._count(_error_response(APIError(500, internal(e))))

    def _count(self, response: Response) -> Response:
        self.responses[response.status_code] += 1
        return response

    def _authorize(self, request: Request) -> str:
        """The namespace of the request's key in the prompt cache, or a 401 (guard.py `Keys`)."""
        return self.keys.check(request.headers)

    # -- completions ----------------------------------------------------------------------------------
    def endpoint(self, api: API):
        async def serve(request: Request) -> Response:
            return await self.complete(api, request)
        return serve

    async def complete(self, api: API, request: Request) -> Response:
        rid, t0 = request_id(api.prefix), time.perf_counter()
        lease, keep_alive = None, None
        try:
            namespace = self._authorize(request)
            data = await self._json(request)
            name = _model_name(data)
            keep_alive = _keep_alive(data.pop("keep_alive", None))
            lease = await self.models.acquire(name, self.timeout_s)
            with scheduler_refusals():
                lease.scheduler.check_room()  # before any work for the request
                # rendering the template, tokenizing and checking take milliseconds to seconds (a long
                # conversation): on a thread, so the streams in flight on this loop never wait for them
                sub = await asyncio.to_thread(api.read, lease.model, data, rid, self.timeout_s)
                sub.output.name = name  # the model as the request named it
                if namespace:  # each key's prompts apart from the others' (guard.py `Keys`)
                    sub.request.cache_salt = f"{namespace}/{sub.request.cache_salt}"
                handle = submit(lease.scheduler, sub.request, asyncio.get_running_loop())
            watcher = asyncio.create_task(watch_disconnect(request, handle))
            events = request_events(handle, None if self.timeout_s is None else self.timeout_s + TIMEOUT_GRACE_S)
            try:
                first = await anext(events)  # before any byte is sent, so an early failure keeps its status
            except BaseException:
                watcher.cancel()
                handle.cancel()
                raise
            if sub.stream:
                held, lease = lease, None  # the stream gives it back when it ends
                return self._count(StreamingResponse(
                    self._stream(api, sub, first, events, handle, watcher, t0, held, keep_alive),
                    media_type="text/event-stream", headers=SSE_HEADERS))
            try:
                body = await self._collect(sub.output, first, events)
            finally:
                watcher.cancel()
            _log(rid, 200, sub.output.final, t0)
            return self._count(JSONResponse(body))
        except APIError as e:
            _log(rid, e.status, None, t0, e.message)
            return self._count(_error_response(e, api))
        except ClientGone:
            _log(rid, 499, None, t0, "the client went away")
            return Response(status_code=499)
        except Exception as e:  # a bug of ours: still an answer in the API's shape, and a traceback in the log
            log.exception("%s failed", rid)
            return self._count(_error_response(APIError(500, internal(e, rid)), api))
        finally:
            if lease is not None:
                self.models.release(lease, keep_alive)

    async def _json(self, request: Request):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):  # a page's form or text/plain POST: unread
            raise APIError(415, f"send the request body as JSON with 'Content-Type: application/json' (this one "
                                f"says {kind or 'nothing'!r})")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        pieces = request.stream()
        try:
            while True:
                try:  # a body that stalls (a slow client, or one that never sends the rest) holds no connection
                    piece = await asyncio.wait_for(anext(pieces), self.body_timeout_s)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise APIError(408, f"the request body stopped arriving for {self.body_timeout_s:g} s "
                                        "(umakit serve --body-timeout)") from None
                body += piece
                if len(body) > self.max_body_bytes:
                    raise self._too_large()
        except ClientDisconnect:
            raise ClientGone() from None  # an upload cut off: 499, not a failure of ours
        return await asyncio.to_thread(parse_json, bytes(body))  # megabytes of JSON: not on the event loop

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
                             "(umakit serve --max-body-bytes)")

    async def _collect(self, out: Output, first, events) -> dict:
        tokens = [first]
        async for event in events:
            tokens.append(event)
        final = tokens.pop()
        return out.full(tokens, final)

    async def _stream(self, api: API, sub: Submission, first, events, handle, watcher, t0, lease, keep_alive):
        out, final, status, error = sub.output, None, 200, None
        try:
            for data in out.start():
                yield data
            event = first
            while not isinstance(event, FinalEvent):  # a token, or one of several choices' events (choices.py)
                for data in out.token(event):
                    yield data
                event = await anext(events)
            final = event
            for data in out.end(final, sub.include_usage):
                yield data
        except APIError as e:  # after the status line went out: the error travels as an event, as OpenAI's does
            status, error = e.status, e.message
            for data in out.error(api.error_body(e)):
                yield data
        except ClientGone:
            status, error = 499, "the client went away"
        finally:
            watcher.cancel()
            self.models.release(lease, keep_alive)
            if final is None:
                handle.cancel()
                status, error = (499, "the client went away") if status == 200 else (status, error)
            _log(out.id, status, final, t0, error)


def _model_name(data) -> str:
    """The request's ``model``, before its API reads the rest (it picks the model that reads it)."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    name = data.get("model")
    if name is None:
        raise APIError(400, "you must provide 'model'", param="model")
    if not isinstance(name, str) or not name:
        raise APIError(400, "invalid 'model': a model name is a non-empty string", param="model")
    return name


def _keep_alive(value) -> float | None:
    """A request's ``keep_alive`` (Ollama's): how long its model stays loaded idle afterwards; None: unchanged."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except UmakitError as e:
        raise APIError(400, str(e), param="keep_alive") from e


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
