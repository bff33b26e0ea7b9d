"""OpenAI's batch files run offline: each line's request through the server's own readers and scheduler.

A line of OpenAI's Batch API input (what vLLM's ``run_batch`` also takes) is
``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}``. Its body is read exactly as
``umakit serve`` reads that route's request (every field it implements, every refusal by name), submitted to a
`Scheduler` that batches the lines' rows, and answered with the body the server would send. Each answer is one
line of OpenAI's batch output: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``;
a request the server would refuse gets its status and error body there, as OpenAI's error file has it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from umakit.serve.api_errors import APIError
from umakit.serve.choices import submit
from umakit.serve.app import OPENAI_CHAT, OPENAI_COMPLETIONS, OPENAI_RESPONSES, API
from umakit.serve.events import request_events, scheduler_refusals
from umakit.serve.outputs import request_id

ROUTES = {"/v1/chat/completions": OPENAI_CHAT, "/v1/completions": OPENAI_COMPLETIONS,
          "/v1/responses": OPENAI_RESPONSES}
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict


def is_request_line(obj) -> bool:
    """Whether a decoded input line is OpenAI's batch request (it names itself by ``custom_id``)."""
    return isinstance(obj, dict) and "custom_id" in obj


def parse(n: int, obj) -> BatchLine:
    """Line ``n`` (decoded JSON) as a request; `ValueError` naming what is wrong with its envelope. The body is
    read later, as the server reads it, so that its errors are the server's."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - LINE_KEYS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; a batch request line has custom_id, method, url "
                         "and body")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("'custom_id' must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method {obj.get('method')!r}: batch requests are POSTs")
    url = obj.get("url")
    if url not in ROUTES:
        raise ValueError(f"url {url!r} is not one umakit runs in a batch; it runs {', '.join(ROUTES)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object (the request)")
    if body.get("stream"):
        raise ValueError("'body.stream' is true: a batch answers each request whole")
    return BatchLine(n, custom_id, url, body)


def record(custom_id: str, rid: str, status: int, body: dict) -> dict:
    """One line of OpenAI's batch output."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": rid, "body": body}, "error": None}


def envelope_error(custom_id: str | None, message: str) -> dict:
    """A line whose envelope could not be read: no response, an error (as OpenAI's error file gives it)."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


def usage_tokens(body: dict) -> int:
    """The completion tokens an answer's body counts (0 where it has none)."""
    usage = body.get("usage") or {}
    return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)


async def run(model, scheduler, lines: Iterable[BatchLine], done: Callable[[BatchLine, dict], None],
              in_flight: int) -> None:
    """Answer every line through ``scheduler`` (started), at most ``in_flight`` submitted at once; ``done`` gets
    each line and its output record as it finishes, in the order they finish."""
    gate = asyncio.Semaphore(in_flight)

    async def one(line: BatchLine) -> None:
        async with gate:
            api = ROUTES[line.url]
            rid = request_id(api.prefix)
            try:
                body, status = await _answer(model, scheduler, api, line, rid), 200
            except APIError as e:
                body, status = api.error_body(e), e.status
            except Exception as e:  # a bug of ours: this line's 500, as the server answers one; the rest still run
                failure = APIError(500, f"internal error: {type(e).__name__}: {e}")
                body, status = api.error_body(failure), failure.status
            done(line, record(line.custom_id, rid, status, body))

    await asyncio.gather(*(one(line) for line in lines))


async def _answer(model, scheduler, api: API, line: BatchLine, rid: str) -> dict:
    name = line.body.get("model")
    if name != model.info.name:
        raise APIError(404 if isinstance(name, str) else 400,
                       f"the model {json.dumps(name)} is not the one this batch runs; name it '{model.info.name}'",
                       param="model")
    sub = await asyncio.to_thread(api.read, model, line.body, rid, None)
    sub.output.name = name
    with scheduler_refusals():
        handle = submit(scheduler, sub.request, asyncio.get_running_loop())
    events = [event async for event in request_events(handle, None)]  # an error event raises its APIError
    return sub.output.full(events[:-1], events[-1])


def read(path) -> tuple[list[BatchLine], list[tuple[int, str | None, str]]]:
    """Every request line of the file at ``path`` and every line that is not one, as (line, custom_id or None,
    why); blank lines are skipped. A custom_id on two lines is an `InvalidArgumentError` for the whole file, as
    OpenAI's batches refuse it: which answer is whose would be ambiguous, and resuming would skip the second."""
    from umakit.errors import InvalidArgumentError

    lines, errors, seen = [], [], {}
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                obj = None
                try:
                    obj = json.loads(raw.decode("utf-8"))
                    lines.append(parse(n, obj))
                    seen.setdefault(lines[-1].custom_id, []).append(n)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    errors.append((n, None, f"not a JSON line: {e}"))
                except ValueError as e:
                    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
                    errors.append((n, custom_id if isinstance(custom_id, str) else None, str(e)))
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror or e}") from e
    twice = [(k, v) for k, v in seen.items() if len(v) > 1]
    if twice:
        k, v = twice[0]
        raise InvalidArgumentError(f"{path}: custom_id {json.dumps(k)} appears on lines {', '.join(map(str, v))}; "
                                   "custom_ids must be unique")
    return lines, errors


def first_line(path) -> object:
    """The first non-blank line of the file at ``path``, decoded (None where it is not JSON or cannot be read)."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    return json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return None
