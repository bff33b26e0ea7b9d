"""A request as the scheduler's worker holds it (`Job`), and as its HTTP handler sees it (`Handle`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from umakit.errors import UmakitError
from umakit.generate.scoring import token_scores
from umakit.generate.stream import DecodeRow
from umakit.serve.prompt_cache import common_prefix
from umakit.serve.types import ErrorEvent, GenerationRequest, TokenEvent


class QueueFull(UmakitError):
    """Too many requests waiting; try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NeverFits(UmakitError):
    """A request whose KV cache alone is more than this machine can give a row: refused, never queued."""


def kv_tokens(request: GenerationRequest) -> int:
    """Cache positions a request's row may take: its prompt and its longest reply."""
    return len(request.prompt) + request.max_tokens


def too_big(request: GenerationRequest, kv_bytes: int, budget: int) -> str:
    tokens = kv_tokens(request)
    return (f"the request needs {tokens} tokens of KV cache ({(tokens * kv_bytes) >> 20} MiB), more than the "
            f"{budget >> 20} MiB this machine can give it; ask for fewer max_tokens")


class Handle:
    """A submitted request as its HTTP handler sees it: a queue of events, and a way to give up.

    The queue is bounded: a handler that falls ``MAX_PENDING`` events behind (its client reads the stream more
    slowly than the model writes it) gets a 408 as its last event, and the worker drops the request. A client
    that stops reading altogether is cut off sooner, by the connection's send deadline (connections.py)."""

    MAX_PENDING = 4096  # events handed over and not yet taken: a few hundred KB

    def __init__(self, id: str, loop: asyncio.AbstractEventLoop, wake, queue=None):
        self.id = id
        self.queue = asyncio.Queue() if queue is None else queue  # or anything with put_nowait (choices.py's)
        self._loop = loop
        self._wake = wake
        self.cancelled = False
        self._handed = 0  # events put (the worker's count)
        self._taken = 0  # events got (the loop's count)

    def cancel(self) -> None:
        """The client went away: the worker drops the request at its next step."""
        self.cancelled = True
        self._wake()

    async def get(self):
        """The next event, on the request's loop."""
        event = await self.queue.get()
        self.taken()
        return event

    def taken(self) -> None:
        """One event was taken off the queue (by `get`, or by whatever reads the queue given for it)."""
        self._taken += 1

    def put(self, event) -> None:
        """From the worker thread: hand ``event`` to the request's event loop."""
        if self._handed - self._taken >= self.MAX_PENDING:
            if not self.cancelled:  # the one event past the bound: why it ends
                self._hand(ErrorEvent(f"the client read its reply too slowly ({self.MAX_PENDING} events waited "
                                      "unread): the request was stopped", status=408, code="client_too_slow"))
                self.cancel()
            return
        self._hand(event)

    def _hand(self, event) -> None:
        self._handed += 1
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True


@dataclass
class Job:
    """One request inside the worker."""

    handle: Handle
    request: GenerationRequest
    submitted: float
    row: DecodeRow | None = None
    cache: object = None  # its own cache while prefilling; None once it is a row of the batch
    prefilled: int = 0  # prompt tokens in ``cache``
    cached_tokens: int = 0  # of those, found in the prompt cache
    generated: list[int] = field(default_factory=list)  # every token returned, end-of-sequence included
    start: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)  # (time, bytes read, steps, rows summed) when it joined
    scores: list[TokenEvent] | None = None  # with prompt_logprobs: the prompt's tokens scored so far

    def __post_init__(self):
        if self.request.prompt_logprobs is not None:  # the first token is scored by nothing (OpenAI's null)
            self.scores = [TokenEvent("", self.request.prompt[0])]

    def start_from(self, decoder, rows: list[tuple[int, list[int]]], least: int) -> None:
        """Take the cache of the batch's row (of ``rows``: id, prompt) whose prompt shares the most of this one's,
        trimmed to what they share, where that is at least ``least`` tokens and more than this job holds."""
        prompt = self.request.prompt
        best, shared = None, max(self.prefilled, least - 1)
        for i, other in rows:
            n = min(common_prefix(other, prompt), len(prompt) - 1)
            if n > shared:
                best, shared = i, n
        if best is None:
            return
        cache = decoder.export(best)
        shared = min(shared, cache.offset)
        if not cache.trimmable or shared <= self.prefilled:
            return
        cache.trim(cache.offset - shared)
        self.cache, self.prefilled, self.cached_tokens = cache, shared, shared
        self.row.prompt_tokens, self.row.cached_tokens = len(prompt) - shared, shared

    def prefill(self, engine, end: int) -> None:
        """Run the prompt's tokens up to ``end`` into the job's cache: by the engine's prefill or, to score them,
        by a pass with the head (`Engine.logits`, which fills the cache the same way)."""
        prompt = self.request.prompt
        if self.scores is None:
            engine.prefill(prompt[self.prefilled:end], self.cache)
        else:
            targets = prompt[self.prefilled + 1:end + 1]
            scored = token_scores(engine.logits(prompt[self.prefilled:end], self.cache), targets,
                                  self.request.prompt_logprobs)
            self.scores += [TokenEvent("", t, lp, top) for t, (lp, top) in zip(targets, scored)]
        self.prefilled = end

    @property
    def deadline(self) -> float | None:
        t = self.request.timeout_s
        return None if t is None else self.submitted + t
