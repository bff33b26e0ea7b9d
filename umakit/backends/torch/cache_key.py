"""Where a checkpoint's CPU int4 packing is kept, computed without importing torch (the light start needs it).

The file's name hashes the checkpoint's path, the size and modification time
of each of its files, torch's version and `FORMAT_VERSION` (packed_cache.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

from ...errors import WriteError
from ...home import home_dir

FORMAT_VERSION = 2  # bump when Int4PackLinear's packed form or the file layout changes (2: 64-byte aligned data)
SUFFIX = ".safetensors"
LIGHT_SUFFIX = ".light.safetensors"  # beside it: the rest of the fused step's inputs (light.py)


def packed_path(checkpoint_dir: Path, files: list[Path], torch_version: str) -> Path | None:
    """The packing's file for the checkpoint at ``checkpoint_dir`` as its ``files`` are now; None where none can be
    kept."""
    where = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]
    key = hashlib.sha256(f"{FORMAT_VERSION} {torch_version}".encode())
    try:
        for f in sorted(files):
            stat = f.stat()
            key.update(f"{f.name} {stat.st_size} {stat.st_mtime_ns}".encode())
        folder = home_dir("packed")
    except (OSError, WriteError):
        return None
    return folder / f"{where}-{key.hexdigest()[:16]}{SUFFIX}"


def light_path(packed: Path) -> Path:
    """The light start's file beside a packing's."""
    return packed.with_name(packed.name.removesuffix(SUFFIX) + LIGHT_SUFFIX)


def installed_torch_version() -> str | None:
    """torch's ``__version__`` as its installed ``torch/version.py`` says, without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None
