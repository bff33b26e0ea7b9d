"""Wired memory on Metal: one policy for every entry point (generate, stream, chat, batch, bench, serve).

While wired, the weights stay resident instead of being paged out between steps. The
limit is the weights times `WIRE_MARGIN` (pages round up, and the weights' byte count
alone is too tight), capped by Metal's recommended working set. MLX's limit is one per
process, so the count of holders is one per process too: only the outermost holder sets
it and restores it, on every exit path. ``UMAKIT_NO_WIRE=1`` turns wiring off (batch
runs admitting rows under a wired limit are the pattern behind the kernel panics in
mlx-lm #1666 and mlx #3186).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

WIRE_MARGIN = 1.05  # of the weights' bytes
NO_WIRE_ENV = "UMAKIT_NO_WIRE"


def wiring_disabled() -> bool:
    """True when ``UMAKIT_NO_WIRE`` is set to anything but "" or "0"."""
    return os.environ.get(NO_WIRE_ENV, "").strip() not in ("", "0")


def wired_limit(weight_bytes: int, working_set: int) -> int:
    """The limit to wire for ``weight_bytes`` of weights: with the margin, never above the working set."""
    return min(int(weight_bytes * WIRE_MARGIN), int(working_set))


def _metal_calls() -> tuple[Callable[[int], int], Callable[[], int], Callable[[], None], Callable[[], None]]:
    """The Metal-only calls: set the wired limit (returns the old one), read the working set,
    wait for the GPU, and give freed buffers back (they would stay cached and wired)."""
    import mlx.core as mx

    from umakit.hardware import metal_working_set

    return mx.set_wired_limit, metal_working_set, mx.synchronize, mx.clear_cache


class Wiring:
    """Counted holds on the process's wired limit; the calls default to Metal's (`_metal_calls`)."""

    def __init__(self, calls: Callable[[], tuple] = _metal_calls):
        self._calls = calls
        self._lock = threading.Lock()  # the server's worker and the CLI's thread may both hold
        self._depth = 0
        self._old: int | None = None

    @property
    def depth(self) -> int:
        return self._depth

    @contextlib.contextmanager
    def hold(self, weight_bytes: int):
        """Keep ``weight_bytes`` of weights wired for the body; nested holds only count."""
        set_limit, working_set, synchronize, clear = self._calls()
        with self._lock:
            if self._depth == 0:
                clear()
                self._old = set_limit(wired_limit(weight_bytes, working_set()))
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    try:
                        synchronize()  # the queued work still uses the wired buffers
                    finally:
                        set_limit(self._old)


WIRING = Wiring()  # MLX's wired limit is process-global, so is its count of holders
