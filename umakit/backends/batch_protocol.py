"""The small interface a backend implements for batched decoding.

umakit's scheduler (`umakit.batch`) owns the queue, the slots, detokenizing,
stop strings and statistics; a backend's decoder only holds the rows' KV
caches and advances all of them with one forward pass per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

from ..sampling import SamplingParams


@dataclass(frozen=True)
class BatchRow:
    """One sequence to decode: a caller-chosen id, its prompt ids and its sampling."""

    id: int
    prompt: Sequence[int]
    sampling: SamplingParams
    seed: int | None = None


@runtime_checkable
class BatchDecoder(Protocol):
    """Rows join with `add`, advance together with `step`, and leave with `remove`."""

    @property
    def size(self) -> int:
        """Rows currently held."""

    def add(self, rows: Sequence[BatchRow]) -> None:
        """Prefill ``rows`` without disturbing the rows already running.

        Their first sampled tokens come out of later `step` calls.
        """

    def step(self) -> list[tuple[int, int]]:
        """Advance every row by one forward pass; returns ``(row id, token)`` pairs.

        A decoder may run one step ahead of what it returns (so the device
        computes step n+1 while the caller handles step n): rows added since
        the previous call may have no token yet, and a row removed after this
        call may already have been advanced once more, which is discarded.
        """

    def remove(self, ids: Iterable[int]) -> None:
        """Drop finished rows and free their cache."""

    def kv_budget_bytes(self) -> int:
        """Bytes the device can give the KV cache beside the weights."""

    def context_tokens(self) -> int:
        """Cache positions each row occupies now (padding included)."""
