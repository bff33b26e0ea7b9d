"""Throughput measurement against the bandwidth roofline (`umakit bench`).

A run prefills a prompt of random token ids, then decodes a fixed number of
tokens greedily, ignoring end-of-sequence so every run does the same work.
Clocks are read after the token is on the host (the engine's token iterator
synchronises). Every run takes a `umakit.Model` and uses only the declared
engine protocol; its roofline and offload figures come from
`umakit.plan.roofline.measure_decode` (through `Model.measure_decode`), the one
place that arithmetic lives.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from umakit.backends.base import BATCH, QUANTIZED_KV, BatchRow
from umakit.errors import DoesNotFitError, InvalidArgumentError
from umakit.plan.roofline import measure_decode
from umakit.generate.sampling import SamplingParams
from umakit.bench.records import (
    BenchRecord,
    ContextPoint,
    Run,
    SweepPoint,
    machine_dict,
    model_dict,
    summarize,
    timestamp,
    versions_dict,
)

if TYPE_CHECKING:
    from umakit.hardware import DeviceInfo
    from umakit.api import Model

GREEDY = SamplingParams(temperature=0)
DEFAULT_PROMPT_TOKENS = 512
DEFAULT_GEN_TOKENS = 128
DEFAULT_REPEAT = 5
DEFAULT_WARMUP = 1
DEFAULT_BATCH = 1
DEFAULT_SWEEP_STEPS = 5  # 0, 25, 50, 75, 100% of the layers streamed
WARMUP_TOKENS = 8  # a warm-up decodes at most this many tokens: it only has to compile and fill caches
CONTEXT_PROBE_TOKENS = 16  # decode steps timed at each context length of the sweep

Progress = Callable[[str, int, int], None]  # (what finished, steps done, steps in all)


@dataclass
class BenchSettings:
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    gen_tokens: int = DEFAULT_GEN_TOKENS
    repeat: int = DEFAULT_REPEAT
    warmup: int = DEFAULT_WARMUP
    kv_bits: int | None = None
    contexts: tuple[int, ...] = ()  # context lengths for the decode-vs-context sweep
    seed: int = 0
    batch: int = DEFAULT_BATCH  # sequences decoded together (aggregate tok/s; weights read once per step)

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.gen_tokens < 2 or self.repeat < 1 or self.warmup < 0 or self.batch < 1:
            raise InvalidArgumentError(
                "bench needs prompt tokens >= 1, gen tokens >= 2, repeat >= 1, warmup >= 0, batch >= 1")
        if self.batch > 1 and self.kv_bits is not None:
            raise InvalidArgumentError("--batch with --kv-bits is not supported: batched caches are float")

    @property
    def needs(self) -> frozenset[str]:
        """The engine features these settings use (for `umakit.load`'s ``needs``)."""
        return frozenset(({QUANTIZED_KV} if self.kv_bits is not None else set()) | ({BATCH} if self.batch > 1 else set()))

    @property
    def steps(self) -> int:
        """Progress steps of one `run_bench`: warm-ups, timed runs, context points."""
        return self.warmup + self.repeat + len(self.contexts)


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def _vocab_size(config: dict) -> int:
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def _timed_run(model: Model, prompt: list[int], gen_tokens: int, kv_bits: int | None) -> Run:
    engine = model.engine
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
    r, o = model.measure_decode(decode_tps, len(prompt) + gen_tokens // 2, engine.kv_bytes_per_token(kv_bits))
    run = Run(t1 - t0, len(prompt) / (t1 - t0), decode_tps, r.achieved_gbps, r.mbu, r.bytes_per_token,
              engine.peak_memory(), comm_share=r.comm_share)
    if o is not None:
        run.pcie_gbps, run.offload_efficiency = o.achieved_pcie_gbps, o.efficiency
    return run


def _timed_batch_run(model: Model, prompts: list[list[int]], gen_tokens: int) -> Run:
    """Decode ``len(prompts)`` rows together; tok/s is the aggregate, bytes are per step."""
    engine = model.engine
    decoder = engine.batch_decoder()
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
    rows = len(prompts)
    # One step reads the weights once and every row's cache: measured per step, tps / rows steps/s.
    r, o = model.measure_decode(tps / rows, len(prompts[0]) + gen_tokens // 2, engine.kv_bytes_per_token() * rows)
    run = Run(t1 - t0, sum(map(len, prompts)) / (t1 - t0), tps, r.achieved_gbps, r.mbu, r.bytes_per_token,
              engine.peak_memory(), comm_share=r.comm_share)
    if o is not None:
        run.pcie_gbps, run.offload_efficiency = o.achieved_pcie_gbps, o.efficiency
    return run


def run_bench(model: Model, settings: BenchSettings | None = None, progress: Progress | None = None) -> BenchRecord:
    """Warm up, then time ``settings.repeat`` runs and the context sweep of a loaded model."""
    with model.engine.wired():  # the setup `generate` runs under, so both measure the same thing
        return _run_bench(model, settings or BenchSettings(), progress)


def _run_bench(model: Model, settings: BenchSettings, progress: Progress | None) -> BenchRecord:
    engine = model.engine
    vocab = _vocab_size(engine.config)
    prompt = random_prompt(vocab, settings.prompt_tokens, settings.seed)
    done = 0

    def tick(what: str):
        nonlocal done
        done += 1
        if progress:
            progress(what, done, settings.steps)

    for _ in range(settings.warmup):
        _timed_run(model, prompt, min(settings.gen_tokens, WARMUP_TOKENS), settings.kv_bits)
        tick("warm-up")
    runs = []
    prompts = [random_prompt(vocab, settings.prompt_tokens, settings.seed + i) for i in range(settings.batch)]
    for i in range(settings.repeat):
        if settings.batch > 1:
            runs.append(_timed_batch_run(model, prompts, settings.gen_tokens))
        else:
            runs.append(_timed_run(model, prompt, settings.gen_tokens, settings.kv_bits))
        tick(f"run {i + 1}/{settings.repeat}")
    points = []
    kv = engine.kv_bytes_per_token(settings.kv_bits)
    for ctx in settings.contexts:
        run = _timed_run(model, random_prompt(vocab, ctx, settings.seed + ctx), CONTEXT_PROBE_TOKENS, settings.kv_bits)
        r, _ = model.measure_decode(run.decode_tps, ctx, kv)
        points.append(ContextPoint(ctx, run.decode_tps, r.bytes_per_token, r.ceiling_tps, r.achieved_gbps, r.mbu))
        tick(f"context {ctx}")
    offload = engine.offload
    return BenchRecord(
        machine=machine_dict(model.device_info),
        model=model_dict(model, settings.kv_bits),
        settings=asdict(settings),
        versions=versions_dict(),
        runs=runs,
        summary=summarize(runs),
        contexts=points,
        offload=offload.to_dict() if offload is not None else None,
        synthetic=model.info.path is None,
        created=timestamp(),
    )


def sweep_gpu_layers(layers: int, steps: int = DEFAULT_SWEEP_STEPS) -> list[int]:
    """Resident layer counts from all to none in ``steps`` even steps of the offloaded fraction."""
    if steps < 2:
        raise InvalidArgumentError(f"an offload sweep needs at least 2 steps (got {steps})")
    counts = [layers - round(layers * i / (steps - 1)) for i in range(steps)]
    return list(dict.fromkeys(counts))


def layer_count(config: dict) -> int:
    """Decoder layers of a config.json (a multimodal one's text model), 0 when it does not say."""
    return int(config.get("text_config", config).get("num_hidden_layers") or 0)


def run_offload_sweep(load: Callable[[int], Model], layers: int, settings: BenchSettings | None = None,
                      steps: int = DEFAULT_SWEEP_STEPS, progress: Progress | None = None) -> BenchRecord:
    """Decode speed as more and more layers stream from host memory: ``load(gpu_layers)`` per step.

    Every step is loaded with ``gpu_layers`` given (all resident too), so the
    first step's device facts include the measured link; every step's ceiling
    uses those facts, the ones the record shows. The record's runs are those of
    the first step that loaded (all resident, where it fits); a step whose
    resident part does not fit is left out.
    """
    settings = settings or BenchSettings()
    counts = sweep_gpu_layers(layers, steps)
    points, first = [], None
    for i, gpu_layers in enumerate(counts):
        try:
            model = load(gpu_layers)
        except (MemoryError, DoesNotFitError, RuntimeError) as e:  # torch's CUDA out-of-memory is a RuntimeError
            if isinstance(e, RuntimeError) and "out of memory" not in str(e).lower():
                raise
            if progress:
                progress(f"{gpu_layers} layers resident: does not fit", i + 1, len(counts))
            continue
        record = run_bench(model, settings)
        if first is None:
            first, device = record, model.device_info
        points.append(_sweep_point(model, device, settings, record, gpu_layers, layers))
        del model, record
        if progress:
            progress(f"{gpu_layers} layers resident", i + 1, len(counts))
    if first is None:
        raise InvalidArgumentError("no step of the sweep fits in device memory, not even with every layer streamed")
    first.offload_sweep = points
    return first


def _sweep_point(model: Model, device: DeviceInfo, settings: BenchSettings, record: BenchRecord, gpu_layers: int,
                 layers: int) -> SweepPoint:
    """A step's median decode speed against its ceiling: the plain roofline, or the offload one when layers stream.

    Measured on the sweep's ``device`` facts rather than the step's own: a
    probe's first reading and its cached copy differ in rounding, and one
    sweep is one machine.
    """
    tps, w, rows = record.summary["decode_tps"].median, model.info.weights, settings.batch
    r, o = measure_decode(w.bytes_per_token, w.streamed_bytes_per_token,
                          model.engine.kv_bytes_per_token(settings.kv_bits) * rows,
                          settings.prompt_tokens + settings.gen_tokens // 2, tps / rows, device)
    ceiling = o.ceiling_tps if o is not None else r.ceiling_tps
    return SweepPoint(gpu_layers, layers, (layers - gpu_layers) / layers, tps, r.achieved_gbps, r.bytes_per_token,
                      w.streamed_bytes_per_token, o.achieved_pcie_gbps if o is not None else 0.0, ceiling,
                      tps / rows / ceiling)
