"""Bench records: the dataclasses of a measurement and their JSON form.

A `BenchRecord` holds everything needed to compare runs across machines: the
machine's facts, the model's bytes, the settings, package versions, every
timed run and their summaries. `load_record` reads one back, checked enough to
compare; `write_record` writes one atomically.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from umakit.errors import InvalidArgumentError
from umakit.core.fsutil import atomic_file

RECORD_VERSION = 1
VERSIONED_PACKAGES = ("umakit", "mlx", "mlx-lm", "torch")


@dataclass
class Run:
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    achieved_gbps: float
    mbu: float
    bytes_per_token: float
    peak_memory_bytes: int
    pcie_gbps: float = 0.0  # offload: streamed bytes per step x steps/s
    offload_efficiency: float = 0.0  # offload: steps/s / the two-link ceiling
    comm_share: float = 0.0  # sharded: the share of a decode step spent on the link


@dataclass
class Summary:
    median: float
    min: float
    max: float
    stdev: float

    @classmethod
    def of(cls, values: list[float]) -> "Summary":
        return cls(statistics.median(values), min(values), max(values),
                   statistics.stdev(values) if len(values) > 1 else 0.0)


@dataclass
class ContextPoint:
    context: int
    decode_tps: float
    bytes_per_token: float
    ceiling_tps: float
    achieved_gbps: float
    mbu: float


@dataclass
class SweepPoint:
    """One step of an offload sweep: the same model with ``gpu_layers`` of ``layers`` resident."""

    gpu_layers: int
    layers: int
    offloaded_fraction: float
    decode_tps: float
    achieved_gbps: float  # every byte a step reads, per second
    bytes_per_token: float  # weights and KV cache a step reads, wherever they live
    streamed_bytes_per_token: int
    pcie_gbps: float  # achieved over the link
    ceiling_tps: float  # modelled: the plain roofline when nothing streams, else the offload ceiling
    efficiency: float  # decode steps/s / ceiling


@dataclass
class BenchRecord:
    """One machine's measurement of one model: everything needed to compare runs."""

    machine: dict
    model: dict
    settings: dict
    versions: dict
    runs: list[Run]
    summary: dict[str, Summary]
    contexts: list[ContextPoint] = field(default_factory=list)
    offload: dict | None = None  # the layer split, when layers stream from host memory
    offload_sweep: list[SweepPoint] = field(default_factory=list)
    synthetic: bool = False
    created: str = ""
    version: int = RECORD_VERSION
    speculative: dict | None = None  # `umakit bench --speculative`: the speculative runs against these plain ones

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> dict:
        """The record as its JSON file reads back (tuples become lists)."""
        return json.loads(json.dumps(self.to_dict()))


def summarize(runs: list[Run]) -> dict[str, Summary]:
    """Median, min, max and spread of every field of the runs."""
    return {k: Summary.of([getattr(r, k) for r in runs]) for k in Run.__dataclass_fields__}


def machine_dict(device) -> dict:
    """A record's ``machine``: a `umakit.hardware.DeviceInfo` and the host platform."""
    return {
        "device": device.name, "kind": device.kind, "memory_bytes": device.memory_bytes,
        "peak_bandwidth_gbps": device.peak_bandwidth_gbps, "bandwidth_source": device.bandwidth_source,
        "working_set_bytes": device.working_set_bytes, "pcie_h2d_gbps": device.pcie_h2d_gbps,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def model_dict(model, kv_bits: int | None) -> dict:
    """A record's ``model``: a `umakit.Model`'s name, bytes and engine, and its config's shape."""
    w, engine = model.info.weights, model.engine
    return {"name": model.info.name, "params": w.params, "bits_per_weight": round(w.bits_per_weight, 3),
            "weight_bytes": w.total_bytes, "bytes_per_token": w.bytes_per_token,
            "comm_s_per_token": w.comm_s_per_token,
            "kv_bytes_per_token": engine.kv_bytes_per_token(kv_bits),
            "quantization": w.quantization, "backend": engine.name, "device": engine.device,
            "dtype": engine.dtype, "config": _shape_config(engine.config)}


def versions_dict() -> dict:
    """Python's version and those of the installed packages that shape the numbers."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _shape_config(config: dict) -> dict:
    """The config fields a plan needs (drops umakit's import provenance)."""
    return {k: v for k, v in config.items() if k not in ("umakit", "quantization_config")}


def load_record(path) -> dict:
    """A bench JSON file, checked enough to compare."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["machine"]["peak_bandwidth_gbps"], data["summary"]["decode_tps"]["median"], data["model"]["name"]
    except FileNotFoundError as e:
        raise InvalidArgumentError(f"no such bench file: {path}") from e
    except OSError as e:
        raise InvalidArgumentError(f"cannot read bench file {path}: {e.strerror or e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgumentError(f"{path} is not a umakit bench record ({e})") from e
    return data


def write_record(record: BenchRecord | dict, path) -> None:
    """Write a record as indented JSON; a failed write leaves no partial file."""
    data = record.to_json() if isinstance(record, BenchRecord) else record
    with atomic_file(path, "w") as f:
        json.dump(data, f, indent=2)
