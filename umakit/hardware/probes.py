"""Bandwidth probes and the cache of what they measured.

Each probe streams through a buffer far larger than the caches, keeps the best of a few
repeats and returns GB/s (1e9 bytes per second), in under a second. `cached_probe` keeps the
figures in ``$UMAKIT_HOME/hardware.json``: the best of `PROBE_RUNS` separate runs (a busy
moment spoils one run, not the figure), measured again when the figure is older than
`MAX_AGE_S`, when a run achieved more than it (a figure taken while the machine was busy:
the share of peak then stays at or under 100%), or on demand (`umakit bench --probe`).
`umakit.hardware.local` runs the probes only for devices the published table does not know.
Frameworks are imported inside each probe, so importing this is free.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from umakit.core.fsutil import atomic_file

PROBE_RUNS = 3  # separate runs of a probe; the best is kept
PROBE_PAUSE_S = 0.1  # between them, so that one burst of other work does not spoil them all
MAX_AGE_S = 7 * 24 * 3600  # a cached figure older than a week is measured again
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"  # local time, as the cache has always written it


def best_of(measure: Callable[[], float], runs: int = PROBE_RUNS, pause_s: float = PROBE_PAUSE_S,
            sleep: Callable[[float], None] = time.sleep) -> float:
    """The highest of ``runs`` calls of ``measure``, ``pause_s`` apart: a bandwidth is never
    overstated by a run, only understated by a busy moment."""
    best = 0.0
    for i in range(max(runs, 1)):
        if i:
            sleep(pause_s)
        best = max(best, float(measure()))
    return best


def why_measure(entry: dict, field: str, now: float, achieved_gbps: float | None = None) -> str | None:
    """Why ``entry``'s ``field`` must be measured again ("absent", "stale", "exceeded"), or None."""
    value = entry.get(field)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        return "absent"
    stamp = entry.get(f"{field}_measured_at")
    try:
        age = now - time.mktime(time.strptime(stamp, TIME_FORMAT))
    except (TypeError, ValueError, OverflowError):
        return "stale"  # no readable date: as good as old
    if age > MAX_AGE_S:
        return "stale"
    if achieved_gbps is not None and achieved_gbps > value:
        return "exceeded"
    return None


def cached_probe(path: Path, key: str, field: str, measure: Callable[[], float], *, version: int,
                 remeasure: bool = False, achieved_gbps: float | None = None,
                 now: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> float:
    """``field`` of device ``key`` from the cache file at ``path``, measured (`best_of` `PROBE_RUNS`
    runs of ``measure``) and saved when absent, older than `MAX_AGE_S`, below ``achieved_gbps`` (what
    a run just read per second: the figure becomes at least that), or when ``remeasure``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data["entries"] if data.get("version") == version else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        entries = {}  # missing or unreadable: measure again and rewrite it
    if not isinstance(entries, dict):
        entries = {}
    entry = entries.get(key) if isinstance(entries.get(key), dict) else {}
    t = now()
    reason = "asked" if remeasure else why_measure(entry, field, t, achieved_gbps)
    if reason is None:
        return float(entry[field])
    value = round(best_of(measure, sleep=sleep), 2)  # what the cache keeps: later runs read the same
    if reason == "exceeded" and value < achieved_gbps:  # busy again: the run itself proved more
        value = math.ceil(achieved_gbps * 100) / 100
    entries[key] = {**entry, field: value, f"{field}_measured_at": time.strftime(TIME_FORMAT, time.localtime(t))}
    with atomic_file(path) as f:
        json.dump({"version": version, "entries": entries}, f, indent=2, sort_keys=True)
    return value


def cpu_gbps(index: int = 0, size_bytes: int = 256 << 20, repeats: int = 4) -> float:
    """Streaming-read bandwidth of RAM: threaded numpy sums over a 256 MiB array."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(size_bytes // 8)  # writing the ones faults every page in before timing
    threads = max(1, min(os.cpu_count() or 1, 16))
    chunks = np.array_split(a, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:  # numpy releases the GIL inside sum
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def apple_gbps(index: int = 0, size_bytes: int = 512 << 20, repeats: int = 4) -> float:
    """GPU streaming-read bandwidth through MLX; the CPU probe when MLX is missing."""
    try:
        import mlx.core as mx
    except ImportError:
        return cpu_gbps()
    a = mx.ones((size_bytes // 4,), dtype=mx.float32)
    mx.eval(a)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a.sum())
        best = min(best, time.perf_counter() - t0)
    return size_bytes / best / 1e9


def cuda_gbps(index: int = 0, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """VRAM streaming-read bandwidth: a sum over 1 GiB timed with CUDA events."""
    import torch

    dev = torch.device("cuda", index)
    a = torch.ones(size_bytes // 4, dtype=torch.float32, device=dev)
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a.sum()
        end.record()
        torch.cuda.synchronize(dev)
        best = min(best, start.elapsed_time(end) / 1e3)
    return size_bytes / best / 1e9


def h2d_gbps(index: int = 0, kind: str = "nvidia", pinned: bool = True, size_bytes: int = 256 << 20,
                     repeats: int = 4) -> float:
    """Host-to-device copy bandwidth, from pinned or pageable memory (what streaming weights would see).

    ``kind`` "cpu": a host-to-host copy, the rate offload's copies run at on a CPU.
    """
    import torch

    cuda = kind == "nvidia"
    dev = torch.device("cuda", index) if cuda else torch.device("cpu")
    host = torch.ones(size_bytes, dtype=torch.uint8)
    if pinned and cuda:
        host = host.pin_memory()
    target = torch.ones(size_bytes, dtype=torch.uint8, device=dev)  # ones: every page faulted in first
    best = math.inf
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        target.copy_(host, non_blocking=pinned and cuda)
        if cuda:
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return size_bytes / best / 1e9
