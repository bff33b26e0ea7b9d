"""Throughput measurement against the bandwidth roofline (`umakit bench`).

A run prefills a prompt of random token ids, then decodes a fixed number of
tokens greedily, ignoring end-of-sequence so every run does the same work.
Clocks are read after the token is on the host (``.item()`` synchronises).
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from .errors import DoesNotFitError, InvalidArgumentError
from .roofline import decode_roofline, offload_ceiling, offload_ceiling_tps
from .sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
DEFAULT_PROMPT_TOKENS = 512
DEFAULT_GEN_TOKENS = 128
DEFAULT_REPEAT = 5
CONTEXT_PROBE_TOKENS = 16  # decode steps timed at each context length of the sweep
RECORD_VERSION = 1


@dataclass
class BenchSettings:
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    gen_tokens: int = DEFAULT_GEN_TOKENS
    repeat: int = DEFAULT_REPEAT
    warmup: int = 1
    kv_bits: int | None = None
    contexts: tuple[int, ...] = ()  # context lengths for the decode-vs-context sweep
    seed: int = 0
    batch: int = 1  # sequences decoded together (aggregate tok/s; weights read once per step)

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.gen_tokens < 2 or self.repeat < 1 or self.warmup < 0 or self.batch < 1:
            raise InvalidArgumentError(
                "bench needs prompt tokens >= 1, gen tokens >= 2, repeat >= 1, warmup >= 0, batch >= 1")
        if self.batch > 1 and self.kv_bits is not None:
            raise InvalidArgumentError("--batch with --kv-bits is not supported: batched caches are float")


@dataclass
class Run:
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    achieved_gbps: float
    mbu: float
    bytes_per_token: float
    peak_memory_bytes: int
    pcie_gbps: float = 0.0  # offload: streamed bytes per token x tok/s
    offload_efficiency: float = 0.0  # offload: tok/s / the two-link ceiling


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
    efficiency: float  # decode tok/s / ceiling


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

    def to_dict(self) -> dict:
        return asdict(self)


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def _timed_run(engine, prompt, gen_tokens, kv_bits, device, weights) -> Run:
    cache = engine.make_cache(kv_bits=kv_bits)
    engine.reset_peak_memory()
    t0 = time.perf_counter()
    tokens = engine.generate_tokens(prompt, cache, GREEDY, seed=0)
    next(tokens)
    t1 = time.perf_counter()
    for _ in range(gen_tokens - 1):
        next(tokens)
    t2 = time.perf_counter()
    tokens.close()
    decode_tps = (gen_tokens - 1) / (t2 - t1)
    r = decode_roofline(weights.bytes_per_token, engine.kv_bytes_per_token(kv_bits),
                        len(prompt) + gen_tokens // 2, decode_tps, device.peak_bandwidth_gbps,
                        device.name, device.bandwidth_source)
    run = Run(t1 - t0, len(prompt) / (t1 - t0), decode_tps, r.achieved_gbps, r.mbu, r.bytes_per_token,
              engine.peak_memory())
    streamed = weights.streamed_bytes_per_token
    if streamed and device.pcie_h2d_gbps:
        o = offload_ceiling(r.bytes_per_token - streamed, streamed, device.peak_bandwidth_gbps,
                            device.pcie_h2d_gbps, decode_tps)
        run.pcie_gbps, run.offload_efficiency = o.achieved_pcie_gbps, o.efficiency
    return run


def _timed_batch_run(engine, prompts, gen_tokens, device, weights) -> Run:
    """Decode ``len(prompts)`` rows together; tok/s is the aggregate, bytes are per step."""
    from .backends.batch_protocol import BatchRow
    from .batch import batch_decoder

    decoder = batch_decoder(engine)
    engine.reset_peak_memory()
    counts = dict.fromkeys(range(len(prompts)), 0)
    t0 = time.perf_counter()
    decoder.add([BatchRow(i, p, GREEDY) for i, p in enumerate(prompts)])
    t1 = None
    while min(counts.values()) < gen_tokens:
        for row, _ in decoder.step():
            counts[row] += 1
        if t1 is None and min(counts.values()) >= 1:
            t1, first = time.perf_counter(), sum(counts.values())
    t2 = time.perf_counter()
    decoder.remove(list(counts))
    tps = (sum(counts.values()) - first) / (t2 - t1)
    steps_per_s = tps / len(prompts)
    per_step = weights.bytes_per_token + engine.kv_bytes_per_token() * len(prompts) * (len(prompts[0]) + gen_tokens // 2)
    achieved = per_step * steps_per_s / 1e9
    return Run(t1 - t0, sum(map(len, prompts)) / (t1 - t0), tps, achieved, achieved / device.peak_bandwidth_gbps,
               per_step, engine.peak_memory())


def run_bench(engine, name: str, device, settings: BenchSettings, synthetic: bool = False,
              progress: Callable[[str, int, int], None] | None = None) -> BenchRecord:
    """Warm up, then time ``settings.repeat`` runs and the context sweep."""
    weights = engine.weight_info()
    vocab = engine.config.get("vocab_size") or engine.config.get("text_config", {}).get("vocab_size")
    prompt = random_prompt(vocab, settings.prompt_tokens, settings.seed)
    total = settings.warmup + settings.repeat + len(settings.contexts)
    done = 0

    def tick(what: str):
        nonlocal done
        done += 1
        if progress:
            progress(what, done, total)

    for _ in range(settings.warmup):
        _timed_run(engine, prompt, min(settings.gen_tokens, 8), settings.kv_bits, device, weights)
        tick("warm-up")
    runs = []
    prompts = [random_prompt(vocab, settings.prompt_tokens, settings.seed + i) for i in range(settings.batch)]
    for i in range(settings.repeat):
        if settings.batch > 1:
            runs.append(_timed_batch_run(engine, prompts, settings.gen_tokens, device, weights))
        else:
            runs.append(_timed_run(engine, prompt, settings.gen_tokens, settings.kv_bits, device, weights))
        tick(f"run {i + 1}/{settings.repeat}")
    points = []
    for ctx in settings.contexts:
        run = _timed_run(engine, random_prompt(vocab, ctx, settings.seed + ctx), CONTEXT_PROBE_TOKENS,
                         settings.kv_bits, device, weights)
        r = decode_roofline(weights.bytes_per_token, engine.kv_bytes_per_token(settings.kv_bits), ctx,
                            run.decode_tps, device.peak_bandwidth_gbps, device.name, device.bandwidth_source)
        points.append(ContextPoint(ctx, run.decode_tps, r.bytes_per_token, r.ceiling_tps, r.achieved_gbps, r.mbu))
        tick(f"context {ctx}")
    summary = {k: Summary.of([getattr(r, k) for r in runs]) for k in Run.__dataclass_fields__}
    offload = getattr(engine, "offload", None)
    return BenchRecord(
        machine=_machine(device),
        model={"name": name, "params": weights.params, "bits_per_weight": round(weights.bits_per_weight, 3),
               "weight_bytes": weights.total_bytes, "bytes_per_token": weights.bytes_per_token,
               "kv_bytes_per_token": engine.kv_bytes_per_token(settings.kv_bits),
               "quantization": weights.quantization, "backend": engine.name, "device": engine.device,
               "dtype": engine.dtype, "config": _shape_config(engine.config)},
        settings=asdict(settings),
        versions=_versions(engine.name),
        runs=runs,
        summary=summary,
        contexts=points,
        offload=offload.to_dict() if offload is not None else None,
        synthetic=synthetic,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def sweep_gpu_layers(layers: int, steps: int) -> list[int]:
    """Resident layer counts from all to none in ``steps`` even steps of the offloaded fraction."""
    if steps < 2:
        raise InvalidArgumentError(f"an offload sweep needs at least 2 steps (got {steps})")
    counts = [layers - round(layers * i / (steps - 1)) for i in range(steps)]
    return list(dict.fromkeys(counts))


def run_offload_sweep(load_engine: Callable[[int], object], layers: int, name: str, device, settings: BenchSettings,
                      steps: int = 5, synthetic: bool = False,
                      progress: Callable[[str, int, int], None] | None = None) -> BenchRecord:
    """Decode speed as more and more layers stream from host memory: ``load_engine(gpu_layers)`` per step.

    ``device.pcie_h2d_gbps`` is the link the modelled ceiling uses. The
    record's runs are those of the first step that loaded (all resident, where
    it fits); a step whose resident part does not fit is left out.
    """
    counts = sweep_gpu_layers(layers, steps)
    points, first = [], None
    for i, gpu_layers in enumerate(counts):
        try:
            engine = load_engine(gpu_layers)
        except (MemoryError, DoesNotFitError, RuntimeError) as e:  # torch's CUDA out-of-memory is a RuntimeError
            if isinstance(e, RuntimeError) and "out of memory" not in str(e).lower():
                raise
            if progress:
                progress(f"{gpu_layers} layers resident: does not fit", i + 1, len(counts))
            continue
        record = run_bench(engine, name, device, settings, synthetic=synthetic)
        first = first or record
        w = engine.weight_info()
        tps = record.summary["decode_tps"].median
        per_token = record.summary["bytes_per_token"].median
        streamed = w.streamed_bytes_per_token
        if streamed:
            o = offload_ceiling(per_token - streamed, streamed, device.peak_bandwidth_gbps, device.pcie_h2d_gbps, tps)
            ceiling, pcie = o.ceiling_tps, o.achieved_pcie_gbps
        else:
            ceiling, pcie = device.peak_bandwidth_gbps * 1e9 / per_token, 0.0
        points.append(SweepPoint(gpu_layers, layers, (layers - gpu_layers) / layers, tps,
                                 record.summary["achieved_gbps"].median, per_token, streamed, pcie, ceiling,
                                 tps / ceiling))
        del engine, record
        if progress:
            progress(f"{gpu_layers} layers resident", i + 1, len(counts))
    if first is None:
        raise InvalidArgumentError("no step of the sweep fits in device memory, not even with every layer streamed")
    first.offload_sweep = points
    return first


def modelled_sweep(record: dict) -> tuple[list[float], list[float]]:
    """(offloaded fractions, offload ceiling tok/s) at every layer count of a sweep record's model.

    Layers are taken as alike: each streamed layer moves the same bytes from
    the resident read (in its resident form) to the link (in its streamed form),
    both measured from the sweep's first and last steps.
    """
    points = sorted(record["offload_sweep"], key=lambda p: p["offloaded_fraction"])
    peak, link = record["machine"]["peak_bandwidth_gbps"], record["machine"]["pcie_h2d_gbps"]
    layers = points[0]["layers"]

    def split(p):  # (layers streamed, resident bytes per step, streamed bytes per step)
        k = layers - p["gpu_layers"]
        return k, p["bytes_per_token"] - p["streamed_bytes_per_token"], p["streamed_bytes_per_token"]

    (k0, r0, _), (k1, r1, s1) = split(points[0]), split(points[-1])
    if k1 == k0:
        return [k0 / layers], [peak * 1e9 / r0]
    resident_per_layer, streamed_per_layer = (r0 - r1) / (k1 - k0), s1 / k1
    xs, ys = [], []
    for k in range(layers + 1):
        resident, streamed = max(r0 - (k - k0) * resident_per_layer, 1.0), k * streamed_per_layer
        xs.append(k / layers)
        ys.append(offload_ceiling_tps(resident, streamed, peak, link) if streamed else peak * 1e9 / resident)
    return xs, ys


def plot_sweep(record: dict, path) -> None:
    """Decode tok/s and GB/s against the share of layers streamed, with the modelled curve (PNG)."""
    plt = _pyplot()

    points = record["offload_sweep"]
    xs = [100 * p["offloaded_fraction"] for p in points]
    grid, ceilings = modelled_sweep(record)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(xs, [p["decode_tps"] for p in points], "o-", label="measured")
    top.plot([100 * f for f in grid], ceilings, "--", label="modelled ceiling (memory + link)")
    top.set_ylabel("decode tok/s")
    top.set_yscale("log")
    top.set_title(f"{record['model']['name']} on {record['machine']['device']}: layers streamed over the link "
                  f"({record['machine']['pcie_h2d_gbps']:.1f} GB/s measured)", fontsize=9)
    bottom.plot(xs, [p["achieved_gbps"] for p in points], "o-", label="all bytes read per step")
    bottom.plot(xs, [p["pcie_gbps"] for p in points], "s-", label="bytes streamed over the link")
    bottom.axhline(record["machine"]["pcie_h2d_gbps"], color="gray", linestyle=":", label="link bandwidth (probe)")
    bottom.set_ylabel("GB/s")
    bottom.set_xlabel("layers streamed from host memory (%)")
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    _save_png(fig, path)


def _shape_config(config: dict) -> dict:
    """The config fields a plan needs (drops umakit's import provenance)."""
    return {k: v for k, v in config.items() if k not in ("umakit", "quantization_config")}


def _machine(device) -> dict:
    return {
        "device": device.name, "kind": device.kind, "memory_bytes": device.memory_bytes,
        "peak_bandwidth_gbps": device.peak_bandwidth_gbps, "bandwidth_source": device.bandwidth_source,
        "working_set_bytes": device.working_set_bytes, "pcie_h2d_gbps": device.pcie_h2d_gbps,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def _versions(engine: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("umakit", "mlx", "mlx-lm", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def load_record(path) -> dict:
    """A bench JSON file, checked enough to compare."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data["machine"]["peak_bandwidth_gbps"], data["summary"]["decode_tps"]["median"], data["model"]["name"]
    except FileNotFoundError as e:
        raise InvalidArgumentError(f"no such bench file: {path}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgumentError(f"{path} is not a umakit bench record ({e})") from e
    return data


def ceiling_curve(record: dict, contexts: list[int]) -> list[float]:
    """The roofline ceiling (tok/s) of a record's model and machine at each context length."""
    m, peak = record["model"], record["machine"]["peak_bandwidth_gbps"]
    return [peak * 1e9 / (m["bytes_per_token"] + m["kv_bytes_per_token"] * c) for c in contexts]


def plot_records(records: list[dict], path) -> None:
    """Decode tok/s against context length, each machine with its roofline ceiling (PNG)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, rec in enumerate(records):
        points = rec.get("contexts") or []
        xs = [p["context"] for p in points] or [rec["settings"]["prompt_tokens"]]
        ys = [p["decode_tps"] for p in points] or [rec["summary"]["decode_tps"]["median"]]
        label = f"{rec['machine']['device']} · {rec['model']['name']} ({rec['model']['quantization']})"
        color = f"C{i}"
        ax.plot(xs, ys, "o-", color=color, label=f"{label}: measured")
        grid = sorted(set([1] + xs + [max(xs) * 2]))
        ax.plot(grid, ceiling_curve(rec, grid), "--", color=color, label=f"{label}: roofline ceiling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _save_png(fig, path)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InvalidArgumentError("--plot needs matplotlib: pip install 'umakit[plot]'") from e
    return plt


def _save_png(fig, path) -> None:
    import matplotlib.pyplot as plt

    from .fsutil import atomic_file

    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
