"""A request that asks for several choices (OpenAI's ``n``, or a completion's list of prompts): one scheduler request
a choice, run side by side as rows of the same steps, and answered as one body.

The HTTP layer drives a request the same way whatever its choices: `submit` gives it one handle, whose events end
with one `FinalEvent`, and one `Output`. For several choices that handle is a `ChoiceGroup`: the members' events
reach one queue, each tagged with its choice (`Tagged`), and the group's last event sums their usage; its output,
`ChoicesOutput`, hands each member's events to that member's own output, each choice at its index: their bodies
joined, or their streams' chunks as they come (OpenAI's: each chunk's choice names its index), then one usage.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from umakit.serve.api_errors import APIError
from umakit.serve.openai_shapes import UsageInfo
from umakit.serve.outputs import DONE, Output
from umakit.serve.types import ErrorEvent, FinalEvent, GenerationRequest, Usage


@dataclass(frozen=True)
class Tagged:
    """A member's event, with its choice's index."""

    index: int
    event: object


class _Tagging:
    """A member's event queue: its events, tagged, into the group's queue."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self._queue, self._index = queue, index

    def put_nowait(self, event) -> None:
        self._queue.put_nowait(Tagged(self._index, event))


class ChoiceGroup:
    """The handles of a request's choices, as one handle: `get` returns their events as they come (`Tagged`), an
    error at once (and the others cancelled), and after the last member's end one `FinalEvent` of them all."""

    def __init__(self, scheduler, requests, loop: asyncio.AbstractEventLoop, firsts: frozenset[int]):
        self.queue: asyncio.Queue = asyncio.Queue()  # a client's disconnect is put here, untagged
        self.firsts = firsts  # the members that count their prompt in the usage (the first choice of each prompt)
        self.handles, self.finals, self._end = [], {}, None
        try:
            for i, request in enumerate(requests):
                self.handles.append(scheduler.submit(request, loop, _Tagging(self.queue, i)))
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    async def get(self):
        if self._end is not None:
            return self._end
        while True:
            item = await self.queue.get()
            if not isinstance(item, Tagged):
                return item  # the client went away
            self.handles[item.index].taken()
            if isinstance(item.event, ErrorEvent):
                self.cancel()
                return item.event
            if isinstance(item.event, FinalEvent):
                self.finals[item.index] = item.event
                if len(self.finals) == len(self.handles):
                    self._end = self._final()  # after the last member's end, the group's
            return item

    def _final(self) -> FinalEvent:
        usages = [self.finals[i].usage for i in range(len(self.handles))]
        counted = [u for i, u in enumerate(usages) if i in self.firsts]
        usage = Usage(prompt_tokens=sum(u.prompt_tokens for u in counted),
                      completion_tokens=sum(u.completion_tokens for u in usages),
                      cached_tokens=sum(u.cached_tokens for u in counted),
                      ttft_s=max(u.ttft_s for u in usages), decode_tps=sum(u.decode_tps for u in usages),
                      achieved_gbps=max(u.achieved_gbps for u in usages), peak_gbps=usages[0].peak_gbps,
                      mbu=max(u.mbu for u in usages), batch_rows=max(u.batch_rows for u in usages))
        reasons = {f.finish_reason for f in self.finals.values()}
        return FinalEvent("length" if "length" in reasons else "stop", usage)


class ChoicesOutput(Output):
    """The body of a request's choices: each member's own output's, joined."""

    def __init__(self, outputs: list[Output]):
        self.outputs = outputs
        for i, out in enumerate(outputs):
            out.index = i
        super().__init__(outputs[0].id, outputs[0].name, outputs[0].tokenizer)

    @property
    def name(self) -> str:
        return self.outputs[0].name

    @name.setter
    def name(self, name: str) -> None:  # the model as the request named it, in every choice's body
        for out in self.outputs:
            out.name = name

    def start(self) -> list[bytes]:
        return [data for out in self.outputs for data in out.start()]

    def token(self, item: Tagged) -> list[bytes]:
        out = self.outputs[item.index]
        if isinstance(item.event, FinalEvent):  # that choice's last chunks, without the stream's end
            return [data for data in out.end(item.event, include_usage=False) if data != DONE]
        return out.token(item.event)

    def end(self, final: FinalEvent, include_usage: bool) -> list[bytes]:
        self.final = final
        return ([self.outputs[0].usage_chunk(final)] if include_usage else []) + [DONE]

    def full(self, tokens: list, final: FinalEvent) -> dict:
        self.final = final
        events: list[list] = [[] for _ in self.outputs]
        finals: dict[int, FinalEvent] = {}
        for item in tokens:
            if isinstance(item.event, FinalEvent):
                finals[item.index] = item.event
            else:
                events[item.index].append(item.event)
        bodies = [out.full(events[i], finals[i]) for i, out in enumerate(self.outputs)]
        body = dict(bodies[0], usage=UsageInfo.of(final.usage).model_dump(mode="json"))
        body["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
        return body


def submit(scheduler, request, loop: asyncio.AbstractEventLoop):
    """``request`` (one `GenerationRequest`, or a `Choices`) submitted: its handle."""
    if isinstance(request, Choices):
        if len(request.requests) > scheduler.settings.max_queue:  # they would never all be queued at once
            raise APIError(400, f"{len(request.requests)} choices are more than this server queues at once "
                                f"({scheduler.settings.max_queue}: umakit serve --max-queue)", param="n")
        return ChoiceGroup(scheduler, request.requests, loop, request.firsts)
    return scheduler.submit(request, loop)


class Choices:
    """A request's choices, as the scheduler's requests: ``firsts`` the first choice of each prompt."""

    def __init__(self, requests: list[GenerationRequest], firsts: frozenset[int]):
        self.requests, self.firsts = requests, firsts

    @property
    def cache_salt(self) -> str:
        return self.requests[0].cache_salt

    @cache_salt.setter
    def cache_salt(self, salt: str) -> None:  # the caller's namespace in the prompt cache, for every choice
        for r in self.requests:
            r.cache_salt = salt
