"""Messages from rank 0 to every rank, whatever collective carries them: framing, the watchdog, a lost peer.

A subclass supplies `_bcast` (rank 0's bytes on every rank) and `gather_equal`
with its framework's collectives (channel.py: MLX; torch_channel.py: torch).
"""

from __future__ import annotations

import contextlib
import json
from contextlib import contextmanager

from umakit.backends.distributed import COLLECTIVE_TIMEOUT_S, DistributedError
from umakit.backends.distributed.watchdog import Watchdog, lost, lost_message

HEADER = 256  # bytes of the first collective: the length, then a short message whole (most are)


class MessageChannel:
    """Messages from rank 0 to every rank, each a JSON-able dict."""

    def __init__(self, rank: int, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        self.rank, self.size = rank, size
        self.watchdog = Watchdog(rank, size, timeout_s)
        self.broken = False  # a peer was lost: nothing more is sent
        self.comm_s = 0.0  # seconds spent in this channel's collectives

    @contextmanager
    def guarded(self, what: str | None = None):
        """Run model work whose collectives may meet a lost peer; ``what``: bound its wait by the watchdog."""
        try:
            with self.watchdog.armed(what) if what else contextlib.nullcontext():
                yield
        except RuntimeError as e:
            if not lost(e):
                raise
            self.broken = True
            raise DistributedError(lost_message(self.rank, self.size, str(e))) from e

    def _bcast(self, data: bytes | None, n: int, what: str, bounded: bool) -> bytes:
        raise NotImplementedError

    def gather_equal(self, digest: bytes, what: str) -> list[int]:
        """The ranks whose ``digest`` differs from rank 0's (every rank gets the same answer)."""
        raise NotImplementedError

    def send(self, message: dict) -> None:
        """Rank 0: give every rank ``message``."""
        assert self.rank == 0
        if self.broken:
            raise DistributedError(lost_message(self.rank, self.size, "an earlier collective failed"))
        body = json.dumps(message, separators=(",", ":")).encode()
        head = len(body).to_bytes(4, "little") + body[:HEADER - 4]
        self._bcast(head.ljust(HEADER, b"\0"), HEADER, message.get("op", "?"), True)
        if len(body) > HEADER - 4:
            self._bcast(body[HEADER - 4:], len(body) - (HEADER - 4), message.get("op", "?"), True)

    def receive(self, bounded: bool = True) -> dict:
        """Another rank: the next message rank 0 sends (``bounded=False``: however long rank 0 stays idle)."""
        head = self._bcast(None, HEADER, "rank 0's next message", bounded)
        n = int.from_bytes(head[:4], "little")
        body = head[4:4 + n]
        if n > HEADER - 4:
            body += self._bcast(None, n - (HEADER - 4), "rank 0's message", True)
        return json.loads(body)
