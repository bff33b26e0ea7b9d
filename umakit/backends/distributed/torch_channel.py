"""Rank 0's messages to the other ranks over torch.distributed (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from umakit.backends.distributed import COLLECTIVE_TIMEOUT_S, DistributedError
from umakit.backends.distributed.messages import MessageChannel
from umakit.backends.distributed.watchdog import lost, lost_message


class TorchChannel(MessageChannel):
    """`MessageChannel` on torch.distributed's default group; messages are ``broadcast`` from rank 0."""

    def __init__(self, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        super().__init__(dist.get_rank(), dist.get_world_size(), timeout_s)
        self.device = device

    def run(self, op, what: str, bounded: bool = True):
        """Run ``op()`` (a synchronous collective) under the watchdog; a lost peer raises `DistributedError`."""
        t0 = time.perf_counter()
        try:
            if bounded:
                with self.watchdog.armed(what):
                    op()
            else:
                op()
        except (RuntimeError, dist.DistBackendError) as e:
            if not lost(e):
                raise
            self.broken = True
            raise DistributedError(lost_message(self.rank, self.size, str(e))) from e
        self.comm_s += time.perf_counter() - t0

    def _bcast(self, data: bytes | None, n: int, what: str, bounded: bool) -> bytes:
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.zeros(n, dtype=torch.uint8, device=self.device)
        self.run(lambda: dist.broadcast(buf, src=0), what, bounded)
        return bytes(buf.cpu().numpy())

    def gather_equal(self, digest: bytes, what: str) -> list[int]:
        rows = torch.zeros(self.size, len(digest), dtype=torch.uint8, device=self.device)
        rows[self.rank] = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(self.device)
        self.run(lambda: dist.all_reduce(rows), what, True)
        table = [bytes(r.cpu().numpy()) for r in rows]
        return [r for r in range(self.size) if table[r] != table[0]]

    def barrier(self, what: str) -> None:
        self.run(lambda: dist.barrier(), what, False)
