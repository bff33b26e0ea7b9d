"""Rank 0's messages to the other ranks over mx.distributed collectives.

No socket of our own: a message is an ``all_sum`` in which only rank 0 holds
non-zero bytes, so every rank ends up with rank 0's bytes (a broadcast made of
the one collective every MLX backend offers). A peer whose process died closes
its sockets, which the ring backend reports as an error, turned into
`DistributedError`; a collective that never returns is the watchdog's.
"""

from __future__ import annotations

import time

import mlx.core as mx

from umakit.backends.distributed import COLLECTIVE_TIMEOUT_S, DistributedError
from umakit.backends.distributed.messages import MessageChannel
from umakit.backends.distributed.watchdog import lost, lost_message


class Channel(MessageChannel):
    """`MessageChannel` on an mx.distributed group, its collectives on ``stream`` (the model's)."""

    def __init__(self, group, stream, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        super().__init__(group.rank(), group.size(), timeout_s)
        self.group, self.stream = group, stream

    def collective(self, make, what: str, bounded: bool = True):
        """Evaluate ``make()`` (built of collectives) under the watchdog; a lost peer raises `DistributedError`."""
        t0 = time.perf_counter()
        try:
            with mx.stream(self.stream):
                out = make()
                if bounded:
                    with self.watchdog.armed(what):
                        mx.eval(out)
                else:
                    mx.eval(out)
        except RuntimeError as e:
            if not lost(e):
                raise
            self.broken = True
            raise DistributedError(lost_message(self.rank, self.size, str(e))) from e
        self.comm_s += time.perf_counter() - t0
        return out

    def _bcast(self, data: bytes | None, n: int, what: str, bounded: bool) -> bytes:
        buf = mx.array(list(data), dtype=mx.uint8) if self.rank == 0 else mx.zeros((n,), dtype=mx.uint8)
        out = self.collective(lambda: mx.distributed.all_sum(buf, group=self.group), what, bounded)
        return bytes(memoryview(out))

    def gather_equal(self, digest: bytes, what: str) -> list[int]:
        rows = mx.zeros((self.size, len(digest)), dtype=mx.uint8)
        rows[self.rank] = mx.array(list(digest), dtype=mx.uint8)
        out = self.collective(lambda: mx.distributed.all_sum(rows, group=self.group), what)
        table = [bytes(memoryview(out[r])) for r in range(self.size)]
        return [r for r in range(self.size) if table[r] != table[0]]
