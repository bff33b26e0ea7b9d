"""Letting go of a checkpoint's mapped pages once a layer made from them no longer needs them.

A load maps the checkpoint's safetensors files and reads each quantized layer from the map; the CPU packing
then makes the layer anew, but the pages it read stay resident until the whole map goes at the end of the
load: with the packing beside them, a first load held the checkpoint and its packing at once. `SourcePages`
hands a packed layer's source pages back as soon as the layer is made (``madvise(MADV_DONTNEED)``, which for
a file's private map drops this process's copy of pages it never wrote: read again, they come back from the
file). Only whole pages inside a tensor that lies in a map of a ``.safetensors`` file are dropped, never an
anonymous page; nowhere but Linux, nothing is done.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys

from torch import nn

MADV_DONTNEED = 4
SUFFIX = ".safetensors"


class SourcePages:
    """The safetensors files this process maps now (their address ranges), to `let_go` of layers' pages in."""

    def __init__(self):
        self.spans: list[tuple[int, int]] = []
        self._madvise = None
        if not sys.platform.startswith("linux"):
            return
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].rstrip("\n").endswith(SUFFIX):
                        lo, hi = (int(x, 16) for x in fields[0].split("-"))
                        self.spans.append((lo, hi))
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            self.spans = []
        self.spans.sort()
        self._starts = [lo for lo, _ in self.spans]

    def let_go(self, source: nn.Module) -> int:
        """Drop the pages of ``source``'s tensors (a layer already made anew) that lie in a mapped safetensors
        file; returns the bytes let go of."""
        if not self.spans:
            return 0
        dropped = 0
        for t in [*source.parameters(), *source.buffers()]:
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
                continue
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            i = bisect.bisect_right(self._starts, start) - 1
            if i < 0 or end > self.spans[i][1]:
                continue  # not wholly in a checkpoint's map: left alone
            lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo and self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0:
                dropped += hi - lo
        return dropped
