"""Streaming offloaded layers through a ring of device buffers (the plan: umakit/plan/placement.py).

Each offloaded layer's tensors are packed, 64-byte aligned, into one flat
host buffer (pinned on CUDA). The device holds ``slots`` flat buffers of the
largest layer's size. Every layer module keeps its own tensor views into
each slot, made once; streaming layer j into slot s is one copy plus
rebinding j's tensors to its slot-s views, so the model code runs unchanged.

Order of events per offloaded layer j in slot s (CUDA):
  copy stream:    wait free[s]  ->  copy host[j] -> slot s  ->  record ready[s]
  compute stream: wait ready[s] ->  layer j                 ->  record free[s]
No host synchronisation: the copy of layer j + slots is queued as soon as
layer j is queued, and runs once layer j has finished reading its slot. The
ring is cyclic across forward passes, so the first offloaded layers of the
next token are already copying while the head and sampling run. On CPU the
same schedule runs with host copies on one copy thread (a future per slot
stands in for the events), which is how CI tests it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch
from torch import nn

from umakit.plan.placement import WHOLE_LAYERS, LayerBytes, streamed_bytes_per_token

ALIGN = 64  # bytes: every tensor view starts on a 64-byte boundary of its slot


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class LayerStreamer:
    """Runs ``offloaded`` blocks of ``layers`` from host memory, ``slots`` at a time on ``device``.

    ``category(name)`` sorts a block's tensor names for `bytes_by_category`.
    """

    def __init__(self, layers: nn.ModuleList, offloaded: Sequence[int], device: torch.device, slots: int,
                 category=lambda name: "other"):
        if not offloaded:
            raise ValueError("nothing to stream")
        self.order = list(offloaded)
        self.position = {layer: j for j, layer in enumerate(self.order)}
        self.device = device
        self.cuda = device.type == "cuda"
        self.hosts: list[torch.Tensor] = []
        layouts = []
        self.bytes_by_category: dict[str, int] = {}
        for i in self.order:
            layout, size = [], 0
            for path, module in layers[i].named_modules():
                for store in (module._parameters, module._buffers):
                    for attr, t in store.items():
                        if t is None:
                            continue
                        layout.append((store, attr, size, t))
                        size = _align(size + t.numel() * t.element_size())
                        kind = category(f"{path}.{attr}")
                        self.bytes_by_category[kind] = self.bytes_by_category.get(kind, 0) + t.nbytes
            host = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
            for _, _, offset, t in layout:
                host[offset:offset + t.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
            self.hosts.append(host)
            layouts.append([(store, attr, offset, t.dtype, t.shape, isinstance(t, nn.Parameter))
                            for store, attr, offset, t, in layout])
        self.layer_bytes = [h.numel() for h in self.hosts]
        slot_bytes = max(self.layer_bytes)
        n_slots = min(slots, len(self.order))
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        # views[j][s]: what layer j's modules hold while j lives in slot s
        self.views = [[[(store, attr, self._view(s, offset, dtype, shape, param))
                        for store, attr, offset, dtype, shape, param in layout] for s in range(n_slots)]
                      for layout in layouts]
        for j in range(len(self.order)):  # drop the loaded copies: the host buffers are the weights now
            self._bind(j, j % n_slots)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in self.slots]
            self.free = [torch.cuda.Event() for _ in self.slots]
        else:  # the CPU's "copy stream": one thread, copies in issue order; a future per slot
            self.copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="umakit-stream")
            self.copies: list[Future | None] = [None] * n_slots
        self.queue: deque[tuple[int, int]] = deque()  # (layer position, slot) copied or in flight, in order
        self.next = 0  # the next layer position to copy, cyclic
        self.issued = 0  # copies issued so far; slot = issued % slots
        self.copied_bytes = 0  # host -> device bytes issued since creation

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied host -> device per forward pass: whole layers (`umakit.plan.placement.WHOLE_LAYERS`)."""
        return streamed_bytes_per_token([LayerBytes(n) for n in self.layer_bytes], WHOLE_LAYERS)

    @property
    def ring_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _view(self, s: int, offset: int, dtype, shape, param: bool):
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        t = self.slots[s][offset:offset + nbytes].view(dtype).view(shape)
        return nn.Parameter(t, requires_grad=False) if param else t

    def _bind(self, j: int, s: int) -> None:
        for store, attr, view in self.views[j][s]:
            store[attr] = view

    def _issue(self) -> None:
        j, s = self.next, self.issued % len(self.slots)
        self._bind(j, s)
        n = self.layer_bytes[j]
        if self.cuda:
            self.copy_stream.wait_event(self.free[s])  # the slot's previous layer has finished reading it
            with torch.cuda.stream(self.copy_stream):
                self.slots[s][:n].copy_(self.hosts[j], non_blocking=True)
            self.ready[s].record(self.copy_stream)
        else:  # layer j - slots has finished with slot s: compute is synchronous on CPU
            self.copies[s] = self.copier.submit(_copy, self.slots[s][:n], self.hosts[j])
        self.queue.append((j, s))
        self.next = (j + 1) % len(self.order)
        self.issued += 1
        self.copied_bytes += n

    def before(self, layer: int) -> None:
        """Called before block ``layer`` runs: make sure its weights are (being) copied, and order after them."""
        j = self.position.get(layer)
        if j is None:
            return
        if self.queue and self.queue[0][0] != j:
            self._restart(j)  # a forward pass was cut short (an error): start the ring again here
        if not self.queue:
            self.next = j
        while len(self.queue) < len(self.slots):
            self._issue()
        s = self.queue[0][1]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[s])
        else:
            self.copies[s].result()

    def after(self, layer: int) -> None:
        """Called after block ``layer`` is queued: free its slot for the layer ``slots`` ahead."""
        j = self.position.get(layer)
        if j is None:
            return
        _, s = self.queue.popleft()
        if self.cuda:
            self.free[s].record(torch.cuda.current_stream(self.device))
        self._issue()

    def _restart(self, j: int) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        else:
            for copy in self.copies:
                if copy is not None:
                    copy.result()
        self.queue.clear()
        self.next = j



def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.inference_mode():  # the slots are inference tensors
        dst.copy_(src)
