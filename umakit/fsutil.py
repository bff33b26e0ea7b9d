"""Atomic file and directory writes: a failed write leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import InvalidArgumentError


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator:
    """Open a temporary file beside ``path``; rename it over ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``, renamed to ``path`` on success.

    An existing ``path`` is an error unless ``force``; then it is replaced only
    after the new directory is complete.
    """
    path = check_destination(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_destination(dst: str | os.PathLike, force: bool = False) -> Path:
    """Refuse an existing ``dst`` unless ``force``: callers check before any slow work, the writer again."""
    dst = Path(dst)
    if dst.exists() and not force:
        raise InvalidArgumentError(f"{dst} already exists (use --force to overwrite)")
    return dst
