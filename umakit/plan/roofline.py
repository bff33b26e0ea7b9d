"""Memory-bandwidth roofline for decoding: pure arithmetic, no framework imports.

Decoding one token reads every weight used by that step plus the whole KV cache
once, so tokens/s can never exceed ``peak bandwidth / bytes read per token``.
Bandwidths are in GB/s (1e9 bytes per second); sizes are in bytes.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from umakit.core.affine import FLOAT_BITS, KV_BITS, KV_GROUP_SIZE
from umakit.errors import InvalidArgumentError

GB = 1e9


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_bits: int | None = None,
    dtype_bytes: int = 2,
    group_size: int = KV_GROUP_SIZE,
) -> int:
    """Bytes of K and V cached per token: 2 x L x H_kv x D x bytes per element.

    ``kv_bits`` None (or 16) keeps the cache in a ``dtype_bytes`` float type.
    Quantized caches (``kv_bits`` in `umakit.core.affine.KV_BITS`) pack ``kv_bits`` per element and
    add one scale and one bias of ``dtype_bytes`` per group of ``group_size`` along the head dimension.
    """
    if min(num_layers, num_kv_heads, head_dim) <= 0:
        raise InvalidArgumentError(
            f"layers, KV heads and head dim must be positive (got {num_layers}, {num_kv_heads}, {head_dim})"
        )
    if kv_bits is None or kv_bits == FLOAT_BITS:
        per_head = head_dim * dtype_bytes
    elif kv_bits in KV_BITS:
        if group_size <= 0:
            raise InvalidArgumentError(f"KV group size must be positive (got {group_size})")
        groups = math.ceil(head_dim / group_size)
        per_head = math.ceil(head_dim * kv_bits / 8) + groups * 2 * dtype_bytes
    else:
        raise InvalidArgumentError(f"--kv-bits must be {FLOAT_BITS} or one of {KV_BITS} (got {kv_bits})")
    return 2 * num_layers * num_kv_heads * per_head


@dataclass(frozen=True)
class RooflineStats:
    """Decode-step bandwidth numbers for one measured (or planned) run."""

    bytes_per_token: float  # weights read per step + KV cache read at this context
    peak_gbps: float
    ceiling_tps: float  # peak / bytes per token
    achieved_gbps: float | None  # bytes per token x measured tok/s
    mbu: float | None  # memory-bandwidth utilisation: achieved / peak, 0..1
    device_name: str
    bandwidth_source: str  # "published" | "measured" | "user"
    comm_s_per_token: float = 0.0  # a sharded run: seconds each decode step waits on the link (measured at load)

    @property
    def comm_share(self) -> float:
        """The share of a decode step spent on the link, at the measured tok/s (0 when unsharded)."""
        return min(1.0, self.comm_s_per_token * self.achieved_gbps * 1e9 / self.bytes_per_token) \
            if self.comm_s_per_token and self.achieved_gbps and self.bytes_per_token else 0.0


def decode_roofline(
    weight_bytes_per_token: float,
    kv_bytes_per_token: float,
    context_tokens: int,
    tokens_per_s: float | None,
    peak_gbps: float,
    device_name: str,
    source: str,
) -> RooflineStats:
    """Roofline for decoding at ``context_tokens`` of cache; ``tokens_per_s`` None gives the ceiling only."""
    if peak_gbps <= 0:
        raise InvalidArgumentError(f"peak bandwidth must be positive (got {peak_gbps} GB/s)")
    if weight_bytes_per_token < 0 or kv_bytes_per_token < 0 or context_tokens < 0:
        raise InvalidArgumentError("bytes per token and context must not be negative")
    total = weight_bytes_per_token + kv_bytes_per_token * context_tokens
    if total <= 0:
        raise InvalidArgumentError("nothing is read per token: weight bytes and KV bytes are both zero")
    achieved = None if tokens_per_s is None else total * tokens_per_s / GB
    return RooflineStats(
        bytes_per_token=total,
        peak_gbps=peak_gbps,
        ceiling_tps=peak_gbps * GB / total,
        achieved_gbps=achieved,
        mbu=None if achieved is None else achieved / peak_gbps,
        device_name=device_name,
        bandwidth_source=source,
    )


def offload_ceiling_tps(
    resident_bytes: float, streamed_bytes: float, vram_gbps: float, pcie_gbps: float
) -> float:
    """Decode steps/s when ``resident_bytes`` are read from VRAM and ``streamed_bytes``
    cross PCIe each step: 1 / (resident / VRAM bw + streamed / PCIe bw)."""
    if vram_gbps <= 0 or pcie_gbps <= 0:
        raise InvalidArgumentError(f"bandwidths must be positive (got {vram_gbps}, {pcie_gbps} GB/s)")
    if resident_bytes < 0 or streamed_bytes < 0 or resident_bytes + streamed_bytes <= 0:
        raise InvalidArgumentError("resident and streamed bytes must be non-negative and not both zero")
    seconds = resident_bytes / (vram_gbps * GB) + streamed_bytes / (pcie_gbps * GB)
    return 1.0 / seconds


@dataclass(frozen=True)
class OffloadStats:
    """A decode run with some weights streamed over PCIe, against its two-link ceiling."""

    ceiling_tps: float  # 1 / (resident / memory bw + streamed / PCIe bw)
    pcie_gbps: float  # the link's measured rate
    achieved_pcie_gbps: float | None  # streamed bytes x measured tok/s
    efficiency: float | None  # measured tok/s / ceiling (overlap efficiency)
    streamed_bytes: float = 0.0  # bytes copied over the link per step
    placement: str = ""  # what streams: `umakit.plan.placement.WHOLE_LAYERS` or `ROUTED_EXPERTS` ("": not said)
    hit_rate: float | None = None  # routed experts: share found in the device cache (None: none kept)


def offload_ceiling(resident_bytes: float, streamed_bytes: float, memory_gbps: float, pcie_gbps: float,
                    tokens_per_s: float | None = None, placement: str = "",
                    hit_rate: float | None = None) -> OffloadStats:
    """The offload ceiling of one decode step and, given the measured tok/s, how close a run came."""
    ceiling = offload_ceiling_tps(resident_bytes, streamed_bytes, memory_gbps, pcie_gbps)
    return OffloadStats(
        ceiling_tps=ceiling,
        pcie_gbps=pcie_gbps,
        achieved_pcie_gbps=None if tokens_per_s is None else streamed_bytes * tokens_per_s / GB,
        efficiency=None if tokens_per_s is None else tokens_per_s / ceiling,
        streamed_bytes=streamed_bytes,
        placement=placement,
        hit_rate=hit_rate,
    )


def measure_decode(weight_bytes_per_token: float, streamed_bytes_per_token: float, kv_bytes_per_token: float,
                   context_tokens: int, tokens_per_s: float | None, device, placement: str = "",
                   hit_rate: float | None = None, comm_s_per_token: float = 0.0,
                   ) -> tuple[RooflineStats, OffloadStats | None]:
    """The one measurement of a decode run: its roofline and, when weights stream, its offload figures.

    ``placement`` and ``hit_rate`` (routed experts kept on the device) pass to the `OffloadStats`;
    ``comm_s_per_token`` (a sharded engine's link time per step) to the `RooflineStats`.

    ``device`` is a `umakit.hardware.DeviceInfo` (peak bandwidth, name, source, measured link rate).
    The streamed bytes are among the weights a step reads; what else it reads (the rest of the
    weights, the KV cache) comes from VRAM. Streamed bytes above the step's weight bytes (routed experts:
    the union a batch picked, against one token's) leave only the KV cache read from VRAM.
    Generation stats, bench runs and offload sweeps all take their numbers from here.
    """
    r = decode_roofline(weight_bytes_per_token, kv_bytes_per_token, context_tokens, tokens_per_s,
                        device.peak_bandwidth_gbps, device.name, device.bandwidth_source)
    r = dataclasses.replace(r, comm_s_per_token=comm_s_per_token)
    if (not streamed_bytes_per_token and hit_rate is None) or not device.pcie_h2d_gbps:
        return r, None  # nothing streams (an expert cache that held every pick still reports its hits)
    resident = r.bytes_per_token - min(streamed_bytes_per_token, weight_bytes_per_token)
    o = offload_ceiling(resident, streamed_bytes_per_token, device.peak_bandwidth_gbps, device.pcie_h2d_gbps,
                        tokens_per_s, placement, hit_rate)
    return r, o
