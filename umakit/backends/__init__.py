"""Backend registry: engines are named, and imported only when chosen.

Engines are named by what runs them (``mlx``, ``torch``); ``--device`` picks
where. ``cuda`` and ``metal`` are accepted as shorthands.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import shutil
import sys

from ..errors import BackendUnavailableError, InvalidArgumentError

from .base import EngineSpec
from .mlx import SPEC as _MLX
from .torch import SPEC as _TORCH

ENGINES: dict[str, EngineSpec] = {s.name: s for s in (_MLX, _TORCH)}
SHORTHANDS = {"cuda": ("torch", "cuda"), "metal": ("mlx", "metal")}
# On a CPU-only machine "auto" takes the first engine here that is installed
# (and has the features asked for); the order follows benchmarks/cpu_engines.py
# on a 2-core x86 Linux machine.
CPU_PREFERENCE = ("torch", "mlx")


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda_available() -> bool:
    # Importing torch costs seconds: look for an NVIDIA driver first.
    if not _installed("torch") or not (os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi")):
        return False
    import torch

    return torch.cuda.is_available()


def resolve(backend: str = "auto", device: str | None = None, needs: frozenset[str] = frozenset()) -> tuple[str, str]:
    """Choose (engine, device) from the user's words; explains every refusal.

    ``needs`` names features (`umakit.backends.base.FEATURES`) that "auto" must respect on a CPU.
    """
    backend = (backend or "auto").lower()
    if backend in SHORTHANDS:
        backend, implied = SHORTHANDS[backend]
        if device not in (None, "auto", implied):
            raise InvalidArgumentError(f"--backend {implied} runs on device {implied}, not {device}")
        device = implied
    if backend == "auto":
        if is_apple_silicon() and device in (None, "auto", "metal"):
            backend = "mlx"
        elif device in (None, "auto", "cuda") and _cuda_available():
            backend = "torch"
        else:
            backend = next((e for e in CPU_PREFERENCE if _installed(e) and needs <= ENGINES[e].features), "mlx")
    if backend not in ENGINES:
        raise InvalidArgumentError(f"unknown backend {backend!r}; choose from auto, {', '.join(ENGINES)}, cuda")
    if device in (None, "auto"):
        if backend == "mlx":
            device = "metal" if is_apple_silicon() else "cpu"
        else:
            device = "cuda" if _cuda_available() else "cpu"
    if device not in ENGINES[backend].devices:
        raise InvalidArgumentError(f"backend {backend} runs on {' or '.join(ENGINES[backend].devices)}, not {device!r}")
    missing = needs - ENGINES[backend].features
    if missing:
        have = [e for e in ENGINES if missing <= ENGINES[e].features]
        raise InvalidArgumentError(
            f"the {backend} backend does not support {', '.join(sorted(missing))} yet; use --backend {have[0]}"
        )
    return backend, device


def engine_class(name: str):
    """Import and return the engine class, with an install hint if it is missing."""
    spec = ENGINES[name]
    if not _installed(spec.dependency):
        raise BackendUnavailableError(f"the {name} backend needs {spec.dependency}: pip install '{spec.extra}'")
    return getattr(importlib.import_module(spec.module), spec.cls)
