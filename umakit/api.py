"""`umakit.load` and the `Model` it returns (with `LoadInfo`, what a load reports): the Python API."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from umakit import backends
from umakit import checkpoint
from umakit.checkpoint import config as config_compat
from umakit.plan import roofline
from umakit.generate import speculative
from umakit.core import validate
from umakit.core.affine import DEFAULT_GROUP_SIZE
from umakit.backends.base import (DETERMINISTIC, OFFLOAD, QUANTIZE, Engine, KVCache, TokenConstraint, WeightInfo,
                                  refuse_options)
from umakit.errors import InvalidArgumentError, UnsupportedModelError
from umakit.generate.batch import BatchRun, BatchStream, generate_batch, stream_batch
from umakit.generate.constrain import from_options
from umakit.generate.options import CONSTRAINTS, MANY, ONE, SPECULATION, GenerationOptions, takes
from umakit.generate.stream import Chunk, GenerationResult, collect, stream_generate
from umakit.hardware import DeviceInfo, detect_local, memory_warnings
from umakit.plan.placement import OffloadPlan, StreamedRun
from umakit.generate.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from umakit.checkpoint.tokenizer import Message, Tokenizer

if TYPE_CHECKING:
    import numpy as np

    from umakit.generate.speculative import SpeculativeDecoder


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
    deterministic: bool = False  # every token on its own decode step's arithmetic (`Engine.make_deterministic`)


def load_info(engine: Engine, name: str, path: Path | None, load_s: float, size_on_disk: int) -> LoadInfo:
    """The `LoadInfo` of ``engine`` as loaded, with its load notes and memory warnings."""
    info = LoadInfo(
        name=name, path=path, backend=engine.name, device=engine.device, dtype=engine.dtype, load_s=load_s,
        size_on_disk=size_on_disk, weights=engine.weight_info(),
        context_length=config_compat.context_length(engine.config), offload=engine.offload,
    )
    # With layers streaming, the device holds only the resident part; the host holds all of it.
    resident = info.offload.resident_bytes if info.offload and engine.device != "cpu" else info.weights.total_bytes
    info.warnings = [*engine.load_notes, *memory_warnings(resident, engine.device)]
    return info


class Model:
    """A loaded model: tokenizer, engine and the measurements around them."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, info: LoadInfo, peak_bandwidth: float | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self._peak_bandwidth = peak_bandwidth
        self._device_info = None

    def __repr__(self) -> str:
        i = self.info
        return f"<umakit.Model {i.name} on {i.backend}/{i.device} {i.dtype}, {i.weights.quantization}>"

    # -- prompts ----------------------------------------------------------------
    def encode(
        self,
        prompt: str | None = None,
        messages: Sequence[Message] | None = None,
        system: str | None = None,
        raw: bool = False,
    ) -> list[int]:
        """Prompt token ids. A plain prompt is sent as one user message through
        the chat template unless ``raw`` (or the model has no template)."""
        if (prompt is None) == (messages is None):
            raise InvalidArgumentError("give exactly one of prompt or messages")
        if messages is None:
            if raw or self.tokenizer.chat_template is None:
                return self.tokenizer.encode((system + "\n\n" if system else "") + prompt)
            messages = [{"role": "user", "content": prompt}]
        if system is not None:
            messages = [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]
        return self.tokenizer.encode_chat(messages)

    # -- generation ---------------------------------------------------------------
    @takes(*ONE)
    def stream(self, prompt: str | None = None, *, options: GenerationOptions) -> Iterator[Chunk]:
        """Yield text chunks as they are generated; the last chunk has the finish reason and stats.

        Give ``prompt`` (a user message, sent through the chat template unless
        ``raw``) or ``messages``. ``schema``, ``regex``, ``choices`` or ``grammar``
        constrain the reply: greedy, a schema's reply always parses and validates.
        Speculative decoding is lossless: greedy text
        is unchanged and sampled text keeps its distribution; ``draft`` or
        ``prompt_lookup`` propose up to ``draft_tokens`` tokens that one target
        step verifies.
        """
        o = options
        stop = validate.request(prompt, o.messages, o.system, o.max_tokens, o.stop)
        constraint = from_options(**o.pick(CONSTRAINTS))
        speculator = self.speculator(**o.pick(SPECULATION))
        if constraint is not None:
            if speculator is not None:
                raise InvalidArgumentError(f"speculative decoding does not apply {constraint.describe()}'s mask: "
                                           "give one or the other")
            refuse_options(self.engine.spec, constrain=True)
        ids = self.encode(prompt, o.messages, o.system, o.raw)
        return self.stream_tokens(ids, self.make_cache(o.kv_bits), max_tokens=o.max_tokens, stop=stop, seed=o.seed,
                                  sampling=o.sampling_params(), speculator=speculator,
                                  constraint=None if constraint is None else constraint.matcher(self.tokenizer))

    @takes(*ONE)
    def generate(self, prompt: str | None = None, *, options: GenerationOptions) -> GenerationResult:
        """Generate a whole reply: text, token ids, finish reason and stats (as `stream` streams it)."""
        return collect(self.stream(prompt, **options.pick(ONE)))

    def stream_tokens(
        self,
        prompt: Sequence[int],
        cache: KVCache,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: Sequence[str] | str = (),
        seed: int | None = None,
        history: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        speculator: SpeculativeDecoder | None = None,
        constraint: TokenConstraint | None = None,
    ) -> Iterator[Chunk]:
        """The token-level entry point: continue ``cache`` with ``prompt`` ids.

        ``history`` is the text already in ``cache``, for the repetition penalty;
        ``speculator`` (from `Model.speculator`) decodes speculatively; ``constraint``
        (`umakit.generate.constrain.Constraint.matcher`; ``cache`` empty) masks every token.
        """
        if max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be at least 1, got {max_tokens}")
        params = sampling or SamplingParams()
        limit = self.info.context_length
        if limit and cache.offset + len(prompt) + max_tokens > limit:
            max_tokens = max(limit - cache.offset - len(prompt), 0)
            if max_tokens == 0:
                raise InvalidArgumentError(
                    f"the prompt ({cache.offset + len(prompt)} tokens) fills the model's context of {limit} tokens"
                )
        stops = [stop] if isinstance(stop, str) else list(stop)
        kv = self.engine.kv_bytes_per_token(cache.kv_bits)
        return _wired(self.engine, stream_generate(
            self.engine, self.tokenizer, prompt, cache, params, max_tokens, stop=stops, seed=seed,
            history=history, measure=lambda tps, context, streamed=None: self.measure_decode(tps, context, kv,
                                                                                           streamed),
            speculator=speculator, constraint=constraint,
        ))

    @takes(*SPECULATION)
    def speculator(self, *, options: GenerationOptions) -> SpeculativeDecoder | None:
        """A speculative decoder for this model (None when neither ``draft`` nor ``prompt_lookup`` is given).

        A ``draft`` given as a path is loaded on this model's engine and device, on every
        call: to generate repeatedly, load it once with `umakit.load` and pass the `Model`.
        """
        draft = options.draft
        if isinstance(draft, (str, os.PathLike)):
            draft = load(draft, backend=self.info.backend, device=self.info.device)
        return speculative.speculator(self, draft=draft, prompt_lookup=options.prompt_lookup,
                                      draft_tokens=options.draft_tokens, ngram=options.ngram)

    @takes(*MANY)
    def generate_batch(self, prompts: Sequence, *, options: GenerationOptions) -> BatchRun:
        """One `GenerationResult` per prompt, in order, decoded together (a `umakit.BatchRun`).

        Each prompt is a string, a message list, or a dict with ``prompt`` or
        ``messages`` plus its own settings (any of the options here but
        ``batch_size``), which override these for that prompt.
        """
        return generate_batch(self, prompts, **self._drafted(options.pick(MANY)))

    @takes(*MANY, "on_error")
    def stream_batch(self, prompts: Sequence, *, options: GenerationOptions) -> BatchStream:
        """A `umakit.BatchStream`: iterate it for ``(index, result)`` as each prompt finishes (prompts as
        `generate_batch` takes them)."""
        return stream_batch(self, prompts, **self._drafted(options.pick((*MANY, "on_error"))))

    def _drafted(self, picked: dict) -> dict:
        """The options with a ``draft`` given as a path loaded on this model's engine and device."""
        if isinstance(picked.get("draft"), (str, os.PathLike)):
            picked["draft"] = load(picked["draft"], backend=self.info.backend, device=self.info.device)
        return picked

    def make_cache(self, kv_bits: int | None = None) -> KVCache:
        """An empty KV cache for this model (``kv_bits`` 4 or 8: quantized, where the engine offers it)."""
        return self.engine.make_cache(kv_bits=kv_bits)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Float32 logits (T, V) of a full forward pass over ``tokens``."""
        return self.engine.logits(tokens)

    # -- measurements -------------------------------------------------------------
    @property
    def device_info(self) -> DeviceInfo:
        """The local device's facts (peak bandwidth measured once per machine on CPU)."""
        if self._device_info is None:
            self._device_info = detect_local(self.info.device, override_gbps=self._peak_bandwidth,
                                             link=self.info.offload is not None)
        return self._device_info

    def measure_decode(self, tokens_per_s: float | None, context_tokens: int, kv_bytes_per_token: float | None = None,
                       streamed: StreamedRun | None = None):
        """(RooflineStats, OffloadStats or None) of decoding at ``context_tokens`` at ``tokens_per_s``.

        ``streamed``: what the engine's copy counters saw over the run (else the plan's bytes per
        token, and the device cache's hit rate since load)."""
        w, plan = self.info.weights, self.engine.offload
        kv = self.engine.kv_bytes_per_token() if kv_bytes_per_token is None else kv_bytes_per_token
        if streamed is None:
            hit = plan.counters.hit_rate if plan is not None and plan.counters is not None else None
            streamed = StreamedRun(w.streamed_bytes_per_token, hit)
        where = dict(placement=plan.placement if plan is not None else "", hit_rate=streamed.hit_rate,
                     comm_s_per_token=w.comm_s_per_token)
        stats = roofline.measure_decode(w.bytes_per_token, streamed.bytes_per_token, kv, context_tokens,
                                        tokens_per_s, self.device_info, **where)
        dev, achieved = self.device_info, stats[0].achieved_gbps
        if dev.bandwidth_source == "measured" and achieved and achieved > dev.peak_bandwidth_gbps:
            # the cached probe was taken on a busy machine: measure it again (at least what this run read)
            self._device_info = detect_local(self.info.device, link=self.info.offload is not None,
                                             achieved_gbps=achieved)
            stats = roofline.measure_decode(w.bytes_per_token, streamed.bytes_per_token, kv, context_tokens,
                                            tokens_per_s, self._device_info, **where)
        return stats


