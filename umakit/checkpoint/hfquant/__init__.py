"""GPTQ, AWQ and compressed-tensors checkpoints imported as MLX-layout directories (importer.py), once per
checkpoint into umakit's cache, as a GGUF is, or where the user says (`umakit import`)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from umakit.checkpoint.hfquant.detect import METHODS, is_complete, method_of

__all__ = ["METHODS", "cached_import", "import_checkpoint", "is_complete", "method_of"]

IMPORTS = ("models", "imported")  # under $UMAKIT_HOME


def import_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, force: bool = False,
                      progress: Callable[[int, int], None] | None = None):
    """Write ``path``'s checkpoint as an MLX-layout directory at ``out_dir``, atomically; an existing
    ``out_dir`` is replaced only with ``force``, once the new one is complete; returns importer.ImportReport.
    ``progress(done, total)`` hears the checkpoint's tensor bytes converted."""
    from umakit.checkpoint.hfquant.importer import plan_import, write
    from umakit.core.fsutil import atomic_dir, check_destination, check_not_inside, check_writable

    plan = plan_import(Path(path))
    check_destination(out_dir, force)
    check_not_inside(path, out_dir)
    check_writable(out_dir)
    with atomic_dir(out_dir, force=force) as tmp:
        report = write(plan, tmp, progress)
    report.out_dir = Path(out_dir)
    return report


def cached_import(path: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """The import of the checkpoint directory ``path`` under ``$UMAKIT_HOME/models/imported``, made first unless
    a finished one is there (``progress``: `importer.tensors`', only then); keyed by the directory, its files'
    sizes and times, and the import's format."""
    from umakit.checkpoint.gguf.store import install_dir
    from umakit.checkpoint.hfquant.detect import IMPORT_FORMAT
    from umakit.checkpoint.hfquant.importer import plan_import, write
    from umakit.core.fsutil import new_temp_dir, writing
    from umakit.core.home import home_dir

    path = path.resolve()
    stamp = [f"{f.name}\0{f.stat().st_size}\0{f.stat().st_mtime_ns}" for f in sorted(path.iterdir()) if f.is_file()]
    key = hashlib.sha256("\0".join([str(path), str(IMPORT_FORMAT), *stamp]).encode()).hexdigest()[:12]
    cache = home_dir(*IMPORTS)
    # a Hub snapshot's directory is its commit: name the import after the repo
    name = path.parent.parent.name.split("--")[-1] if path.parent.name == "snapshots" else path.name
    target = cache / f"{name}-{key}"
    if is_complete(target):
        return target
    plan = plan_import(path)  # refusals before anything is written
    with writing(cache):
        tmp = new_temp_dir(target)
        try:
            write(plan, tmp, progress)
            install_dir(tmp, target, is_complete)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
