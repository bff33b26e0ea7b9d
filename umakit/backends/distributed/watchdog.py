"""What every sharded run shares, whatever carries its messages: naming a lost rank, the watchdog, SIGTERM.

No framework is imported here: MLX's channel (channel.py) and torch's (torch_channel.py) both use it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import contextmanager


def peers_of(rank: int, size: int) -> list[int]:
    """The ranks this one exchanges with in a ring: the ones whose loss it notices first."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def lost_message(rank: int, size: int, detail: str) -> str:
    names = " or ".join(f"rank {p}" for p in peers_of(rank, size))
    return f"rank {rank} lost {names} of the distributed run ({detail}); restart every rank"


class Watchdog:
    """Ends the process when a collective overruns its deadline.

    The main thread is then blocked inside MLX's C++ and cannot raise, so this
    thread writes the one-line error itself and exits (the one place the
    library writes to stderr: no caller is left to report it).
    """

    def __init__(self, rank: int, size: int, timeout_s: float):
        self._rank, self._size, self.timeout_s = rank, size, timeout_s
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="umakit-dist-watchdog", daemon=True).start()

    @contextmanager
    def armed(self, what: str):
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                msg = lost_message(self._rank, self._size, f"no reply to {what} within {self.timeout_s:.0f} s")
                _exit_with(msg)


BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer", "gloo", "Connection closed")  # a lost connection, as
# MLX's backends and torch's gloo word it


def lost(e: RuntimeError) -> bool:
    return any(mark in str(e) for mark in BACKEND_ERRORS)


def _exit_with(message: str) -> None:
    os.write(2, f"Error: {message}\n".encode())
    os._exit(1)


def stop_on_sigterm(rank: int, size: int) -> None:
    """mlx.launch ends the other ranks with SIGTERM when one exits: say so in one line, not silently.

    The main thread may be blocked in a collective, where no Python handler runs: the signal is
    read from the interpreter's wakeup fd by a thread, which reports and exits.
    """
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL or threading.current_thread() != threading.main_thread():
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) != -1:
        signal.set_wakeup_fd(-1)  # someone else (an event loop) reads it: leave their signals alone
        return
    signal.signal(signal.SIGTERM, lambda *_: None)

    def watch(keep=writer):  # holds the writer: the wakeup fd must outlive this function
        while True:
            data = reader.recv(64)
            if signal.SIGTERM in data:
                _exit_with(lost_message(rank, size, "it exited, and the launcher stopped this rank"))

    threading.Thread(target=watch, name="umakit-dist-sigterm", daemon=True).start()

