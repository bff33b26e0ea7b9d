"""What is known about a device before touching it: the `DeviceInfo` record, the table of
published peak bandwidths (``CHIPS``), and name matching against it.

Pure data and string parsing: no system calls, no probes. Bandwidths are GB/s
(1e9 bytes per second).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from umakit.errors import InvalidArgumentError

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceInfo:
    """What umakit knows about one device; the same type serves measured and reference devices."""

    name: str
    kind: str  # "apple" | "nvidia" | "cpu"
    peak_bandwidth_gbps: float
    bandwidth_source: str  # "published" | "measured" | "user"
    memory_bytes: int  # total RAM (Apple, CPU) or VRAM (NVIDIA)
    working_set_bytes: int | None = None  # Apple: GPU recommended max working set
    pcie_h2d_gbps: float | None = None  # measured host-to-device copy bandwidth
    pcie_gen: int | None = None  # host link of a discrete GPU
    gpu_cores: int | None = None

    @property
    def usable_bytes(self) -> int:
        """Memory a model may occupy: the working set on Apple, all of VRAM or RAM elsewhere."""
        return self.working_set_bytes or self.memory_bytes


DeviceSpec = DeviceInfo


@dataclass(frozen=True)
class ChipSpec:
    """One row of the published-bandwidth table."""

    name: str
    kind: str
    peak_gbps: float
    tokens: tuple[str, ...]  # every one must appear in a device name to match
    gpu_cores: int | None = None  # set where the bandwidth depends on the GPU bin
    memory_gb: tuple[int, ...] = ()  # configurations sold (Apple) or VRAM (NVIDIA)
    pcie_gen: int | None = None


def _apple(name, gbps, tokens, memory, cores=None):
    return ChipSpec(f"Apple {name}", "apple", gbps, tokens, cores, memory)


def _nv(name, gbps, tokens, memory, pcie_gen):
    return ChipSpec(f"NVIDIA {name}", "nvidia", gbps, tokens, None, memory, pcie_gen)


# Where bandwidth depends on the GPU bin the full chip is listed first: it is
# the answer when neither the core count nor the memory size tells them apart.
CHIPS: tuple[ChipSpec, ...] = (
    # Apple: newsroom announcements and Mac tech-specs pages.
    _apple("M1", 68.25, ("m1",), (8, 16)),  # LPDDR4X-4266 x 128-bit; Apple: "M2 ... 50% more than M1"
    _apple("M1 Pro", 200, ("m1", "pro"), (16, 32)),  # newsroom 2021-10-18
    _apple("M1 Max", 400, ("m1", "max"), (32, 64)),  # newsroom 2021-10-18
    _apple("M1 Ultra", 800, ("m1", "ultra"), (64, 128)),  # newsroom 2022-03-08
    _apple("M2", 100, ("m2",), (8, 16, 24)),  # newsroom 2022-06-06
    _apple("M2 Pro", 200, ("m2", "pro"), (16, 32)),  # newsroom 2023-01-17
    _apple("M2 Max", 400, ("m2", "max"), (32, 64, 96)),  # newsroom 2023-01-17
    _apple("M2 Ultra", 800, ("m2", "ultra"), (64, 128, 192)),  # newsroom 2023-06-05
    _apple("M3", 100, ("m3",), (8, 16, 24)),  # MacBook Pro (M3) tech specs, 2023-10
    _apple("M3 Pro", 150, ("m3", "pro"), (18, 36)),  # MacBook Pro tech specs, 2023-10
    _apple("M3 Max 40-core GPU", 400, ("m3", "max"), (48, 64, 128), 40),  # tech specs, 2023-10
    _apple("M3 Max 30-core GPU", 300, ("m3", "max"), (36, 96), 30),  # tech specs, 2023-10
    _apple("M3 Ultra", 819, ("m3", "ultra"), (96, 256, 512)),  # newsroom 2025-03-05
    _apple("M4", 120, ("m4",), (16, 24, 32)),  # newsroom 2024-05-07
    _apple("M4 Pro", 273, ("m4", "pro"), (24, 48, 64)),  # newsroom 2024-10-30
    _apple("M4 Max 40-core GPU", 546, ("m4", "max"), (48, 64, 128), 40),  # newsroom 2024-10-30
    _apple("M4 Max 32-core GPU", 410, ("m4", "max"), (36,), 32),  # MacBook Pro tech specs, 2024-10
    _apple("M5", 153, ("m5",), (16, 24, 32)),  # newsroom 2025-10-15
    _apple("M5 Pro", 307, ("m5", "pro"), (24, 48, 64)),  # newsroom 2026-03-03
    _apple("M5 Max 40-core GPU", 614, ("m5", "max"), (48, 64, 128), 40),  # newsroom 2026-03-03
    # 460 GB/s is from third-party spec listings (Apple: "up to 614"); check before relying on it.
    _apple("M5 Max 32-core GPU", 460, ("m5", "max"), (), 32),
    # NVIDIA: product pages and datasheets; PCIe generation of the host link.
    _nv("RTX 3060", 360, ("3060",), (12,), 4),  # GeForce RTX 30 series specs (the 12 GB card)
    _nv("RTX 3060 8GB", 240, ("3060",), (8,), 4),  # 128-bit bus
    _nv("RTX 3060 Ti", 448, ("3060", "ti"), (8,), 4),
    _nv("RTX 3070", 448, ("3070",), (8,), 4),
    _nv("RTX 3070 Ti", 608, ("3070", "ti"), (8,), 4),
    _nv("RTX 3080", 760, ("3080",), (10,), 4),
    _nv("RTX 3080 12GB", 912, ("3080",), (12,), 4),
    _nv("RTX 3080 Ti", 912, ("3080", "ti"), (12,), 4),
    _nv("RTX 3090", 936, ("3090",), (24,), 4),
    _nv("RTX 3090 Ti", 1008, ("3090", "ti"), (24,), 4),
    _nv("RTX 4060 Ti", 288, ("4060", "ti"), (8, 16), 4),  # GeForce RTX 40 series specs
    _nv("RTX 4060", 272, ("4060",), (8,), 4),
    _nv("RTX 4070", 504, ("4070",), (12,), 4),
    _nv("RTX 4070 Super", 504, ("4070", "super"), (12,), 4),
    _nv("RTX 4070 Ti", 504, ("4070", "ti"), (12,), 4),
    _nv("RTX 4070 Ti Super", 672, ("4070", "ti", "super"), (16,), 4),
    _nv("RTX 4080", 716.8, ("4080",), (16,), 4),
    _nv("RTX 4080 Super", 736, ("4080", "super"), (16,), 4),
    _nv("RTX 4090", 1008, ("4090",), (24,), 4),
    _nv("RTX 5080", 960, ("5080",), (16,), 5),  # GeForce RTX 50 series specs
    _nv("RTX 5090", 1792, ("5090",), (32,), 5),
    _nv("RTX A6000", 768, ("a6000",), (48,), 4),  # RTX A6000 datasheet
    _nv("RTX 6000 Ada", 960, ("6000", "ada"), (48,), 4),  # RTX 6000 Ada datasheet
    _nv("RTX PRO 6000 Blackwell", 1792, ("pro", "6000", "blackwell"), (96,), 5),  # GTC 2025
    _nv("RTX PRO 6000 Blackwell Max-Q", 1792, ("pro", "6000", "blackwell", "max", "q"), (96,), 5),
    _nv("V100", 900, ("v100",), (16, 32), 3),  # V100 datasheet (SXM2 and PCIe)
    _nv("T4", 320, ("t4",), (16,), 3),  # T4 datasheet
    _nv("A10", 600, ("a10",), (24,), 4),  # A10 datasheet
    _nv("A10G", 600, ("a10g",), (24,), 4),  # AWS G5 (A10G)
    _nv("A40", 696, ("a40",), (48,), 4),  # A40 datasheet
    _nv("A100 80GB SXM", 2039, ("a100",), (80,), 4),  # A100 datasheet
    _nv("A100 40GB", 1555, ("a100",), (40,), 4),
    _nv("A100 80GB PCIe", 1935, ("a100", "pcie"), (80,), 4),
    _nv("A100 40GB PCIe", 1555, ("a100", "pcie"), (40,), 4),
    _nv("L4", 300, ("l4",), (24,), 4),  # L4 datasheet
    _nv("L40", 864, ("l40",), (48,), 4),  # L40 datasheet
    _nv("L40S", 864, ("l40s",), (48,), 4),  # L40S datasheet
    _nv("H100 SXM", 3350, ("h100",), (80,), 5),  # H100 datasheet; torch names it "H100 80GB HBM3"
    _nv("H100 PCIe", 2000, ("h100", "pcie"), (80,), 5),  # H100 PCIe product brief PB-11133
    _nv("H100 NVL", 3900, ("h100", "nvl"), (94,), 5),  # H100 datasheet
    _nv("H200", 4800, ("h200",), (141,), 5),  # H200 datasheet (SXM)
    _nv("H200 NVL", 4800, ("h200", "nvl"), (141,), 5),
    _nv("B200", 8000, ("b200",), (180,), 5),  # HGX B200 datasheet
)

# Words that name a different product when a row does not list them
# ("RTX 4090 Laptop GPU" is not an RTX 4090; "M2 Pro" is not an M2).
_VARIANT_WORDS = {"ti", "super", "laptop", "mobile", "max", "q", "d", "pro", "ultra", "nvl", "pcie", "ada"}
_VENDOR_WORDS = {"apple", "nvidia", "geforce", "tesla", "quadro"}


def _words(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower())) - _VENDOR_WORDS


def _parse_gpu_cores(name: str) -> int | None:
    found = re.findall(r"(\d+)[\s-]*core(?:s)?(?:\s+(gpu|cpu))?", name.lower())
    gpu = [int(n) for n, unit in found if unit == "gpu"]
    if gpu:
        return gpu[0]
    bare = [int(n) for n, unit in found if not unit]
    return bare[0] if len(bare) == 1 and not any(unit == "cpu" for _, unit in found) else None


def _parse_memory_gb(name: str) -> int | None:
    m = re.search(r"(\d+)\s*gb\b", name.lower())
    return int(m.group(1)) if m else None


def find_chip(name: str, gpu_cores: int | None = None, memory_bytes: int | None = None) -> ChipSpec | None:
    """The table row for a device name ("Apple M2 Ultra", "NVIDIA H100 80GB HBM3"), or None.

    GPU cores and memory size, given or read from the name ("M4 Max 40-core GPU",
    "A100-SXM4-40GB"), pick between rows whose bandwidth depends on them.
    """
    words = _words(name)
    matches = [c for c in CHIPS if set(c.tokens) <= words and not (words & _VARIANT_WORDS) - set(c.tokens)]
    if not matches:
        return None
    best = max(len(c.tokens) for c in matches)
    matches = [c for c in matches if len(c.tokens) == best]
    cores = gpu_cores if gpu_cores is not None else _parse_gpu_cores(name)
    if cores is not None:
        matches = [c for c in matches if c.gpu_cores in (None, cores)]
        if not matches:
            return None
    memory_gb = _parse_memory_gb(name)
    if memory_gb is None and memory_bytes:
        memory_gb = memory_bytes / GiB
    if memory_gb is not None and len(matches) > 1:
        return min(matches, key=lambda c: min((abs(m - memory_gb) for m in c.memory_gb), default=math.inf))
    return matches[0]


def default_working_set(memory_bytes: int) -> int:
    """Metal's recommended max working set when it cannot be queried.

    Values logged by llama.cpp on Apple Silicon: 2/3 of RAM up to 32 GiB
    (16 GiB -> 10922.67 MiB, 32 GiB -> 21845.34 MiB) and 3/4 above
    (48 -> 36 GiB, 64 -> 48 GiB, 96 -> 72 GiB). Recent macOS gives more on
    large machines (128 GiB -> 107.5 GiB), so this errs low.
    """
    return memory_bytes * 2 // 3 if memory_bytes <= 32 * GiB else memory_bytes * 3 // 4


def _device_from_chip(chip: ChipSpec, memory_bytes: int, name: str | None = None) -> DeviceInfo:
    return DeviceInfo(
        name=name or chip.name,
        kind=chip.kind,
        peak_bandwidth_gbps=float(chip.peak_gbps),
        bandwidth_source="published",
        memory_bytes=memory_bytes,
        working_set_bytes=default_working_set(memory_bytes) if chip.kind == "apple" else None,
        pcie_gen=chip.pcie_gen,
        gpu_cores=chip.gpu_cores,
    )


def lookup_device(name: str) -> DeviceInfo:
    """A reference device by name, e.g. "M2 Ultra 192GB", "M4 Max 128GB", "RTX 4090 24GB", "H100 80GB".

    The memory size in the name sets ``memory_bytes`` (GB as sold: GiB, 2^30 bytes) and must be one
    the chip is sold with; without one the largest configuration sold is used.
    """
    chip = find_chip(name)
    if chip is None:
        known = ", ".join(c.name.split(" ", 1)[1] for c in CHIPS)
        raise InvalidArgumentError(f"unknown device {name!r}; known (add a size like '128GB'): {known}")
    given = _parse_memory_gb(name)
    memory_gb = given or max(chip.memory_gb, default=0)
    if not memory_gb:
        raise InvalidArgumentError(f"say how much memory {chip.name} has, e.g. '{name} 36GB'")
    sold = sorted({m for c in CHIPS if c.kind == chip.kind and set(c.tokens) == set(chip.tokens) for m in c.memory_gb})
    if given and sold and given not in sold:
        bare = _without_size(name)
        raise InvalidArgumentError(f"{bare} is sold with {_sizes_text(sold)}, not {given}GB; "
                                   f"e.g. '{bare} {sold[-1]}GB'")
    size = f"{memory_gb}GB"
    return _device_from_chip(chip, memory_gb * GiB, name=chip.name if size in chip.name else f"{chip.name} {size}")


def _sizes_text(sizes: list[int]) -> str:
    gb = [f"{m}GB" for m in sizes]
    return gb[0] if len(gb) == 1 else f"{', '.join(gb[:-1])} or {gb[-1]}"


def _without_size(name: str) -> str:
    return re.sub(r"\s*\d+\s*gb\b", "", name, flags=re.IGNORECASE).strip()
