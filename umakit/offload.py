"""Which layers stay in VRAM and which stream over PCIe: the offload planner (pure arithmetic).

A model that does not fit a discrete GPU keeps, in VRAM, what every step
needs anyway (the embeddings, the output head, the final norm, the KV cache,
working memory) and then as many whole layers as fit, from the first one on.
The remaining layers live in pinned host memory; each forward pass copies
them, one after another, into a small ring of device buffers (`RING_SLOTS`
layers' worth), so the ring is part of the VRAM bill. The decode ceiling is
then 1 / (resident bytes / VRAM bandwidth + streamed bytes / PCIe bandwidth).
What the budget holds besides weights (`reserved_bytes`) is counted as
`umakit plan` counts it (`umakit.shapes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from .errors import DoesNotFitError, InvalidArgumentError
from .shapes import ModelShape, kv_cache_bytes, working_bytes

RING_SLOTS = 3  # device buffers for streamed layers: one computing, two in flight
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int | float) -> int:
    """Bytes from "24GB", "23.5 GiB", "512MB" or a plain number of bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise InvalidArgumentError(f"cannot read {text!r} as a size; write e.g. 24GB, 23.5GiB or 512MB")
        value = float(m.group(1))
    if value <= 0:
        raise InvalidArgumentError(f"a size must be positive (got {text!r})")
    return int(value * _UNITS[unit])


@dataclass(frozen=True)
class OffloadPlan:
    """Where each layer's weights live during generation."""

    resident_layers: tuple[int, ...]  # in VRAM for good: always the first ones
    offloaded_layers: tuple[int, ...]  # in host memory, copied in on every forward pass
    fixed_bytes: int  # embeddings, head, final norm: always resident
    resident_bytes: int  # all weights kept in VRAM (fixed + resident layers)
    streamed_bytes: int  # weights copied host -> device per forward pass
    ring_bytes: int  # device buffers the streamed layers pass through
    reserved_bytes: int  # KV cache and working memory set aside in the budget
    budget_bytes: int | None = None  # the VRAM budget it was planned for, if any

    @property
    def gpu_layers(self) -> int:
        return len(self.resident_layers)

    @property
    def layers(self) -> int:
        return len(self.resident_layers) + len(self.offloaded_layers)

    @property
    def vram_bytes(self) -> int:
        """What the plan puts in VRAM: resident weights, the ring, KV cache and working memory."""
        return self.resident_bytes + self.ring_bytes + self.reserved_bytes

    def to_dict(self) -> dict:
        return {"gpu_layers": self.gpu_layers, "layers": self.layers,
                "resident_bytes": self.resident_bytes, "streamed_bytes_per_token": self.streamed_bytes,
                "ring_bytes": self.ring_bytes, "reserved_bytes": self.reserved_bytes,
                "budget_bytes": self.budget_bytes}


def reserved_bytes(config: dict, context: int) -> int:
    """VRAM one sequence needs besides the weights: its 16-bit KV cache at ``context`` tokens and
    the working memory of a prefill chunk, from config.json's shapes (as `umakit plan` counts them)."""
    if context < 1:
        raise InvalidArgumentError(f"the context to reserve memory for must be at least 1 token (got {context})")
    shape = ModelShape.from_config(config)
    return kv_cache_bytes(shape, context) + working_bytes(shape, context)


def plan_layers(
    layer_bytes: Sequence[int],
    fixed_bytes: int,
    *,
    gpu_layers: int | None = None,
    vram_budget: int | None = None,
    reserved_bytes: int = 0,
    ring_slots: int = RING_SLOTS,
) -> OffloadPlan:
    """Keep the first ``gpu_layers`` layers resident, or as many as ``vram_budget`` holds.

    ``layer_bytes`` are each layer's weights; ``fixed_bytes`` the weights that
    never stream; ``reserved_bytes`` the KV cache and working memory the budget
    must also hold. ``gpu_layers`` above the layer count means all of them.
    """
    n = len(layer_bytes)
    if n == 0:
        raise InvalidArgumentError("the model has no layers to place")
    if (gpu_layers is None) == (vram_budget is None):
        raise InvalidArgumentError("give either --gpu-layers or --vram-budget (one of them)")
    if gpu_layers is not None:
        if gpu_layers < 0:
            raise InvalidArgumentError(f"--gpu-layers must be 0 or more (got {gpu_layers})")
        keep = min(gpu_layers, n)
    else:
        if vram_budget <= 0:
            raise InvalidArgumentError(f"a VRAM budget must be positive (got {vram_budget})")
        keep = _layers_within(layer_bytes, fixed_bytes, reserved_bytes, vram_budget, ring_slots)
    streamed = layer_bytes[keep:]
    slots = min(ring_slots, len(streamed))
    return OffloadPlan(
        resident_layers=tuple(range(keep)),
        offloaded_layers=tuple(range(keep, n)),
        fixed_bytes=int(fixed_bytes),
        resident_bytes=int(fixed_bytes + sum(layer_bytes[:keep])),
        streamed_bytes=int(sum(streamed)),
        ring_bytes=int(slots * max(streamed, default=0)),
        reserved_bytes=int(reserved_bytes),
        budget_bytes=vram_budget,
    )


def _layers_within(layer_bytes, fixed_bytes, reserved_bytes, budget, ring_slots) -> int:
    """The most leading layers that fit ``budget`` next to the fixed part, the reserve and the ring."""
    n = len(layer_bytes)
    if fixed_bytes + reserved_bytes + sum(layer_bytes) <= budget:
        return n  # everything fits: no ring needed
    for keep in range(n - 1, -1, -1):
        rest = layer_bytes[keep:]
        need = fixed_bytes + reserved_bytes + sum(layer_bytes[:keep]) + min(ring_slots, len(rest)) * max(rest)
        if need <= budget:
            return keep
    minimum = fixed_bytes + reserved_bytes + min(ring_slots, n) * max(layer_bytes)
    raise DoesNotFitError(
        f"a VRAM budget of {_human(budget)} cannot hold even the resident minimum of {_human(minimum)} "
        f"(embeddings and head {_human(fixed_bytes)}, KV cache and working memory {_human(reserved_bytes)}, "
        f"{min(ring_slots, n)} streaming buffers of one layer each); raise --vram-budget or use a more quantized model"
    )


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
