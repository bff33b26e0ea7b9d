"""Where umakit keeps its files: ``$UMAKIT_HOME``, by default ``~/.cache/umakit``."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = Path("~/.cache/umakit")


def umakit_home() -> Path:
    """umakit's data directory (not created here)."""
    return Path(os.environ.get("UMAKIT_HOME") or DEFAULT_HOME).expanduser()
