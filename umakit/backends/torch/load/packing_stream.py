"""A checkpoint's first CPU packing written to `load/packed.py`'s file layer by layer, as the load makes it.

Packed whole before it is written, a model's packing is a second copy of its weights in memory beside the
checkpoint's mapped pages: a first load peaked at about 3x the file. Here each layer's packing is appended to
the file as soon as it is made, and every `BATCH` bytes the layers written are read back from the file's map
(their own tensors let go of), so the load holds one batch of packings at a time. The header, known last, goes
into room left for it at the start (padded with spaces, as `packed._write` pads it, so the data starts at a
multiple of `ALIGNMENT`); if the guess was short, the finished layers are written again the usual way.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from umakit.backends.torch.load.packed import ALIGNMENT, DTYPES, PackedCache
from umakit.backends.torch.load.pages import SourcePages
from umakit.backends.torch.model.moe import Experts
from umakit.backends.torch.quant.layout import QuantizedLinear
from umakit.core.fsutil import atomic_file, start_writeback
from umakit.errors import WriteError

BATCH = 64 << 20  # bytes of packings made before they are read back from the file's map
ROOM, ROOM_PER_LAYER = 1 << 16, 1024  # header bytes left: a layer's entries are a few names, shapes and offsets


class PackingStream:
    """`add` each packed layer as it is made; `finish` once every layer is: True if the file was written."""

    def __init__(self, path, layers: int):
        self.path, self.header, self.size, self.mapped, self.added = path, {}, 0, 0, set()
        self.room = ROOM + ROOM_PER_LAYER * layers
        self.room += -(8 + self.room) % ALIGNMENT  # the data starts at a multiple of ALIGNMENT
        self.pending: list[tuple[nn.Module, dict]] = []  # layers written, not yet read back from the map
        self._stack = contextlib.ExitStack()
        try:
            self._f = self._stack.enter_context(atomic_file(path, "wb"))
            self._f.seek(8 + self.room)
            # the pages written start for the disk on a thread of their own (the call may wait on the disk's
            # queue), and its calls end before the file is synced and closed (the stack unwinds in reverse)
            self._writeback = self._stack.enter_context(ThreadPoolExecutor(1, "umakit-writeback"))
        except WriteError:
            self._f = None

    @property
    def broken(self) -> bool:
        return self._f is None

    def add(self, path: str, module: nn.Module) -> None:
        """Append ``module``'s packing (its names under ``path``)."""
        if self._f is None or path in self.added:
            return
        self.added.add(path)
        entries = {}
        try:
            for name, t in module.packing().items():
                data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                self._f.write(data.data)
                entries[name] = (self.size, t)
                self.header[f"{path}.{name}"] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                                                 "data_offsets": [self.size, self.size + data.nbytes]}
                self.size += data.nbytes
        except OSError as e:
            self.abort(e)
            return
        self.pending.append((module, entries))
        if self.size - self.mapped >= BATCH:
            self._read_back()

    def _read_back(self) -> None:
        """The pending layers' tensors replaced by views of the file's map (copy-on-write, as safetensors maps)."""
        if not self.pending:
            return
        start = 8 + self.room + self.mapped
        base = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        try:
            self._f.flush()
            self._writeback.submit(start_writeback, self._f.fileno(), start, self.size - self.mapped)
            view = mmap.mmap(self._f.fileno(), 8 + self.room + self.size - base, offset=base,
                             access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # no map: the layers keep the tensors they made
            self.pending, self.mapped = [], self.size
            return
        for module, entries in self.pending:
            for name, (offset, t) in entries.items():
                mapped = torch.frombuffer(view, dtype=t.dtype, count=t.numel(),
                                          offset=8 + self.room + offset - base).view(t.shape)
                if mapped.data_ptr() % ALIGNMENT == 0:  # else the made tensor stays (packed.get would copy it)
                    setattr(module, name, mapped)
        self.pending, self.mapped = [], self.size

    def finish(self) -> bool:
        """Write the header and put the file in place; False where it could not be (the caller writes it whole)."""
        if self._f is None:
            return False
        text = json.dumps(self.header, separators=(",", ":")).encode()
        if len(text) > self.room:
            self.abort()
            return False
        try:
            self._read_back()
            self._f.seek(0)
            self._f.write(len(text.ljust(self.room)).to_bytes(8, "little") + text.ljust(self.room))
            self._f.seek(0, 2)
            self._stack.close()  # flushed, synced and renamed into place
        except (OSError, WriteError) as e:
            self.abort(e)
            return False
        self._f = None
        return True

    def abort(self, error: BaseException | None = None) -> None:
        """Give the file up (the temporary file is removed); layers read back from it keep their map."""
        if self._f is None:
            return
        self._f = None
        with contextlib.suppress(OSError, WriteError):
            self._stack.__exit__(type(error) if error else WriteError, error or WriteError("abandoned"), None)


def count_quantized(model: nn.Module) -> int:
    """The layers a packing may hold a header entry for: every quantized one, and every expert of a stack."""
    return sum(1 if isinstance(m, QuantizedLinear) else getattr(m, "n", 0) for m in model.modules()
               if isinstance(m, (QuantizedLinear, Experts)))


Made = Callable[[str, nn.Module, nn.Module], None]  # (path, the layer made, the module it was made from)


def first_packing(packed: PackedCache | None, layers: Callable[[], int],
                  packing: Callable[[int], None] | None = None) -> tuple[PackingStream | None, Made]:
    """For a load whose cache holds no packing yet (``packed.file`` None): a `PackingStream` to its path, for at
    most ``layers()`` layers, and the hook `forms.convert_model` calls with each packed layer, which writes it,
    lets go of its source's pages in the checkpoint's map (`SourcePages`) and tells ``packing`` the source bytes
    packed so far. Elsewhere: no stream, and a hook that does nothing."""
    if packed is None or packed.file is not None:
        return None, lambda path, layer, source: None
    stream, pages, done = PackingStream(packed.path, layers()), SourcePages(), [0]

    def made(path: str, layer: nn.Module, source: nn.Module) -> None:
        stream.add(path, layer)
        pages.let_go(source)
        if packing is not None:
            done[0] += sum(t.nbytes for t in (*source.parameters(), *source.buffers()))
            packing(done[0])

    return stream, made
