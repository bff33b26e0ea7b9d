"""Peak memory as the torch engines report it: the CUDA caching allocator's on a GPU, the process's peak resident
memory on a CPU."""

from __future__ import annotations

import torch

from umakit.backends import common


def reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        common.reset_process_peak_memory()


def measured(device: str) -> int:
    """Peak bytes since the last `reset`."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return common.process_peak_memory()
