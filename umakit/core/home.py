"""Where umakit keeps its files: ``$UMAKIT_HOME``, by default ``~/.cache/umakit``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from umakit.errors import WriteError

DEFAULT_HOME = Path("~/.cache/umakit")


def umakit_home() -> Path:
    """umakit's data directory (not created here)."""
    return Path(os.environ.get("UMAKIT_HOME") or DEFAULT_HOME).expanduser()


def home_dir(*parts: str) -> Path:
    """``$UMAKIT_HOME/<parts>``, created; an unusable home (a file, read-only, full) is one `WriteError`."""
    path = umakit_home().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = e.strerror or str(e)
        where = f" at {e.filename}" if e.filename and os.fspath(e.filename) != os.fspath(path) else ""
        raise WriteError(f"cannot use {path} (UMAKIT_HOME={umakit_home()}): {reason}{where}; "
                         "set UMAKIT_HOME to a writable directory") from e
    return path


PACKED = "packed"  # the CPU packings of checkpoints (backends/torch/load/packed.py), named by checkpoint_key


def checkpoint_key(checkpoint_dir: str | os.PathLike) -> str:
    """What a packing kept under ``$UMAKIT_HOME/packed`` is named by, first: the checkpoint's resolved path."""
    return hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]


def packings(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The CPU packings kept for the checkpoint at ``checkpoint_dir``, which go with it."""
    folder = umakit_home() / PACKED
    return sorted(folder.glob(f"{checkpoint_key(checkpoint_dir)}-*.safetensors")) if folder.is_dir() else []
