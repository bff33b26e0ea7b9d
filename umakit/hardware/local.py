"""This machine's devices: what they are (system calls, torch, MLX), how much memory is there and
free, and the probe results cached per machine in ``$UMAKIT_HOME/hardware.json``.

A known chip takes its peak bandwidth from the published table (`umakit.hardware.chips`);
anything unknown, and every CPU, is measured once (`umakit.hardware.probes`) and cached.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass

from umakit.errors import BackendUnavailableError, InvalidArgumentError
from umakit.core.home import umakit_home
from umakit.hardware import probes
from umakit.hardware.chips import DeviceInfo, default_working_set, find_chip
from umakit.hardware.metal import metal_working_set

CACHE_FILE = "hardware.json"
CACHE_VERSION = 1
CPU_KV_FRACTION = 0.5  # of the RAM available now: leaves room for activations and the OS


@dataclass(frozen=True)
class _LocalFacts:
    name: str
    kind: str
    memory_bytes: int
    working_set_bytes: int | None = None
    gpu_cores: int | None = None
    index: int = 0


_DEVICE_KINDS = {"auto": "auto", "cpu": "cpu", "metal": "apple", "apple": "apple", "mps": "apple",
                 "cuda": "nvidia", "nvidia": "nvidia"}


def detect_local(device: str = "auto", override_gbps: float | None = None, *, remeasure: bool = False,
                 link: bool = False, achieved_gbps: float | None = None) -> DeviceInfo:
    """Facts about this machine's ``device`` ("auto", "metal", "cuda", "cuda:N", "cpu").

    Peak bandwidth: ``override_gbps`` (source "user"), else the published figure
    for a known chip, else a streaming-read probe run once per machine and
    cached in ``$UMAKIT_HOME/hardware.json`` (source "measured"). On NVIDIA the
    host-to-device copy bandwidth is measured and cached the same way; on a
    CPU too when ``link`` (offload's host copies stand in for PCIe there). ``achieved_gbps``: what a
    run just read per second; a measured peak below it is measured again (`probes.cached_probe`).
    """
    if override_gbps is not None and not override_gbps > 0:
        raise InvalidArgumentError(f"--peak-bandwidth must be a positive number of GB/s (got {override_gbps})")
    base, _, index = (device or "auto").lower().partition(":")
    if base not in _DEVICE_KINDS or (index and not index.isdigit()):
        raise InvalidArgumentError(f"unknown device {device!r}; choose auto, metal, cuda, cuda:N or cpu")
    kind = _DEVICE_KINDS[base]
    if kind == "auto":
        kind = "apple" if _is_apple_silicon() else "nvidia" if _cuda_present() else "cpu"
    facts = {"apple": _apple_facts, "nvidia": _nvidia_facts, "cpu": _cpu_facts}[kind](int(index or 0))
    chip = None if kind == "cpu" else find_chip(facts.name, facts.gpu_cores, facts.memory_bytes)
    if chip is not None and chip.kind != kind:
        chip = None
    if override_gbps is not None:
        peak, source = float(override_gbps), "user"
    elif chip is not None:
        peak, source = float(chip.peak_gbps), "published"
    else:
        probe = {"apple": probes.apple_gbps, "nvidia": probes.cuda_gbps, "cpu": probes.cpu_gbps}[kind]
        peak = _cached(facts, "peak_bandwidth_gbps", lambda: probe(facts.index), remeasure, achieved_gbps)
        source = "measured"
    pcie = None
    if kind == "nvidia" or (link and kind == "cpu"):
        pcie = _link(facts, kind, remeasure)["pinned"]
    return DeviceInfo(
        name=facts.name, kind=kind, peak_bandwidth_gbps=peak, bandwidth_source=source,
        memory_bytes=facts.memory_bytes, working_set_bytes=facts.working_set_bytes,
        pcie_h2d_gbps=pcie, pcie_gen=chip.pcie_gen if chip else None, gpu_cores=facts.gpu_cores,
    )


def h2d_bandwidth(device: str = "cuda", *, remeasure: bool = False) -> dict[str, float]:
    """Host-to-device copy GB/s from pinned and from pageable host memory, measured once per machine
    and cached like the peak bandwidth. For "cpu" (offload's test bed) it is the host copy rate."""
    base, _, index = (device or "cuda").lower().partition(":")
    kind = _DEVICE_KINDS.get(base)
    if kind not in ("nvidia", "cpu") or (index and not index.isdigit()):
        raise InvalidArgumentError(f"host-to-device copies are measured for cuda, cuda:N or cpu, not {device!r}")
    facts = (_nvidia_facts if kind == "nvidia" else _cpu_facts)(int(index or 0))
    return _link(facts, kind, remeasure)


def _link(facts: _LocalFacts, kind: str, remeasure: bool) -> dict[str, float]:
    pinned = _cached(facts, "pcie_h2d_gbps", lambda: probes.h2d_gbps(facts.index, kind, pinned=True), remeasure)
    if kind == "cpu":  # nothing is pinned without CUDA: one host copy rate
        return {"pinned": pinned, "pageable": pinned}
    pageable = _cached(facts, "pcie_h2d_pageable_gbps", lambda: probes.h2d_gbps(facts.index, kind, pinned=False),
                       remeasure)
    return {"pinned": pinned, "pageable": pageable}


def _is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def _cuda_present() -> bool:
    # Only pay for importing torch when an NVIDIA driver is there at all.
    if not (os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _run(cmd: list[str]) -> str:
    """stdout of a short system command, or "" when it is missing or fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=15, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _apple_facts(index: int) -> _LocalFacts:
    if not _is_apple_silicon():
        raise BackendUnavailableError("no Apple GPU here: this is not an Apple Silicon Mac (use --device cpu)")
    name = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip() or "Apple Silicon"
    memory = _int(_run(["sysctl", "-n", "hw.memsize"])) or _ram_bytes()
    cores = re.search(r'"gpu-core-count"\s*=\s*(\d+)', _run(["ioreg", "-rd1", "-c", "AGXAccelerator"]))
    if cores is None:
        cores = re.search(r"Total Number of Cores:\s*(\d+)", _run(["system_profiler", "SPDisplaysDataType"]))
    working_set = _metal_working_set() or default_working_set(memory)
    return _LocalFacts(name, "apple", memory, working_set, int(cores.group(1)) if cores else None)


def _metal_working_set() -> int | None:
    try:
        return metal_working_set() or None
    except (ImportError, AttributeError, KeyError, RuntimeError, ValueError):
        return None


def _nvidia_facts(index: int) -> _LocalFacts:
    try:
        import torch
    except ImportError as e:
        raise BackendUnavailableError("reading NVIDIA GPU facts needs torch: pip install 'umakit[cuda]'") from e
    if not torch.cuda.is_available():
        raise BackendUnavailableError("no CUDA device is available (check the driver, or use --device cpu)")
    if index >= torch.cuda.device_count():
        raise InvalidArgumentError(f"cuda:{index} does not exist; this machine has {torch.cuda.device_count()} GPU(s)")
    props = torch.cuda.get_device_properties(index)
    return _LocalFacts(props.name, "nvidia", int(props.total_memory), index=index)


def _cpu_facts(index: int) -> _LocalFacts:
    name = ""
    if sys.platform == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
    elif os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        name = m.group(1).strip() if m else ""
    name = name or platform.processor() or platform.machine() or "unknown"
    return _LocalFacts(f"CPU {name}", "cpu", _ram_bytes())


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _int(_run(["sysctl", "-n", "hw.memsize"]))


def available_ram() -> int:
    """Memory available now (Linux: MemAvailable, which counts reclaimable page cache;
    macOS: free, speculative and inactive pages from `vm_stat`)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":
        available = vm_stat_available(_run(["vm_stat"]))
        if available:
            return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def vm_stat_available(text: str) -> int | None:
    """Bytes macOS can hand out now, from `vm_stat`'s output: free + speculative + inactive pages
    (the figure psutil reports; purgeable pages sit in those queues already). None when unreadable."""
    page = re.search(r"page size of (\d+) bytes", text)
    counts = dict(re.findall(r"^Pages (free|speculative|inactive):\s+(\d+)\.", text, re.MULTILINE))
    if page is None or "free" not in counts:
        return None
    return int(page.group(1)) * sum(int(counts.get(k, 0)) for k in ("free", "speculative", "inactive"))


def memory_budget(device: str) -> int:
    """Bytes the models a server keeps loaded may take on ``device``: Metal's recommended working set on Apple
    Silicon, the GPU's memory on CUDA, the RAM available now on a CPU."""
    if device == "metal":
        from umakit.hardware.metal import metal_working_set

        return metal_working_set()
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[1])
    return available_ram()


def cpu_kv_budget() -> int:
    """Bytes a batch KV cache may take on a CPU: `CPU_KV_FRACTION` of the RAM available now
    (the weights are already resident)."""
    return int(available_ram() * CPU_KV_FRACTION)


NEAR_LIMIT = 0.9  # warn when weights take more than this share of usable memory
WIRED_ADVICE_MARGIN = 1.2  # the weights plus room for the KV cache and activations
OS_RESERVE_FRACTION = 0.1  # of RAM that a raised GPU limit still leaves to macOS...
OS_RESERVE_MIN = 4 << 30  # ...and never less than this


def wired_limit_advice_mb(weight_bytes: int, memory_bytes: int) -> int | None:
    """The `iogpu.wired_limit_mb` to suggest for ``weight_bytes`` on a Mac of ``memory_bytes``:
    `WIRED_ADVICE_MARGIN` times the weights, capped below RAM by the OS reserve (MLX: the limit
    must stay under total memory). None when even the cap cannot hold the weights."""
    cap = memory_bytes - max(OS_RESERVE_MIN, int(memory_bytes * OS_RESERVE_FRACTION))
    if weight_bytes >= cap:
        return None
    return int(min(weight_bytes * WIRED_ADVICE_MARGIN, cap) / 2**20)


def memory_warnings(weight_bytes: int, device: str) -> list[str]:
    """A warning, with the fix, when the weights are near or over usable memory."""
    gib = weight_bytes / 2**30
    quantize = "use a more quantized model (umakit quantize --bits 4)"
    if device == "cpu":
        limit = _ram_bytes()
        where, fix = "RAM", "use a smaller or more quantized model (umakit quantize --bits 4)"
    else:
        dev = detect_local(device)
        limit = dev.usable_bytes
        if dev.kind == "apple":
            where, mb = "the GPU's recommended working set", wired_limit_advice_mb(weight_bytes, dev.memory_bytes)
            fix = quantize if mb is None else f"raise it with `sudo sysctl iogpu.wired_limit_mb={mb}` or {quantize}"
        else:
            where, fix = "VRAM", quantize
    if weight_bytes <= NEAR_LIMIT * limit:
        return []
    return [f"the weights ({gib:.1f} GiB) are {weight_bytes / limit:.0%} of {where} ({limit / 2**30:.1f} GiB); "
            f"generation may swap or fail: {fix}"]


def _int(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0


# -- the probe cache --------------------------------------------------------------

def _cache_path():
    return umakit_home() / CACHE_FILE


def _cached(facts: _LocalFacts, field: str, measure, remeasure: bool, achieved_gbps: float | None = None) -> float:
    """``field`` for this machine's device through the probe cache (`probes.cached_probe`: best of several
    runs, measured again when a week old, when a run achieved more, or when ``remeasure``)."""
    key = f"{socket.gethostname()}|{facts.kind}|{facts.name}"
    return probes.cached_probe(_cache_path(), key, field, measure, version=CACHE_VERSION, remeasure=remeasure,
                               achieved_gbps=achieved_gbps)
