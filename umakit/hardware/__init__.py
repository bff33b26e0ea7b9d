"""Device facts: chip name, peak memory bandwidth, memory and GPU working set.

Four concerns, one module each: `chips` (the `DeviceInfo` record and the published-bandwidth
table), `local` (this machine, what is free on it, what fits, and the per-machine probe cache),
`metal` (the Apple GPU's facts as MLX reports them) and `probes` (the bandwidth measurements).
The names other modules use are re-exported here.
"""

from umakit.hardware.chips import CHIPS, ChipSpec, DeviceInfo, DeviceSpec, GiB, default_working_set, find_chip, lookup_device
from umakit.hardware.local import (
    CACHE_FILE,
    CACHE_VERSION,
    CPU_KV_FRACTION,
    NEAR_LIMIT,
    available_ram,
    cpu_kv_budget,
    detect_local,
    h2d_bandwidth,
    memory_budget,
    memory_warnings,
    vm_stat_available,
    wired_limit_advice_mb,
)
from umakit.hardware.metal import metal_device_info, metal_working_set

__all__ = [
    "CACHE_FILE", "CACHE_VERSION", "CHIPS", "CPU_KV_FRACTION", "ChipSpec", "DeviceInfo", "DeviceSpec", "GiB",
    "NEAR_LIMIT", "available_ram", "cpu_kv_budget", "default_working_set", "detect_local", "find_chip",
    "h2d_bandwidth", "lookup_device", "memory_budget", "memory_warnings", "metal_device_info", "metal_working_set",
    "vm_stat_available", "wired_limit_advice_mb",
]
