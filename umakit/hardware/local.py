"""This machine's devices: what they are (system calls, torch, MLX), how much memory is there and
free, and the probe results cached per machine in ``$UMAKIT_HOME/hardware.json``.

A known chip takes its peak bandwidth from the published table (`umakit.hardware.chips`);
anything unknown, and every CPU, is measured once (`umakit.hardware.probes`) and cached.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from ..errors import BackendUnavailableError, InvalidArgumentError
from ..fsutil import atomic_file
from ..home import umakit_home
from . import probes
from .chips import DeviceInfo, default_working_set, find_chip

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
                 link: bool = False) -> DeviceInfo:
    """Facts about this machine's ``device`` ("auto", "metal", "cuda", "cuda:N", "cpu").

    Peak bandwidth: ``override_gbps`` (source "user"), else the published figure
    for a known chip, else a streaming-read probe run once per machine and
    cached in ``$UMAKIT_HOME/hardware.json`` (source "measured"). On NVIDIA the
    host-to-device copy bandwidth is measured and cached the same way; on a
    CPU too when ``link`` (offload's host copies stand in for PCIe there).
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
        peak = _cached(facts, "peak_bandwidth_gbps", lambda: probe(facts.index), remeasure)
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
        import mlx.core as mx

        info_fn = getattr(mx, "device_info", None) or mx.metal.device_info  # moved in MLX 0.29
        return int(info_fn()["max_recommended_working_set_size"]) or None
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
    """Memory available now (Linux: MemAvailable, which counts reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def cpu_kv_budget() -> int:
    """Bytes a batch KV cache may take on a CPU: `CPU_KV_FRACTION` of the RAM available now
    (the weights are already resident)."""
    return int(available_ram() * CPU_KV_FRACTION)


def _int(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0


# -- the probe cache --------------------------------------------------------------

def _cache_path():
    return umakit_home() / CACHE_FILE


def _cached(facts: _LocalFacts, field: str, measure, remeasure: bool) -> float:
    """``field`` for this machine's device from the cache, measuring and saving it when absent."""
    path = _cache_path()
    key = f"{socket.gethostname()}|{facts.kind}|{facts.name}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data["entries"] if data.get("version") == CACHE_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        entries = {}  # missing or unreadable: measure again and rewrite it
    if not isinstance(entries, dict):
        entries = {}
    entry = entries.get(key) if isinstance(entries.get(key), dict) else {}
    if not remeasure and isinstance(entry.get(field), (int, float)) and entry[field] > 0:
        return float(entry[field])
    value = round(float(measure()), 2)  # what the cache keeps, so the first run reports what later runs read
    entries[key] = {**entry, field: value, f"{field}_measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with atomic_file(path) as f:
        json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=2, sort_keys=True)
    return value
