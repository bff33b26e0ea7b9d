"""Where umakit keeps its per-user state: imported models, hardware probes."""

from __future__ import annotations

import os
from pathlib import Path


def umakit_home() -> Path:
    """``$UMAKIT_HOME``, default ``~/.cache/umakit`` (not created here)."""
    return Path(os.environ.get("UMAKIT_HOME") or Path.home() / ".cache" / "umakit").expanduser()
