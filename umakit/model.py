"""`umakit.load` and the `Model` it returns: the Python API."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import backends, checkpoint
from .backends.base import Engine, KVCache, WeightInfo
from .errors import InvalidArgumentError
from .generation import Chunk, GenerationResult, collect, stream_generate
from .sampling import DEFAULT_MAX_TOKENS, SamplingParams
from .tokenizer import Message, Tokenizer


@dataclass
class LoadInfo:
    name: str
    path: Path
    backend: str
    device: str
    dtype: str
    load_s: float
    size_on_disk: int
    weights: WeightInfo
    context_length: int
    warnings: list[str] = field(default_factory=list)  # e.g. weights near the memory limit
    offload: dict | None = None  # the layer split when layers stream from host memory (OffloadPlan.to_dict)


class Model:
    """A loaded model: tokenizer, engine and the measurements around them."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: LoadInfo, peak_bandwidth: float | None = None):
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
    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        system: str | None = None,
        raw: bool = False,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop: Sequence[str] = (),
        seed: int | None = None,
        kv_bits: int | None = None,
        sampling: SamplingParams | None = None,
        **sampling_overrides,
    ) -> Iterator[Chunk]:
        """Yield text chunks as they are generated; the last chunk has the stats."""
        ids = self.encode(prompt, messages, system, raw)
        return self.stream_tokens(
            ids, self.make_cache(kv_bits), max_tokens=max_tokens, stop=stop, seed=seed,
            sampling=sampling, **sampling_overrides,
        )

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Generate a whole reply: text, token ids, finish reason and stats."""
        return collect(self.stream(prompt, **kwargs))

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
        **sampling_overrides,
    ) -> Iterator[Chunk]:
        """The token-level entry point: continue ``cache`` with ``prompt`` ids."""
        if max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be at least 1, got {max_tokens}")
        unknown = set(sampling_overrides) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise InvalidArgumentError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        params = (sampling or SamplingParams()).with_overrides(**sampling_overrides)
        limit = self.info.context_length
        if limit and cache.offset + len(prompt) + max_tokens > limit:
            max_tokens = max(limit - cache.offset - len(prompt), 0)
            if max_tokens == 0:
                raise InvalidArgumentError(
                    f"the prompt ({cache.offset + len(prompt)} tokens) fills the model's context of {limit} tokens"
                )
        stops = [stop] if isinstance(stop, str) else list(stop)
        kv_bits = getattr(cache, "kv_bits", None)
        return stream_generate(
            self.engine, self.tokenizer, prompt, cache, params, max_tokens, stop=stops, seed=seed,
            history=history, roofline=lambda stats, context: self._fill_roofline(stats, context, kv_bits),
        )

    def generate_batch(self, prompts: Sequence, **kwargs):
        """One result per prompt, in order, decoded together (see umakit.batch.generate_batch)."""
        from .batch import generate_batch

        return generate_batch(self, prompts, **kwargs)

    def stream_batch(self, prompts: Sequence, **kwargs):
        """Yield (index, result) as each prompt finishes (see umakit.batch.stream_batch)."""
        from .batch import stream_batch

        return stream_batch(self, prompts, **kwargs)

    def make_cache(self, kv_bits: int | None = None) -> KVCache:
        return self.engine.make_cache(kv_bits=kv_bits)

    def logits(self, tokens: Sequence[int]):
        """Float32 logits (T, V) of a full forward pass over ``tokens``."""
        return self.engine.logits(tokens)

    # -- measurements -------------------------------------------------------------
    @property
    def device_info(self):
        """The local device's facts (peak bandwidth measured once per machine on CPU)."""
        if self._device_info is None:
            from .hardware import detect_local

            self._device_info = detect_local(self.info.device, override_gbps=self._peak_bandwidth,
                                             link=self.info.offload is not None)
        return self._device_info

    def _fill_roofline(self, stats, context_tokens: int, kv_bits: int | None = None) -> None:
        from .roofline import decode_roofline

        dev = self.device_info
        r = decode_roofline(
            self.info.weights.bytes_per_token, self.engine.kv_bytes_per_token(kv_bits), context_tokens, stats.decode_tps,
            dev.peak_bandwidth_gbps, dev.name, dev.bandwidth_source,
        )
        stats.bytes_per_token = r.bytes_per_token
        stats.ceiling_tps = r.ceiling_tps
        stats.achieved_gbps = r.achieved_gbps
        stats.peak_gbps = r.peak_gbps
        stats.mbu = r.mbu
        stats.device_name = r.device_name
        stats.bandwidth_source = r.bandwidth_source
        streamed = self.info.weights.streamed_bytes_per_token
        if streamed:
            from .roofline import offload_ceiling

            o = offload_ceiling(r.bytes_per_token - streamed, streamed, dev.peak_bandwidth_gbps, dev.pcie_h2d_gbps,
                                stats.decode_tps)
            stats.pcie_bytes_per_token = streamed
            stats.pcie_gbps = o.achieved_pcie_gbps
            stats.pcie_peak_gbps = o.pcie_gbps
            stats.offload_ceiling_tps = o.ceiling_tps
            stats.overlap_efficiency = o.efficiency


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
) -> Model:
    """Load a model directory, Hub repo id, .gguf file, or (None) the built-in default.

    ``backend`` is "auto", "mlx", "torch" or "cuda"; ``dtype`` is the compute
    dtype ("auto": float32 on CPU, the checkpoint's dtype on a GPU).
    ``quantize`` (e.g. ``4`` or ``{"bits": 4, "group_size": 64, "recipe": "mixed"}``)
    quantizes a float checkpoint in memory, without writing files (mlx backend).
    ``needs`` names features the caller will use (``{"kv_bits", "batch"}``), so
    that "auto" picks an engine that has them. ``progress(bytes_done, bytes_total)``
    is called as the weights are read. ``gpu_layers`` (keep the first N layers
    in device memory) or ``vram_budget`` (bytes or "24GB": keep as many as fit)
    stream the remaining layers from host memory on every step (torch backend;
    on a CPU the copies are host copies, see umakit/offload.py).
    """
    t0 = time.perf_counter()
    offload = gpu_layers is not None or vram_budget is not None
    needs = frozenset(needs) | ({"quantize"} if quantize is not None else set()) | ({"offload"} if offload else set())
    engine_name, device = backends.resolve(backend, device, needs)
    path = checkpoint.resolve(model)
    ckpt = checkpoint.open_checkpoint(path)
    tokenizer = Tokenizer(path, ckpt.config, extra_eos_ids=checkpoint.generation_eos_ids(path, ckpt.config))
    options = {"quantize": quantize} if quantize is not None else {}
    if progress is not None:
        options["progress"] = progress
    if offload:
        options.update(gpu_layers=gpu_layers, vram_budget=vram_budget)
    engine = backends.engine_class(engine_name)(ckpt, device=device, dtype=dtype, **options)
    cfg = ckpt.config.get("text_config", ckpt.config)
    info = LoadInfo(
        name=display_name(ckpt.path),
        path=path,
        backend=engine_name,
        device=device,
        dtype=engine.dtype,
        load_s=time.perf_counter() - t0,
        size_on_disk=sum(f.stat().st_size for f in ckpt.files),
        weights=engine.weight_info(),
        context_length=int(cfg.get("max_position_embeddings") or 0),
        offload=engine.offload.to_dict() if getattr(engine, "offload", None) is not None else None,
    )
    # With layers streaming, the device holds only the resident part; the host holds all of it.
    resident = info.offload["resident_bytes"] if info.offload and device != "cpu" else info.weights.total_bytes
    info.warnings = memory_warnings(resident, device)
    return Model(engine, tokenizer, info, peak_bandwidth=peak_bandwidth)


