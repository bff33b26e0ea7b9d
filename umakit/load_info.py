"""What `umakit.load` reports about a loaded model: `LoadInfo`, built from the engine's declared facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from umakit.backends.base import Engine, WeightInfo
from umakit.hardware import memory_warnings
from umakit.offload import OffloadPlan


@dataclass
class LoadInfo:
    name: str
    path: Path | None  # None for a synthetic model
    backend: str
    device: str
    dtype: str
    load_s: float
    size_on_disk: int
    weights: WeightInfo
    context_length: int
    warnings: list[str] = field(default_factory=list)  # e.g. weights near the memory limit
    offload: OffloadPlan | None = None  # the layer split when layers stream from host memory


def load_info(engine: Engine, name: str, path: Path | None, load_s: float, size_on_disk: int) -> LoadInfo:
    """The `LoadInfo` of ``engine`` as loaded, with its load notes and memory warnings."""
    cfg = engine.config.get("text_config", engine.config)
    info = LoadInfo(
        name=name, path=path, backend=engine.name, device=engine.device, dtype=engine.dtype, load_s=load_s,
        size_on_disk=size_on_disk, weights=engine.weight_info(),
        context_length=int(cfg.get("max_position_embeddings") or 0), offload=engine.offload,
    )
    # With layers streaming, the device holds only the resident part; the host holds all of it.
    resident = info.offload.resident_bytes if info.offload and engine.device != "cpu" else info.weights.total_bytes
    info.warnings = [*engine.load_notes, *memory_warnings(resident, engine.device)]
    return info
