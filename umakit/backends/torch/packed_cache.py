"""The CPU int4 form of a checkpoint's quantized layers, kept under ``$UMAKIT_HOME/packed/`` for later loads.

Repacking MLX's 4/8-bit groups for torch's int4 kernels (quant.Int4PackLinear)
is most of a CPU load: 3.0 of 3.65 s for a 0.5B model with an 8-bit table,
which splits into two nibble planes. The first load writes the packed
weights and their scales into one safetensors file; later loads read them
back and skip the repack. The file's name hashes the checkpoint's path, the
size and modification time of each of its files, torch's version and
`FORMAT_VERSION`, so a changed checkpoint, torch or packing is never read
stale; the file of an older key of the same checkpoint is removed when the
new one is written. A file that cannot be read or written is skipped: the
layers are repacked, as without a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ...errors import WriteError
from ...fsutil import atomic_file
from ...home import home_dir

FORMAT_VERSION = 1  # bump when Int4PackLinear's packed form changes
SUFFIX = ".safetensors"


class PackedCache:
    """The packed form of one checkpoint's layers: `get` what an earlier load stored, `store` what this one made."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}
        if path.exists():
            with contextlib.suppress(OSError, SafetensorError):
                self.tensors = load_file(path)

    @classmethod
    def for_checkpoint(cls, checkpoint_dir: Path, files: list[Path]) -> "PackedCache | None":
        """The cache of the checkpoint at ``checkpoint_dir`` as its ``files`` are now; None where none can be kept."""
        where = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]
        key = hashlib.sha256(f"{FORMAT_VERSION} {torch.__version__}".encode())
        try:
            for f in sorted(files):
                stat = f.stat()
                key.update(f"{f.name} {stat.st_size} {stat.st_mtime_ns}".encode())
            folder = home_dir("packed")
        except (OSError, WriteError):
            return None
        return cls(folder / f"{where}-{key.hexdigest()[:16]}{SUFFIX}")

    def get(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed, scales_and_zeros) of the layer at module path ``name``, if stored."""
        packed, sz = self.tensors.get(f"{name}.packed"), self.tensors.get(f"{name}.scales_and_zeros")
        return None if packed is None or sz is None else (packed, sz)

    def store(self, layers: dict[str, torch.Tensor]) -> None:
        """Write ``layers`` (name -> tensor) as this checkpoint's cache, unless it holds them already."""
        if not layers or layers.keys() <= self.tensors.keys():
            return
        try:
            with atomic_file(self.path, "wb") as f:
                f.write(save({k: v.contiguous() for k, v in layers.items()}))
        except WriteError:
            return  # a cache: the next load repacks
        prefix = self.path.name.split("-")[0] + "-"
        for old in self.path.parent.glob(f"{prefix}*{SUFFIX}"):
            if old != self.path:
                with contextlib.suppress(OSError):
                    old.unlink()
