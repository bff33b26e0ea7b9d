"""The deadlines of a connection that uvicorn's HTTP/1.1 protocol does not keep (`protocol`).

uvicorn closes a connection idle between requests (``timeout_keep_alive``) but waits for ever on two things:
a request's headers that arrive a byte at a time (or never, on a connection opened and left), and a client that
stops reading a reply (its socket's buffers fill, and the reply's next send waits on the transport). Either
holds a connection, and one of ``--max-concurrency + --max-queue + 64`` places, for as long as the client likes.
Here the headers have ``header_timeout_s`` from their first byte (or from the connection's opening) and get a
408; a send that cannot go out for ``send_timeout_s`` aborts the connection, which the handler sees as the
client leaving (its request is cancelled, and logged as a 499). The request body's own deadline is the app's
(``body_timeout_s``, app.py), where a 408 in the API's shape can still be sent.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from umakit.serve import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_SEND_TIMEOUT_S

log = logging.getLogger("umakit.serve")


def protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
             send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with these deadlines, for ``uvicorn.Config(http=...)``."""
    return type("DeadlineProtocol", (DeadlineProtocol,),
                {"header_timeout_s": header_timeout_s, "send_timeout_s": send_timeout_s})


class _DeadlineFlow(FlowControl):
    """uvicorn's write flow control, with a bound on how long a send waits for the client to read."""

    def __init__(self, transport: asyncio.Transport, timeout_s: float, stalled):
        super().__init__(transport)
        self.timeout_s, self._stalled = timeout_s, stalled

    async def drain(self) -> None:
        try:
            await asyncio.wait_for(self._is_writable_event.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            self._stalled()


class DeadlineProtocol(H11Protocol):
    """See the module's docstring; `protocol` sets the two deadlines."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    send_timeout_s = DEFAULT_SEND_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _DeadlineFlow(transport, self.send_timeout_s, self._stalled)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests() and self._header_timer is None:  # a next request's first bytes
            self._arm()
        super().data_received(data)
        if not self._between_requests():  # its headers are in: the app's deadlines take over
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return
        started = bool(self.conn.trailing_data[0])  # a request's first bytes, its headers unfinished
        if started:
            body = f"the request's headers did not arrive within {self.header_timeout_s:g} s\n".encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            log.info("- 408 %s: a request's headers did not arrive within %g s", self._peer(), self.header_timeout_s)
        self.transport.close()

    def _stalled(self) -> None:
        """A reply's client has read nothing for ``send_timeout_s``: drop the connection and what it buffered."""
        log.info("- %s stopped reading its reply for %g s: connection dropped", self._peer(), self.send_timeout_s)
        self.transport.abort()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"
