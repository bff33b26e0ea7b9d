"""Mixture-of-experts offload: routed experts in host memory, only the picked ones copied each step.

The `ROUTED_EXPERTS` placement of umakit/plan/placement.py: attention, norms and
routers of every layer stay on the device, and so do the experts of the first
layers that fit; the experts of the other layers live in host memory (pinned
on CUDA). A forward pass copies, per layer and projection, only the experts
its tokens were routed to (decode: the union over the batch), each once; an
optional cache (``cached`` experts per projection) keeps the most recently
used ones on the device. Whole-layer streaming (offload/layers.py) would copy every
expert of a layer. What it copies, and the cache's hits, go to a
`umakit.plan.placement.StreamCounters` that the engine's offload plan carries.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
from torch import nn

from umakit.errors import InvalidArgumentError
from umakit.plan.placement import (
    ROUTED_EXPERTS,
    LayerBytes,
    OffloadPlan,
    StreamCounters,
    parse_size,
    plan_experts,
    reserved_bytes,
    streamed_bytes_per_token,
)
from umakit.backends.torch.model.moe import Experts, expert_slot

TENSORS = ("weight", "scales", "biases", "bias")


def plan_expert_offload(args, shapes: dict, weights: torch.dtype, gpu_layers: int | None, vram_budget,
                        config: dict) -> OffloadPlan:
    """Which layers' experts stay resident, from the checkpoint's tensor sizes in the execution dtype."""
    n = args.num_hidden_layers
    dense, experts, fixed = [0] * n, [0] * n, 0
    for name, shape in shapes.items():
        count = int(np.prod(shape))
        base = name.rsplit(".", 1)[0]
        packed = name.endswith(".weight") and f"{base}.scales" in shapes
        nbytes = count * (4 if packed else 2 if name.endswith((".scales", ".biases")) else weights.itemsize)
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is None:
            fixed += nbytes
        elif expert_slot(name) is not None or ".switch_mlp." in name:
            experts[layer] += nbytes
        else:
            dense[layer] += nbytes
    sparse = set(args.moe_layers)
    layers = [LayerBytes(dense[i], experts[i] // args.num_experts if i in sparse else 0,
                         args.num_experts if i in sparse else 0) for i in range(n)]
    reserve = reserved_bytes(config)
    k = args.num_experts_per_tok
    if (gpu_layers is None) == (vram_budget is None):
        raise InvalidArgumentError("give either --gpu-layers or --vram-budget (one of them)")
    if vram_budget is not None:
        return plan_experts(layers, fixed, vram_budget=parse_size(vram_budget), reserved_bytes=reserve,
                            active_experts=k)
    if gpu_layers < 0:
        raise InvalidArgumentError(f"--gpu-layers must be 0 or more (got {gpu_layers})")
    keep = min(gpu_layers, n)
    all_dense = fixed + sum(layer.dense for layer in layers)
    return OffloadPlan(
        resident_layers=tuple(range(keep)), offloaded_layers=tuple(range(keep, n)), fixed_bytes=all_dense,
        resident_bytes=all_dense + sum(layer.total - layer.dense for layer in layers[:keep]),
        streamed_bytes=streamed_bytes_per_token(layers[keep:], ROUTED_EXPERTS, k),
        ring_bytes=0, reserved_bytes=reserve, placement=ROUTED_EXPERTS)


class ExpertStreamer:
    """Serves the experts of the ``streamed`` layers from host memory to ``device``, copying the picked ones.

    ``cached`` experts per projection are kept on the device, most recently used first.
    """

    def __init__(self, layers: nn.ModuleList, streamed: Sequence[int], device: torch.device, cached: int = 0):
        self.device, self.cached = device, cached
        self.position = {layer: j for j, layer in enumerate(streamed)}
        self.counters = StreamCounters()  # host -> device bytes since creation; the device cache's hits
        self.host_bytes = 0
        self._hosts: dict[int, dict[str, torch.Tensor]] = {}
        self._cache: dict[int, OrderedDict] = {}
        for i in streamed:
            for module in layers[i].modules():
                if isinstance(module, Experts):
                    self._hold(module)

    def _hold(self, module: Experts) -> None:
        pin = self.device.type == "cuda"
        host = {}
        for name in TENSORS:
            store = module._parameters if name in module._parameters else module._buffers
            t = store.get(name)
            if t is None:
                continue
            host[name] = t.detach().to("cpu").pin_memory() if pin else t.detach().to("cpu")
            store[name] = host[name]  # the module holds no device copy; `rows` serves it
            self.host_bytes += t.nbytes
        self._hosts[id(module)] = host
        self._cache[id(module)] = OrderedDict()
        module.streamer = self

    def rows(self, module: Experts, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of experts ``idx`` (1-D) of ``module`` on the device, (len(idx), ...) each."""
        ids = idx.tolist()  # the router's picks decide the copies: a host sync, as any offload step has
        host, cache = self._hosts[id(module)], self._cache[id(module)]
        counts = self.counters
        for e in dict.fromkeys(ids):
            if self.cached:  # a hit rate only where experts are kept
                counts.lookups += 1
                counts.hits += e in cache
            if e in cache:
                cache.move_to_end(e)
                continue
            cache[e] = {k: t[e].to(self.device, non_blocking=True) for k, t in host.items()}
            counts.copied_bytes += sum(t[e].nbytes for t in host.values())
        out = {k: torch.stack([cache[e][k] for e in ids]) for k in host}
        while len(cache) > self.cached:
            cache.popitem(last=False)
        return out

    @property
    def copied_bytes(self) -> int:
        """Host -> device bytes since creation."""
        return self.counters.copied_bytes

    @property
    def hit_rate(self) -> float | None:
        """Share of the experts asked for that the device cache held (None while it keeps none)."""
        return self.counters.hit_rate
