"""Which weights stay in VRAM and which stream over PCIe: the offload planner (pure arithmetic).

A model that does not fit a discrete GPU keeps, in VRAM, what every step
needs anyway (the embeddings, the output head, the final norm, the KV cache,
working memory) and then as much of the layers as fits, from the first one on.
The rest lives in pinned host memory and is copied in as a step needs it,
through device buffers (`RING_SLOTS` of them) that are part of the VRAM bill.
The decode ceiling is then 1 / (resident bytes / VRAM bandwidth + streamed
bytes / PCIe bandwidth). What the budget holds besides weights
(`reserved_bytes`) is counted as `umakit plan` counts it (`umakit.plan.shapes`),
for `shapes.KV_RESERVE_TOKENS` tokens.

Two placements, both run by the torch engine, and `streamed_bytes_per_token`
counts what each copies per decode step (plan and the engine's stats both call it):

* `WHOLE_LAYERS` (`plan_layers`; dense models): the first ``--gpu-layers``
  layers stay resident, and each other layer crosses the link whole every step.
* `ROUTED_EXPERTS` (`plan_experts`; mixture-of-experts models): attention,
  norms, routers and shared experts of every layer stay resident, and so do
  the routed experts of the first ``--gpu-layers`` layers; the other layers'
  routed experts live in host memory and a step copies only the experts its
  tokens picked (`expected_active_experts` of them per layer). Streaming such
  a layer whole would copy every expert.

`StreamCounters` is what an engine counts as it copies (bytes, and the hits of
the experts it keeps cached on the device); `StreamedRun` is a stretch of
decoding's share of those counts, per token.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Sequence

from umakit.errors import DoesNotFitError, InvalidArgumentError
from umakit.plan.shapes import KV_RESERVE_TOKENS, ModelShape, kv_cache_bytes, working_bytes

RING_SLOTS = 3  # device buffers for streamed layers: one computing, two in flight
WHOLE_LAYERS = "layers"  # offloaded layers stream whole, every expert included
ROUTED_EXPERTS = "experts"  # only the routed experts a step picks stream
PLACEMENTS = (WHOLE_LAYERS, ROUTED_EXPERTS)
# Memory is sold in binary units written "GB" (an "RTX 4090 24GB" holds 24 GiB), so a memory size
# reads the same way: "--vram-budget 24GB" is that card's 24GB, and the tables print it as 24.00 GiB.
_UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int | float) -> int:
    """Bytes from "24GB", "23.5 GiB", "512MB" or a plain number of bytes (GB = GiB = 2^30, as memory is sold)."""
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


@dataclass
class StreamCounters:
    """What an offloading engine has copied host -> device since it loaded; it adds to these as it runs."""

    copied_bytes: int = 0
    lookups: int = 0  # experts asked for while a device cache is kept (per call and projection, each once)
    hits: int = 0  # of those, already in the device cache

    @property
    def hit_rate(self) -> float | None:
        """Share of the experts asked for that the device cache held (None: nothing asked of a cache)."""
        return self.hits / self.lookups if self.lookups else None

    def snapshot(self) -> StreamCounters:
        return replace(self)

    def since(self, earlier: StreamCounters, tokens: int) -> StreamedRun:
        """What was copied since ``earlier`` (a `snapshot`), over the ``tokens`` decoded meanwhile."""
        if tokens < 1:
            raise InvalidArgumentError(f"a streamed run needs at least one token (got {tokens})")
        lookups, hits = self.lookups - earlier.lookups, self.hits - earlier.hits
        return StreamedRun((self.copied_bytes - earlier.copied_bytes) / tokens,
                           hits / lookups if lookups else None)


@dataclass(frozen=True)
class StreamedRun:
    """A stretch of decoding, as the engine's copy counters saw it."""

    bytes_per_token: float  # copied host -> device, per token decoded
    hit_rate: float | None = None  # experts found in the device cache / asked for (None: no cache kept)


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
    placement: str = WHOLE_LAYERS  # ROUTED_EXPERTS: the "layers" above are the layers whose experts stay resident
    # What the engine has copied since it loaded (None: planned only, or an engine that does not count)
    counters: StreamCounters | None = field(default=None, compare=False)

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
                "budget_bytes": self.budget_bytes, "placement": self.placement}


@dataclass(frozen=True)
class LayerBytes:
    """One transformer layer's weights as the placements split them."""

    dense: int  # what every token uses: attention, norms, router, shared experts (a dense layer: all of it)
    expert: int = 0  # one routed expert's weights
    experts: int = 0  # routed experts in the layer (0: a dense layer)

    @property
    def total(self) -> int:
        return self.dense + self.experts * self.expert


def expected_active_experts(experts: int, per_token: int, batch: int = 1) -> float:
    """Distinct experts a decode step touches when ``batch`` tokens each route to ``per_token`` of
    ``experts``, independently and uniformly (batch 1: exactly ``per_token``)."""
    if not experts:
        return 0.0
    return experts * (1 - (1 - per_token / experts) ** batch)


