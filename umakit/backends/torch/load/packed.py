"""The CPU packed form of a checkpoint's quantized layers, kept under ``$UMAKIT_HOME/packed/`` for later loads.

Repacking MLX's groups for a CPU kernel (umakit's affine planes, cpu/affine_kernel.py,
or torch's int4 packing, quant.Int4PackLinear) is work a load need do once:
the int4 repack was 3.0 of 3.65 s of a 0.5B model's load. The first load writes the packed
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
import json
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from umakit.errors import WriteError
from umakit.core.fsutil import atomic_file
from umakit.core.home import PACKED, checkpoint_key, home_dir

ALIGNMENT = 64  # bytes: torch's CPU allocator's, and AVX-512's loads
# bump when a packed form or the file layout changes (2: 64-byte aligned data; 3: affine planes; 4: affine tiles;
# 5: K-quants' scales as codes; 6: the tiles' bits above 4 as 2- and 1-bit planes, not masks)
FORMAT_VERSION = 6
SUFFIX = ".safetensors"


def packed_path(checkpoint_dir: Path, files: list[Path], torch_version: str) -> Path | None:
    """The packing's file for the checkpoint at ``checkpoint_dir`` as its ``files`` are now; None where none can be
    kept."""
    where = checkpoint_key(checkpoint_dir)
    key = hashlib.sha256(f"{FORMAT_VERSION} {torch_version}".encode())
    try:
        for f in sorted(files):
            stat = f.stat()
            key.update(f"{f.name} {stat.st_size} {stat.st_mtime_ns}".encode())
        folder = home_dir(PACKED)
    except (OSError, WriteError):
        return None
    return folder / f"{where}-{key.hexdigest()[:16]}{SUFFIX}"


class PackedCache:
    """The packed form of one checkpoint's layers: `get` what an earlier load stored, `store` what this one made."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None  # the stored packing, read a layer at a time
        self.names: set[str] = set()
        self._layers: dict[str, list[str]] = {}  # a layer's module path -> its stored names (one lookup a layer)
        if path.exists():
            self._open()

    def _open(self) -> None:
        with contextlib.suppress(OSError, SafetensorError):
            self.file = safe_open(self.path, framework="pt")
            self.names = set(self.file.keys())
        self._layers = {}
        for k in self.names:
            self._layers.setdefault(k.rpartition(".")[0], []).append(k)

    def _holds(self, name: str, t: torch.Tensor) -> bool:
        try:
            return tuple(self.file.get_slice(name).get_shape()) == tuple(t.shape)
        except (OSError, SafetensorError):
            return False

    @classmethod
    def for_checkpoint(cls, checkpoint_dir: Path, files: list[Path]) -> "PackedCache | None":
        """The cache of the checkpoint at ``checkpoint_dir`` as its ``files`` are now; None where none can be kept."""
        path = packed_path(checkpoint_dir, files, torch.__version__)
        return None if path is None else cls(path)

    def get(self, name: str) -> dict[str, torch.Tensor]:
        """The stored packing of the layer at module path ``name``, by the layer's names (empty if none)."""
        keys = self._layers.get(name, ())
        try:
            return {k[len(name) + 1:]: _aligned(self.file.get_tensor(k)) for k in keys}
        except (OSError, SafetensorError):
            return {}

    def store(self, layers: dict[str, nn.Module], stream=None) -> None:
        """Write the packing of ``layers`` (module path -> a module with `packing()`) as this checkpoint's cache,
        unless it holds it already (every name, each in the same shape: a layer packed otherwise than before, by a
        new reading of the same files, is written again). Once written, the layers hold the file's mapped tensors
        instead of the ones they made, as a later load's do: the process that packed keeps no second copy.
        ``stream``: a `packing_stream.PackingStream` this load wrote its layers to as it made them, finished here
        with any layer it missed (else, where it could not be finished, the file is written whole)."""
        if stream is not None and not stream.broken:
            for path, m in layers.items():
                stream.add(path, m)
            if stream.finish():
                self._open()
                self._drop_older()
                return
        tensors = {f"{path}.{name}": t for path, m in layers.items() for name, t in m.packing().items()}
        if not tensors or tensors.keys() <= self.names and all(self._holds(k, t) for k, t in tensors.items()):
            return
        try:
            with atomic_file(self.path, "wb") as f:
                _write(f, tensors)
        except WriteError:
            return  # a cache: the next load repacks
        self._open()
        for path, m in layers.items():
            made, kept = m.packing(), self.get(path)
            if kept.keys() == made.keys() and all(_same(kept[k], t) for k, t in made.items()):
                for name, t in kept.items():
                    setattr(m, name, t)
        self._drop_older()

    def _drop_older(self) -> None:
        """Older keys' packings of the same checkpoint go."""
        prefix = self.path.name.split("-")[0] + "-"
        for old in self.path.parent.glob(f"{prefix}*{SUFFIX}"):
            if old != self.path:
                with contextlib.suppress(OSError):
                    old.unlink()


DTYPES = {torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
           torch.int32: "I32"}


def _write(f, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as a safetensors file, written a tensor at a time (never the whole file in memory: it is as
    large as the model), its data starting at a multiple of `ALIGNMENT` (the header padded with spaces, as the
    format allows), so every tensor whose offset is one too is read in place, at the boundary, from the map."""
    header, offset = {}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    f.write(len(text).to_bytes(8, "little") + text)
    for t in tensors.values():
        f.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` at a 64-byte boundary, as torch allocates it: the int4 kernel read a packing 15-20% slower
    off the boundary (measured on the default model). The packing's sizes are multiples of 64 bytes, so
    from `_write`'s files this is the mapped tensor itself; otherwise a copy."""
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()
