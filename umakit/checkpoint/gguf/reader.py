"""Open a GGUF file and check it before anything is converted.

umakit reads the header itself: the `gguf` package's reader makes an array
view for every string of a vocabulary (seconds for a 150k-token one) and
surfaces a wrong magic, an unknown version or a truncated file as bare
`ValueError`s or `IndexError`s from deep inside it. Here each becomes a
one-line `CheckpointError` naming the file. The tensors are views of the
mapped file, shaped as the `gguf` package shapes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import mmap
import os
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from umakit.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


class Tensor(NamedTuple):
    """One tensor of a GGUF, as the `gguf` package's reader gives it: ``shape`` is GGML's (ne: columns first) and
    ``data`` a read-only view of the mapped file (quantized blocks as bytes, a row of blocks per row)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # uint64 dims, columns first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass
class GGUFFile:
    """A parsed GGUF: decoded metadata and the reader's memory-mapped tensors."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, Tensor] = field(repr=False)
    mapped: mmap.mmap | None = field(default=None, repr=False)

    def release(self, names: list[str]) -> None:
        """Let go of the named tensors' pages in this process (read again from the file if used again): a
        conversion tensor by tensor then holds one tensor of the file, not every one it has read."""
        if self.mapped is None:
            return
        for name in names:
            t = self.tensors[name]
            start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
            self.mapped.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)

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


# GGUF's value types (gguf's GGUFValueType numbering): the scalars' struct formats, and the two others.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
_DEFAULT_ALIGNMENT = 32
_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}  # types whose data is typed values; any other is blocks of bytes


class _Cursor:
    """Reads GGUF's little-endian header fields from a mapped file, refusing to read past its end."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.at, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise CheckpointError(f"{self.path} is truncated (its header ends at byte {len(self.buf)})")
        self.at += n
        return self.buf[self.at - n:self.at]

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: a string at byte {self.at - len(raw)} is not UTF-8 ({e})") from e

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, its merges): `string`'s reads in one loop, a third of the
        time for Qwen's 151,936 tokens."""
        buf, at, end, out = self.buf, self.at, len(self.buf), []
        length = _LENGTH.unpack_from
        for _ in range(count):
            if at + 8 > end:
                self.at = at
                self.take(8)  # raises: truncated
            n = length(buf, at)[0]
            if at + 8 + n > end:
                self.at = at + 8
                self.take(n)
            try:
                out.append(str(buf[at + 8:at + 8 + n], "utf-8"))
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{self.path}: a string at byte {at + 8} is not UTF-8 ({e})") from e
            at += 8 + n
        self.at = at
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise CheckpointError(f"{self.path}: unknown metadata value type {kind} at byte {self.at}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS:  # numbers: one read, not one a value
            fmt = "<" + _SCALARS[item]
            return np.frombuffer(self.take(count * struct.calcsize(fmt)), dtype=fmt).tolist()
        if item == _STRING:
            return self.strings(count)
        values = [self.value(item) for _ in range(count)]
        return [v for sub in values for v in sub] if item == _ARRAY else values  # nested arrays flattened, as gguf


def _parse(path: Path, buf: memoryview) -> tuple[dict[str, Any], list[tuple], int]:
    """Metadata, tensor infos (name, dims, type, offset) and where the tensors' data starts."""
    cur = _Cursor(buf, path)
    cur.take(8)  # magic and version, checked by read_header
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise CheckpointError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("I")
        dims = np.frombuffer(cur.take(8 * n_dims), dtype="<u8").copy()
        infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{path}: general.alignment {align!r} is not a power of two")
    return metadata, infos, -(-cur.at // align) * align


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse ``path`` (umakit's own reader of the header: the `gguf` package's took seconds on a 150k-token
    vocabulary) and check that every tensor lies inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert sys.byteorder == "little", "GGUF blocks are read as little-endian"
    path = Path(path)
    version = read_header(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buf = memoryview(mapped)
    metadata, infos, start = _parse(path, buf)
    tensors = {}
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise UnsupportedModelError(f"{path} uses a tensor type this gguf package does not know ({e})") from e
        if name in tensors:
            raise CheckpointError(f"{path}: tensor {name} appears twice")
        n = math.prod(int(d) for d in dims)  # Python's integers: a corrupt dimension cannot wrap around
        if qtype not in GGML_QUANT_SIZES:
            raise UnsupportedModelError(f"{path}: tensor {name} has type {qtype.name}, which has no block size here")
        block, type_size = GGML_QUANT_SIZES[qtype]
        begin, n_bytes = start + offset, n * type_size // block
        if begin + n_bytes > len(buf):
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {begin + n_bytes}, "
                                  f"the file at {len(buf)}")
        shape = tuple(int(d) for d in reversed(dims))
        item = _ITEMS.get(qtype.name)
        if item is None:  # blocks: the last dimension in bytes
            if shape and shape[-1] % block:
                raise CheckpointError(f"{path}: tensor {name} has rows of {shape[-1]} values, not whole "
                                      f"{qtype.name} blocks of {block}")
            item, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size) if shape else (n_bytes,)
        data = np.frombuffer(buf, dtype=item, count=n_bytes // np.dtype(item).itemsize, offset=begin)
        tensors[name] = Tensor(name, qtype, dims, n, n_bytes, begin, data.reshape(shape))
    if "general.architecture" not in metadata:
        raise CheckpointError(f"{path} has no general.architecture metadata")
    if int(metadata.get("split.count", 1)) > 1:
        raise UnsupportedModelError(
            f"{path} is one part of a split GGUF; merge the parts first (llama-gguf-split --merge)"
        )
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors, mapped=mapped)


def sha256_file(path: Path, chunk: int = 1 << 22, stop: threading.Event | None = None) -> str | None:
    """Hex SHA-256 of a file, read in 4 MiB chunks; None once ``stop`` is set."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if stop is not None and stop.is_set():
                return None
            h.update(block)  # lets go of the GIL
    return h.hexdigest()


class Digest:
    """`sha256_file` of ``path`` in a thread of its own, read while the caller converts the file (a 40 GB GGUF
    takes seconds to hash: on a machine of many cores they are no longer added to an import's). `result` waits
    for it; `cancel` stops it at its next chunk, and it never keeps a process from exiting."""

    def __init__(self, path: Path):
        self.path, self._stop, self._value = path, threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="umakit-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # `result` reads it again and raises
            self._value = sha256_file(self.path, stop=self._stop)

    def result(self) -> str:
        self._thread.join()
        return self._value if self._value is not None else sha256_file(self.path)

    def cancel(self) -> None:
        self._stop.set()
