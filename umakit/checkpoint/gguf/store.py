"""Import a GGUF once into umakit's cache, safely when processes race.

The import is written to a temporary directory beside the target and renamed
into place; ``rename`` onto an existing non-empty directory fails atomically,
so when two processes import at once one wins and the other uses its result.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from umakit.errors import ModelNotFoundError
from umakit.core.fsutil import new_temp_dir
from umakit.core.home import umakit_home
from umakit.checkpoint.gguf.finished import is_complete


def import_once(gguf_path: Path, target: Path, progress: Callable[[int, int], None] | None = None,
                defer_copies: bool | Callable[[str | None], bool] = False,
                leave_layers: bool | Callable[[str | None], bool] = False) -> Path:
    """Return ``target``, importing ``gguf_path`` into it first unless it holds a finished import (``progress``,
    ``defer_copies`` and ``leave_layers``: `convert.write_import`'s, heard only when it imports)."""
    if is_complete(target):
        return target
    from umakit.checkpoint.gguf.convert import plan_import, write_import
    from umakit.checkpoint.gguf.reader import open_gguf

    plan = plan_import(open_gguf(gguf_path))
    tmp = new_temp_dir(target)
    try:
        write_import(plan, tmp, progress, defer_copies, leave_layers)
        install_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless another process won
    return target


def install_dir(tmp: Path, target: Path, complete=is_complete) -> None:
    """Rename the finished ``tmp`` to ``target``; where another process installed it first (``complete``), keep
    theirs."""
    for _ in range(3):
        try:
            os.rename(tmp, target)  # replaces an empty directory, fails on a non-empty one
            return
        except OSError:
            if complete(target):
                return  # another process finished first: use its import
        # An incomplete leftover (an interrupted older version): move it aside and retry.
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, target)


IMPORTER = 3  # bump when an import's output changes (2: Q6_K and Q3_K re-quantized symmetric; 3: Q6_K exact too)


def cached_import(gguf_path: str | os.PathLike, progress: Callable[[int, int], None] | None = None,
                  defer_copies: bool | Callable[[str | None], bool] = False,
                  leave_layers: bool | Callable[[str | None], bool] = False) -> Path:
    """The imported directory for ``gguf_path`` under ``$UMAKIT_HOME/models/gguf``.

    The cache key is the file's resolved path, size and modification time, and
    `IMPORTER`, so a changed file (or importer) is imported again and an unchanged
    one is not even parsed. ``progress(done, total)`` hears the GGUF's tensor bytes converted, only where this
    call imports; ``defer_copies``, ``leave_layers``: `convert.write_import`'s (either import serves every engine).
    """
    given = Path(gguf_path).expanduser()
    path = given.resolve()  # a Hub cache's snapshot file is a link to a blob named by its hash
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist or is not a file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{IMPORTER}".encode()).hexdigest()[:12]
    return import_once(path, umakit_home() / "models" / "gguf" / f"{given.stem}-{key}", progress, defer_copies,
                       leave_layers)
