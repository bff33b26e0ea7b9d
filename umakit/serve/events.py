"""A submitted request's events as the HTTP layer reads them: the scheduler's refusals and errors as the API's,
and a client that goes away as `ClientGone` (its request cancelled at once)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from umakit.serve.api_errors import APIError
from umakit.serve.jobs import NeverFits, QueueFull
from umakit.serve.types import ErrorEvent, FinalEvent

GONE = object()  # put on a request's queue when its client disconnects


class ClientGone(Exception):
    """The client went away (a 499 in the log; nothing is sent)."""


async def watch_disconnect(request, handle) -> None:
    """Cancel ``handle`` as soon as the client disconnects (the body has been read: only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
    handle.queue.put_nowait(GONE)


@contextlib.contextmanager
def scheduler_refusals():
    """A scheduler's refusals as the API's errors: a full queue is a 429 with its Retry-After, a request whose KV
    cache can never fit a 400."""
    try:
        yield
    except QueueFull as e:
        raise APIError(429, str(e), headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}) from e
    except NeverFits as e:
        raise APIError(400, str(e), param="max_tokens", code="kv_cache_exceeded") from e


async def request_events(handle, timeout_s: float | None):
    """The request's events up to and including its last one; an `ErrorEvent` raises its `APIError`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            event = await asyncio.wait_for(handle.get(), None if deadline is None
                                           else max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            handle.cancel()
            raise APIError(504, f"no answer from the generation worker within {timeout_s:g} s") from None
        if event is GONE:
            raise ClientGone()
        if isinstance(event, ErrorEvent):
            raise APIError(event.status, event.message, code=event.code)
        yield event
        if isinstance(event, FinalEvent):
            return