def _wired(engine: Engine, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """``chunks`` consumed under the engine's wiring (held from the first chunk until closed; the
    CLI's own hold nests around it)."""
    with engine.wired():
        yield from chunks


def load(
    model: str | os.PathLike | None = None,
    *,
    backend: str = "auto",
    device: str | None = None,
    dtype: str = "auto",
    peak_bandwidth: float | None = None,
    quantize: int | dict | None = None,
    needs: frozenset[str] = frozenset(),
    progress: Callable[[int, int], None] | None = None,
    gpu_layers: int | None = None,
    vram_budget: int | str | None = None,
    parallel: str | None = None,
    import_progress: Callable[[int, int], None] | None = None,
    deterministic: bool = False,
) -> Model:
    """Load a model directory, Hub repo id, .gguf file, or (None) the built-in default.

    ``backend`` is "auto", "mlx", "torch", "transformers" or "cuda"; ``dtype`` is the compute
    dtype ("auto": float32 on CPU, the checkpoint's dtype on a GPU).
    ``quantize`` (e.g. ``4`` or ``{"bits": 4, "group_size": 64, "recipe": "mixed"}``)
    quantizes a float checkpoint in memory, without writing files (mlx backend).
    ``needs`` names features the caller will use (``{"kv_bits", "batch"}``), so
    that "auto" picks an engine that has them. ``progress(bytes_done, bytes_total)``
    is called as the weights are read; ``import_progress(bytes_done, bytes_total)`` as a GGUF's (or
    GPTQ, AWQ, compressed-tensors) tensors are imported, on its first run only. ``gpu_layers`` (keep the first N layers
    in device memory) or ``vram_budget`` (bytes or "24GB": keep as many as fit)
    stream the remaining layers from host memory on every step (torch backend;
    on a CPU the copies are host copies, see umakit/plan/placement.py). ``parallel`` ("tensor" or "pipeline"), under
    mlx.launch: this rank's shard of the model; rank 0 gets the Model, the other ranks follow it, then exit.
    ``deterministic``: every token the model computes gets its own decode step's bits, so a greedy or seeded
    reply does not depend on how its prompt was split or what ran beside it (`Engine.make_deterministic`).
    """
    t0 = time.perf_counter()
    offload = gpu_layers is not None or vram_budget is not None
    needs = frozenset(needs) | ({QUANTIZE} if quantize is not None else set()) | ({OFFLOAD} if offload else set()) \
        | ({DETERMINISTIC} if deterministic else set())
    backend = backends.parallel_backend(backend, parallel)
    backends.resolve(backend, device, needs)  # refuse the user's words before fetching or importing a model
    # a GGUF's first use writes what the engine that loads it reads (chosen by the model's architecture)
    def reads(model_type: str | None) -> bool:  # whether the engine these words choose reads the exact groups
        return backends.reads_exact_groups(backend, device, dtype, needs, model_type)

    path = checkpoint.resolve(model, import_progress, defer_copies=reads, leave_layers=reads)
    ckpt = checkpoint.open_checkpoint(path, import_progress)  # each engine completes what it reads (its docstring)
    kind, asked = (config_compat.architecture(ckpt.config), config_compat.rope_kind(ckpt.config)), device
    engine_name, device, choice_note = backends.choose(backend, device, needs, *kind)
    tokenizer = Tokenizer(path, ckpt.config, extra_eos_ids=checkpoint.generation_eos_ids(path, ckpt.config))
    options = dict(parallel=parallel, dtype=dtype, progress=progress, quantize=quantize, gpu_layers=gpu_layers,
                   vram_budget=vram_budget)
    try:
        engine = backends.load_engine(engine_name, ckpt, device=device, **options)
    except UnsupportedModelError as e:  # "auto"'s pick cannot hold this checkpoint: the next engine that runs it
        fallback = backends.after((engine_name, device), asked, needs, *kind) if backend == "auto" else None
        if fallback is None:
            raise
        try:
            engine = backends.load_engine(fallback[0], ckpt, device=fallback[1], **options)
        except UnsupportedModelError:
            raise e from None  # the first engine's reason: the checkpoint is what neither holds
        choice_note = f"running on {fallback[0]} ({fallback[1]}): {engine_name} cannot load it ({e})"
        engine_name, device = fallback
    if deterministic:
        engine.make_deterministic()
    info = load_info(engine, checkpoint.display_name(ckpt.path), path, time.perf_counter() - t0,
                      checkpoint.size_on_disk(path))
    if choice_note:  # why "auto" passed over its first engine, shown with the load's warnings
        info.warnings.insert(0, choice_note)
    info.deterministic = deterministic
    return Model(engine, tokenizer, info, peak_bandwidth=peak_bandwidth)


def load_synthetic(
    preset: str | dict,
    *,
    backend: str = "auto",
    device: str | None = None,
    dtype: str = "auto",
    bits: int | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    peak_bandwidth: float | None = None,
    needs: frozenset[str] = frozenset(),
    gpu_layers: int | None = None,
    vram_budget: int | str | None = None,
) -> Model:
    """A model of random weights in a real architecture's exact shapes, for benchmarks.

    ``preset`` is a built-in preset name (see `umakit plan`) or a config dict;
    ``bits`` (4 or 8) quantizes it in groups of ``group_size``. It has no
    tokenizer: use the token-level API (`Model.engine`, `Model.stream_tokens`).
    """
    from umakit.plan.planner import load_preset

    t0 = time.perf_counter()
    offload = gpu_layers is not None or vram_budget is not None
    needs = frozenset(needs) | ({OFFLOAD} if offload else set())
    config = load_preset(preset) if isinstance(preset, str) else dict(preset)
    engine_name, device, choice_note = backends.choose(backend, device, needs, config_compat.architecture(config),
                                                       config_compat.rope_kind(config))
    engine = backends.engine_class(engine_name).synthetic(
        config, device=device, dtype=dtype, bits=bits, group_size=group_size, gpu_layers=gpu_layers,
        vram_budget=vram_budget)
    name = preset if isinstance(preset, str) else str(config.get("model_type", "synthetic"))
    info = load_info(engine, name, None, time.perf_counter() - t0, 0)
    if choice_note:
        info.warnings.insert(0, choice_note)
    return Model(engine, None, info, peak_bandwidth=peak_bandwidth)
