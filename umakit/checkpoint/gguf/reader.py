"""Open a GGUF file and check it before anything is converted.

The `gguf` package's reader assumes a well-formed file: a wrong magic, an
unknown version or a truncated file surface as bare `ValueError`s or
`IndexError`s from deep inside it. Here each becomes a one-line
`CheckpointError` naming the file, and the header is checked by hand first so
the common mistakes get a precise message.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from umakit.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# Errors the gguf reader raises on malformed input.
_PARSE_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError)


@dataclass
class GGUFFile:
    """A parsed GGUF: decoded metadata and the reader's memory-mapped tensors."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, Any] = field(repr=False)  # name -> gguf.ReaderTensor

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value, with ``{arch}`` in ``key`` replaced by the architecture."""
        return self.metadata.get(key.format(arch=self.arch), default)

    def require(self, key: str) -> Any:
        key = key.format(arch=self.arch)
        if key not in self.metadata:
            raise CheckpointError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.metadata[key]


def read_header(path: Path) -> int:
    """Check the magic and version of ``path``; return the version."""
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist or is not a file")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    if len(head) < 8:
        raise CheckpointError(f"{path} is truncated (it ends inside the GGUF header)")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in SUPPORTED_VERSIONS:
        if version and version & 0xFFFF == 0:
            raise UnsupportedModelError(f"{path} is a big-endian GGUF; only little-endian files are supported")
        supported = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise CheckpointError(f"{path} has GGUF version {version}, which is not supported (supported: {supported})")
    return version


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path`` and check that every tensor lies inside the file."""
    import gguf

    assert sys.byteorder == "little", "GGUF blocks are read as little-endian"
    path = Path(path)
    version = read_header(path)
    try:
        reader = gguf.GGUFReader(path)
    except _PARSE_ERRORS as e:
        if "GGMLQuantizationType" in str(e):
            raise UnsupportedModelError(f"{path} uses a tensor type this gguf package does not know ({e})") from e
        raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from e

    size = path.stat().st_size
    tensors = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise CheckpointError(f"{path} is truncated: tensor {t.name} ends at byte {end}, the file at {size}")
        tensors[t.name] = t

    metadata = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = f.contents()
        except _PARSE_ERRORS as e:
            raise CheckpointError(f"{path}: metadata key {key!r} cannot be decoded ({e})") from e
    if "general.architecture" not in metadata:
        raise CheckpointError(f"{path} has no general.architecture metadata")
    if int(metadata.get("split.count", 1)) > 1:
        raise UnsupportedModelError(
            f"{path} is one part of a split GGUF; merge the parts first (llama-gguf-split --merge)"
        )
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