def streamed_bytes_per_token(streamed: Sequence[LayerBytes], placement: str = WHOLE_LAYERS,
                             active_experts: float = 0.0) -> int:
    """Bytes one decode step copies host -> device for the ``streamed`` layers under ``placement``.

    `WHOLE_LAYERS`: every byte of each streamed layer. `ROUTED_EXPERTS`: ``active_experts`` experts of
    each streamed layer (`expected_active_experts`), its dense part being resident.
    """
    if placement == WHOLE_LAYERS:
        return int(sum(layer.total for layer in streamed))
    if placement == ROUTED_EXPERTS:
        return int(round(sum(min(active_experts, layer.experts) * layer.expert for layer in streamed)))
    raise InvalidArgumentError(f"unknown placement {placement!r}; choose {' or '.join(PLACEMENTS)}")


def reserve_tokens(config: dict) -> int:
    """The context a GPU engine reserves KV for when it places layers: `KV_RESERVE_TOKENS`, or the
    model's whole context when that is shorter."""
    cfg = {**config, **(config.get("text_config") or {})}
    limit = cfg.get("max_position_embeddings")
    return min(int(limit), KV_RESERVE_TOKENS) if isinstance(limit, int) and limit > 0 else KV_RESERVE_TOKENS


def reserved_bytes(config: dict, context: int | None = None) -> int:
    """VRAM one sequence needs besides the weights: its 16-bit KV cache at ``context`` tokens and
    the working memory of a prefill chunk, from config.json's shapes (as `umakit plan` counts them).
    ``context`` None: what the engine reserves (`reserve_tokens`)."""
    context = reserve_tokens(config) if context is None else context
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
        streamed_bytes=streamed_bytes_per_token([LayerBytes(b) for b in streamed]),
        ring_bytes=int(slots * max(streamed, default=0)),
        reserved_bytes=int(reserved_bytes),
        budget_bytes=vram_budget,
    )


def plan_experts(layers: Sequence[LayerBytes], fixed_bytes: int, *, vram_budget: int, reserved_bytes: int = 0,
                 active_experts: float, ring_slots: int = RING_SLOTS) -> OffloadPlan:
    """The `ROUTED_EXPERTS` placement of a mixture-of-experts model within ``vram_budget``.

    Resident: ``fixed_bytes``, every layer's dense part, the reserve and a ring of ``ring_slots``
    buffers of one layer's active experts; then the routed experts of as many leading layers as fit.
    The other layers' experts live in host memory and a step copies the ``active_experts`` it picked.
    """
    if not any(layer.experts for layer in layers):
        raise InvalidArgumentError("routed-expert offload needs a mixture-of-experts model")
    if vram_budget <= 0:
        raise InvalidArgumentError(f"a VRAM budget must be positive (got {vram_budget})")
    dense = int(fixed_bytes + sum(layer.dense for layer in layers))
    expert_bytes = [layer.experts * layer.expert for layer in layers]
    slot = math.ceil(active_experts) * max(layer.expert for layer in layers)
    keep = _layers_within(expert_bytes, dense, reserved_bytes, vram_budget, ring_slots, slot,
                          ("every layer's attention, norms and router, embeddings and head", "layer's picked experts"))
    slots = min(ring_slots, len(layers) - keep)
    return OffloadPlan(
        resident_layers=tuple(range(keep)),
        offloaded_layers=tuple(range(keep, len(layers))),
        fixed_bytes=dense,
        resident_bytes=int(dense + sum(expert_bytes[:keep])),
        streamed_bytes=streamed_bytes_per_token(layers[keep:], ROUTED_EXPERTS, active_experts),
        ring_bytes=int(slots * slot),
        reserved_bytes=int(reserved_bytes),
        budget_bytes=vram_budget,
        placement=ROUTED_EXPERTS,
    )


def _layers_within(layer_bytes, fixed_bytes, reserved_bytes, budget, ring_slots, slot_bytes=None,
                   names=("embeddings and head", "layer")) -> int:
    """The most leading layers that fit ``budget`` next to the fixed part, the reserve and the ring
    (``slot_bytes`` per ring buffer; default: the largest streamed layer). ``names``: of the fixed part
    and of what a buffer holds, for the error."""
    n = len(layer_bytes)
    if fixed_bytes + reserved_bytes + sum(layer_bytes) <= budget:
        return n  # everything fits: no ring needed
    for keep in range(n - 1, -1, -1):
        rest = layer_bytes[keep:]
        slot = max(rest) if slot_bytes is None else slot_bytes
        need = fixed_bytes + reserved_bytes + sum(layer_bytes[:keep]) + min(ring_slots, len(rest)) * slot
        if need <= budget:
            return keep
    minimum = fixed_bytes + reserved_bytes + min(ring_slots, n) * (max(layer_bytes) if slot_bytes is None
                                                                   else slot_bytes)
    raise DoesNotFitError(
        f"a VRAM budget of {_human(budget)} cannot hold even the resident minimum of {_human(minimum)} "
        f"({names[0]} {_human(fixed_bytes)}, KV cache and working memory {_human(reserved_bytes)}, "
        f"{min(ring_slots, n)} streaming buffers of one {names[1]} each); raise --vram-budget or use a more "
        "quantized model"
    )


def _human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
