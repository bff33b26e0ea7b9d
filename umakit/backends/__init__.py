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
from typing import NamedTuple

from umakit.errors import BackendUnavailableError, InvalidArgumentError, UmakitError, UnsupportedModelError

from umakit.backends.base import EngineSpec
from umakit.backends.mlx import SPEC as _MLX
from umakit.backends.torch import SPEC as _TORCH
from umakit.backends.transformers import SPEC as _TRANSFORMERS

ENGINES: dict[str, EngineSpec] = {s.name: s for s in (_MLX, _TORCH, _TRANSFORMERS)}
SHORTHANDS = {"cuda": ("torch", "cuda"), "metal": ("mlx", "metal")}
# On a CPU "auto" takes the first engine here that is installed and runs the model with the features asked for.
# The torch engine's compact code first (benchmarks/cpu_engines.py); then, for the architectures it lacks, MLX on
# Apple Silicon, but transformers' model classes elsewhere: MLX's CPU backend off Apple Silicon is single-threaded
# on a reference BLAS, and decoded 3-5x slower than the transformers engine on 2 threads of an x86 Linux VM
# (benchmarks/engine_paths.py --mlx, docs/performance.md).
APPLE_CPU_PREFERENCE = ("torch", "mlx", "transformers")
CPU_PREFERENCE = ("torch", "transformers", "mlx")
GPU_PREFERENCE = ("torch", "transformers")  # on CUDA


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


class Choice(NamedTuple):
    """An engine and device for a load, and why "auto" passed over its first preference (None if it did not)."""

    engine: str
    device: str
    note: str | None = None


def resolve(backend: str = "auto", device: str | None = None, needs: frozenset[str] = frozenset(),
            model_type: str | None = None, rope_kind: str | None = None) -> tuple[str, str]:
    """Choose (engine, device) from the user's words; explains every refusal (see `choose`)."""
    return choose(backend, device, needs, model_type, rope_kind)[:2]


def reads_exact_groups(backend: str = "auto", device: str | None = None, dtype: str = "auto",
                       needs: frozenset[str] = frozenset(), model_type: str | None = None) -> bool:
    """Whether the engine these words choose (for ``model_type``, where known) reads a GGUF's Q6_K layers exactly,
    in groups of 16 (`EngineSpec.exact_groups`), so that a first use's import may leave their 8-bit copies out;
    False where they choose none (the load says why)."""
    try:
        engine, where = resolve(backend, device, needs, model_type)
    except UmakitError:
        return False
    reads = ENGINES[engine].exact_groups
    return reads is not None and reads(where, dtype)


def choose(backend: str = "auto", device: str | None = None, needs: frozenset[str] = frozenset(),
           model_type: str | None = None, rope_kind: str | None = None) -> Choice:
    """Choose the engine and device from the user's words, the features asked for and the architecture.

    ``needs`` names features (`umakit.backends.base.FEATURES`), ``model_type``
    the checkpoint's architecture (`umakit.checkpoint.config.architecture`; None:
    not known yet) and ``rope_kind`` its RoPE scaling (`umakit.checkpoint.config.rope_kind`).
    "auto" takes the first engine, in the machine's order of preference, that is
    installed and can do all three; an explicit backend that cannot is refused
    with the one that can.
    """
    backend = (backend or "auto").lower()
    if backend in SHORTHANDS:
        backend, implied = SHORTHANDS[backend]
        if device not in (None, "auto", implied):
            raise InvalidArgumentError(f"--backend {implied} runs on device {implied}, not {device}")
        device = implied
    if backend == "auto":
        return _auto(device, needs, model_type, rope_kind)
    if backend not in ENGINES:
        raise InvalidArgumentError(f"unknown backend {backend!r}; choose from auto, {', '.join(ENGINES)}, cuda")
    if device in (None, "auto"):
        if backend == "mlx":
            device = "metal" if is_apple_silicon() else "cpu"
        else:
            device = "cuda" if _cuda_available() else "cpu"
    spec = ENGINES[backend]
    if device not in spec.devices:
        raise InvalidArgumentError(f"backend {backend} runs on {' or '.join(spec.devices)}, not {device!r}")
    missing = needs - spec.features
    if missing:
        have = [e for e in ENGINES if missing <= ENGINES[e].features]
        raise InvalidArgumentError(
            f"the {backend} backend does not support {_named(missing)} yet; use --backend {have[0]}"
        )
    others = [e for e in ENGINES if ENGINES[e].runs(model_type)]
    if not spec.runs(model_type) and others:  # with no engine for it, the engine's own error lists what it runs
        raise UnsupportedModelError(f"the {backend} backend does not run model_type {model_type!r}; "
                                    f"use --backend {others[0]}")
    if not spec.applies(rope_kind):
        able = [e for e in ENGINES if ENGINES[e].applies(rope_kind) and ENGINES[e].runs(model_type)]
        raise UnsupportedModelError(f"the {backend} backend does not apply {rope_kind!r} RoPE scaling, which this "
                                    f"checkpoint sets" + (f"; use --backend {able[0]}" if able else ""))
    return Choice(backend, device)