NEAR_LIMIT = 0.9  # warn when weights take more than this share of usable memory


def memory_warnings(weight_bytes: int, device: str) -> list[str]:
    """A warning, with the fix, when the weights are near or over usable memory."""
    gib = weight_bytes / 2**30
    if device == "cpu":
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where, fix = "RAM", "use a smaller or more quantized model (umakit quantize --bits 4)"
    else:
        from .hardware import detect_local

        dev = detect_local(device)
        limit = dev.usable_bytes
        if dev.kind == "apple":
            where = "the GPU's recommended working set"
            fix = (f"raise it with `sudo sysctl iogpu.wired_limit_mb={int(weight_bytes * 1.2 / 2**20)}` "
                   "or use a more quantized model (umakit quantize --bits 4)")
        else:
            where, fix = "VRAM", "use a more quantized model (umakit quantize --bits 4)"
    if weight_bytes <= NEAR_LIMIT * limit:
        return []
    return [f"the weights ({gib:.1f} GiB) are {weight_bytes / limit:.0%} of {where} ({limit / 2**30:.1f} GiB); "
            f"generation may swap or fail: {fix}"]


def display_name(path: Path) -> str:
    """A checkpoint's name: the repo id of a Hub snapshot (.../models--org--name/snapshots/<hash>), else the folder's."""
    path = Path(path)
    for parent in path.parents:
        if parent.name.startswith("models--"):
            return parent.name[len("models--"):].replace("--", "/")
    return path.name
