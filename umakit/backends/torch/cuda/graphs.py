"""The CUDA decode step as a CUDA graph, one per cache buffer and attention span.

Nothing here touches CUDA at import time. `GraphDecoder(capture=False)` runs
the same static decode step eagerly, which is how its logic is tested on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

SPAN_MIN = 256  # smallest attention span of a captured decode step; spans double from here
MAX_GRAPHS = 8  # captured graphs kept per engine (spans of the caches in use)


class GraphDecoder:
    """One decode step (a single token) captured as a CUDA graph per cache buffer and attention span.

    The step attends to a fixed span of cache slots (256, 512, 1024, ...) under
    a mask, so a graph serves every position inside its span; the inputs are
    copied into static tensors on the device, so no step waits for the host.
    """

    def __init__(self, model: nn.Module, capture: bool = True):
        self.model = model
        self.capture = capture
        self.graphs: dict[tuple, tuple] = {}  # cache layout and span -> (graph, token, position, logits)
        self.pool = None

    def __call__(self, token: torch.Tensor, cache) -> torch.Tensor:
        """Logits (1, V) of ``token`` (1,) appended to ``cache``."""
        span = SPAN_MIN
        while span < cache.offset + 1:
            span *= 2
        cache.reserve(max(1, min(span, cache.max_tokens) - cache.offset))  # grow a whole span at once
        span = min(span, cache.capacity)
        if not self.capture:
            position = torch.full((1,), cache.offset, dtype=torch.long, device=token.device)
            out = self.model(token.view(1, 1), position, cache, static=span)[:, -1]
            cache.advance(1)
            return out
        # The layout of the cache buffers is baked into a graph: key on all of it.
        key = (cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, span)
        if key not in self.graphs:
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = self._capture(token, cache, span)
        graph, static_token, position, logits = self.graphs[key]
        static_token.copy_(token.view(1, 1))
        position.fill_(cache.offset)
        graph.replay()
        cache.advance(1)
        return logits

    def _capture(self, token: torch.Tensor, cache, span: int):
        static_token = token.view(1, 1).clone()
        position = torch.full((1,), cache.offset, dtype=torch.long, device=token.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (Triton autotuning, cuBLAS handles) outside the capture
            for _ in range(2):
                self.model(static_token, position, cache, static=span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(static_token, position, cache, static=span)[:, -1]
        self.pool = graph.pool()
        return graph, static_token, position, logits