def _candidates(device: str | None) -> list[tuple[str, str]]:
    """(engine, device) pairs "auto" considers, best first: the machine's GPU engine, then the CPU order."""
    out = []
    if is_apple_silicon() and device in (None, "auto", "metal"):
        out.append(("mlx", "metal"))
    elif device in (None, "auto", "cuda") and _cuda_available():
        out += [(e, "cuda") for e in GPU_PREFERENCE]
    if device in (None, "auto", "cpu"):
        out += [(e, "cpu") for e in (APPLE_CPU_PREFERENCE if is_apple_silicon() else CPU_PREFERENCE)]
    elif not out:  # a device no engine prefers: whichever engines run there
        out = [(e, device) for e in ENGINES if device in ENGINES[e].devices]
    return out


def _named(features) -> str:
    """Features as the user asked for them (base.FEATURE_NAMES), for an error."""
    from umakit.backends.base import FEATURE_NAMES

    return ", ".join(sorted(FEATURE_NAMES.get(f, f) for f in features))


def _why_not(engine: str, needs: frozenset[str], model_type: str | None, rope_kind: str | None = None) -> str | None:
    spec = ENGINES[engine]
    if not spec.runs(model_type):
        return f"{engine} does not run {model_type}"
    if not spec.applies(rope_kind):
        return f"{engine} does not apply {rope_kind} RoPE scaling"
    if not needs <= spec.features:
        return f"{engine} does not support {_named(needs - spec.features)}"
    return None


def _auto(device: str | None, needs: frozenset[str], model_type: str | None, rope_kind: str | None) -> Choice:
    candidates = _candidates(device)
    if not candidates:
        raise InvalidArgumentError(f"no backend runs on device {device!r}; choose from metal, cuda, cpu")
    able = [(e, d) for e, d in candidates if _why_not(e, needs, model_type, rope_kind) is None]
    if not able:
        engines = dict.fromkeys(e for e, _ in candidates)
        if not any(ENGINES[e].runs(model_type) for e in engines):
            names = "; ".join(f"{e} runs {ENGINES[e].named_architectures()}" for e in engines)
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported by any engine: {names}")
        if not any(ENGINES[e].applies(rope_kind) for e in engines if ENGINES[e].runs(model_type)):
            why = "; ".join(filter(None, (_why_not(e, needs, model_type, rope_kind) for e in engines)))
            raise UnsupportedModelError(f"no engine here applies {rope_kind!r} RoPE scaling, which this checkpoint "
                                        f"sets: {why}")
        why = "; ".join(filter(None, (_why_not(e, needs, model_type, rope_kind) for e in engines)))
        what = f"no backend supports {_named(needs)} on {candidates[0][1]}" if model_type is None else \
            f"no backend here runs {model_type} with {_named(needs)}"
        raise InvalidArgumentError(f"{what}: {why}")
    engine, where = next(((e, d) for e, d in able if _usable(e)), able[0])
    skipped = dict.fromkeys(r for e, _ in candidates[:candidates.index((engine, where))]
                            if (r := _why_not(e, needs, model_type, rope_kind)))
    note = f"running on {engine} ({where}): {'; '.join(skipped)}" if skipped else None
    return Choice(engine, where, note)


def after(choice: tuple[str, str], device: str | None, needs: frozenset[str], model_type: str | None,
          rope_kind: str | None = None) -> tuple[str, str] | None:
    """The engine and device "auto" would take if ``choice`` (its pick) could not load the checkpoint: the next
    installed candidate that runs it with the features asked for, or None."""
    candidates = _candidates(device)
    if choice not in candidates:
        return None
    later = candidates[candidates.index(choice) + 1:]
    return next(((e, d) for e, d in later if e != choice[0] and _usable(e)
                 and _why_not(e, needs, model_type, rope_kind) is None), None)


def _usable(engine: str) -> bool:
    """Whether the packages ``engine`` needs are installed."""
    spec = ENGINES[engine]
    return all(_installed(m) for m in (spec.dependency, *spec.requires))


def parallel_backend(backend: str, parallel: str | None) -> str:
    """The engine "auto" means for a run sharded across ranks (``parallel``): the launcher's."""
    from umakit.backends.distributed import backend_for

    return backend_for(backend, parallel)


def load_engine(name: str, ckpt, *, parallel: str | None = None, **options):
    """``engine_class(name).from_checkpoint(ckpt, **options)``; with ``parallel`` ("tensor" or "pipeline"),
    the model sharded across the ranks of the launcher's run (`umakit.backends.distributed.load`)."""
    if parallel is None:
        return engine_class(name).from_checkpoint(ckpt, **options)
    from umakit.backends.distributed import load

    return load(name, parallel, ckpt, **options)


def engine_class(name: str):
    """Import and return the engine class, with an install hint if it is missing."""
    spec = ENGINES[name]
    if not _installed(spec.dependency):
        raise BackendUnavailableError(f"the {name} backend needs {spec.dependency}: pip install '{spec.extra}'")
    return getattr(importlib.import_module(spec.module), spec.cls)


def trim_heap() -> None:
    """Hand the C heap's freed pages back to the system: glibc keeps them (a load's temporaries, an unloaded
    model's arrays) resident for the process's life otherwise. Nothing where the C library has no malloc_trim."""
    if sys.platform != "linux":
        return
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def release_memory(device: str) -> None:
    """After a model's arrays are dropped: hand back what the allocators still cache for ``device`` (CUDA's
    caching allocator, MLX's buffer cache) and the C heap's freed pages. Engines never imported are left alone."""
    if device == "cuda" and "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()
    if "mlx.core" in sys.modules:
        sys.modules["mlx.core"].clear_cache()
    trim_heap()

