"""Bandwidth probes: each streams through a buffer far larger than the caches, keeps the best of a
few runs and returns GB/s (1e9 bytes per second), in under a second.

`umakit.hardware.local` runs them only for devices the published table does not know, and
caches what they measure. Frameworks are imported inside each probe, so importing this is free.
"""

from __future__ import annotations

import math
import os
import time


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
