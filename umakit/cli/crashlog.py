"""Logs of internal errors (umakit's bugs, never a user's mistake) under ``$UMAKIT_HOME/logs/``.

The CLI shows one line naming the error and its log (`report`); the log holds
the traceback, the command line and the versions, for a bug report.
``UMAKIT_DEBUG=1`` asks the CLI to show the traceback inline as well.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import traceback
from datetime import datetime
from pathlib import Path

from umakit.core.fsutil import atomic_file
from umakit.core.home import home_dir

LOGS_DIR = "logs"
KEEP_LOGS = 50  # the newest logs kept; older ones are removed when a new one is written
DEBUG_ENV = "UMAKIT_DEBUG"
SUMMARY_CHARS = 200


def debug() -> bool:
    """Whether ``UMAKIT_DEBUG`` asks for tracebacks inline (set, and not 0 or empty)."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def summary(exc: BaseException) -> str:
    """``Type: first line of the message``, short enough for one line."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 3] + "..."


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("umakit")
    except PackageNotFoundError:
        return "unknown"


def write(exc: BaseException) -> Path:
    """Write ``exc``'s traceback to a new log (atomically) and return its path; a `WriteError` when it cannot be."""
    logs = home_dir(LOGS_DIR)
    path = logs / f"{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}-{os.getpid()}.log"
    head = [
        f"umakit {_version()} · Python {platform.python_version()} · {platform.platform()}",
        f"command: {' '.join(sys.argv)}",
        "",
    ]
    body = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    with atomic_file(path, "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write("\n".join(head) + body)
    _prune(logs)
    return path


def _prune(logs: Path) -> None:
    with contextlib.suppress(OSError):
        old = sorted(logs.glob("*.log"), key=lambda p: p.name)[:-KEEP_LOGS]
        for p in old:
            p.unlink(missing_ok=True)


def report(exc: BaseException) -> str:
    """The user's one line about an internal error: what it was and where its log is (or why there is none)."""
    try:
        path = write(exc)
    except Exception as e:  # reporting a bug must never raise a second error in its place
        return f"internal error ({summary(exc)}); the log could not be written: {e}"
    return f"internal error ({summary(exc)}); details in {path}"
