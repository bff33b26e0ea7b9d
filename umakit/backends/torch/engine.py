"""PyTorch engine: umakit's compact model, streamed from safetensors, on CUDA or CPU.

How quantized (MLX affine) layers run, by compute dtype:

CPU, float32           dequantized once at load: exact, but reads 4 bytes a weight.
CPU, float16 ("auto"   float16 weights, float32 inputs and sums (FBGEMM): 2 bytes a
 where FBGEMM exists    weight, weights rounded to float16 (x86 only), the same greedy
 and bfloat16 is not    tokens as float32; float32 where FBGEMM is missing.
 faster)
CPU, bfloat16 ("auto"  packed: umakit's affine kernel, every width at its own bits
 for quantized models   (cpu/affine_kernel.py; AVX2 or AVX-512), else torch's int4
 where a packed form    kernels for 4/8-bit layers (AVX-512): bfloat16 or int8 kernel
 beats FBGEMM)          inputs, float32 sums, activations and cache
                       (quant/forms.activation_dtype). On SmolLM2 Q4_1: over 2x
                       float16's decode (benchmarks/cpu_engines.py); see quant/forms.cpu_auto_dtype.
                       For the Llama family a decode step's layers run in one C++
                       call (cpu/fused.py, built once per machine by cpu/build.py).
CUDA ("auto": the checkpoint's half type)  tinygemm int4 in bfloat16, otherwise a
                       fused Triton dequantize-matvec; the decode step is a CUDA graph.

With ``gpu_layers``/``vram_budget`` the layers past the resident ones live in
host memory and stream through a ring of device buffers on every forward
pass (offload/layers.py here; the split: umakit/plan/placement.py). Loading lives in
load/loader.py, synthetic models in load/synthetic.py, execution forms in quant/forms.py. Streamed layers need
execution forms made of plain tensors, so on CPU they run in float32, and
the decode step runs eagerly (no CUDA graph). So does a decode step over a
quantized KV cache (``kv_bits``, quant_cache.py): the CUDA graphs and the
fused CPU step read and write a float cache in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, Sequence

import numpy as np
import torch

from umakit.checkpoint.files import Checkpoint
from umakit.errors import BackendUnavailableError, InvalidArgumentError
from umakit.plan.placement import RING_SLOTS
from umakit.plan.roofline import kv_bytes_per_token
from umakit.generate.sampling import SamplingParams, recent_tokens
from umakit.backends import common
from umakit.backends.base import PREFILL_CHUNK, Lookup, WeightInfo, refuse_options
from umakit.backends.torch import SPEC
from umakit.backends.torch.cpu import build
from umakit.backends.torch import crossover
from umakit.backends.torch import exact_rows, held, peak
from umakit.backends.torch.batch_decoder import TorchBatchDecoder
from umakit.backends.torch.cache import GROW_STEP, StaticKVCache
from umakit.backends.torch.ragged_cache import kv_cache
from umakit.backends.torch.quant_cache import QuantizedKVCache
from umakit.backends.torch.quant.forms import activation_dtype, describe_execution
from umakit.backends.torch.cuda.graphs import GraphDecoder
from umakit.backends.torch.load.loader import (
    CUDA_CACHE_TOKENS,
    SAFETENSORS_FLOATS,
    build_model,
    check_fits,
    compute_dtype,
    layer_of,
    plan_offload,
    stream_checkpoint,
)
from umakit.backends.torch.model.llama import ModelArgs
from umakit.backends.torch.offload.experts import ExpertStreamer, plan_expert_offload
from umakit.backends.torch.cpu.fused import FusedDecoder, covers, native_norms
from umakit.backends.torch.offload.layers import LayerStreamer
from umakit.backends.torch.load import exact, gemma4_experts, gguf_layers, openai_experts
from umakit.backends.torch.load.packed import PackedCache
from umakit.backends.torch.cpu import affine_kernel
from umakit.backends.torch.sampler import TorchOps
from umakit.backends.torch.load.synthetic import random_tensors, synthetic_shapes


class TorchEngine:
    """`umakit.backends.base.Engine` on PyTorch: umakit's compact model on CUDA or CPU."""

    spec = SPEC
    name = SPEC.name
    features = SPEC.features
    load_notes: tuple[str, ...] = ()

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, *, device: str, dtype: str = "auto", progress=None,
                        quantize: int | dict | None = None, gpu_layers: int | None = None,
                        vram_budget: int | str | None = None) -> "TorchEngine":
        """``gpu_layers`` (keep the first N layers resident) or ``vram_budget`` (bytes, or "24GB") stream the
        other layers from host memory on every forward pass (see umakit/plan/placement.py)."""
        refuse_options(SPEC, quantize=quantize)
        if not (_packs(device, compute_dtype(dtype, [], device, ckpt.config.get("quantization")), ckpt.config)
                and affine_kernel.available()):
            ckpt = ckpt.complete()  # a GGUF's Q6_K layers, read re-quantized to 8 bits, not exactly (load/exact.py)
        shapes = {k: t.shape for k, t in ckpt.tensors.items()}
        floats = [SAFETENSORS_FLOATS[t.dtype] for t in ckpt.tensors.values() if t.dtype in SAFETENSORS_FLOATS]
        staging = "cpu" if gpu_layers is not None or vram_budget is not None else device
        # gpt-oss's experts as the model holds them (OpenAI's MXFP4 as 5-bit affine: quantized from here on)
        config, shapes = openai_experts.layout(ckpt.config, shapes)
        shapes = gemma4_experts.layout(config, shapes)  # transformers' fused gate_up_proj: two stacked projections
        target = compute_dtype(dtype, floats, device, config.get("quantization"))
        # CPU packed kernels: the packing of a quantized checkpoint, kept from its first load (load/packed.py)
        packs = _packs(device, target, config)
        packed = PackedCache.for_checkpoint(ckpt.path, ckpt.files) if packs else None
        packing = progress if packed is not None and packed.file is None else None  # a first load packs
        reads = None if packing else progress  # then its layers as packed tell the progress, not a map's reads
        source = openai_experts.tensors(ckpt.config, {k: t.shape for k, t in ckpt.tensors.items()},
                                        lambda skip=frozenset(): stream_checkpoint(ckpt, staging, reads, skip),
                                        packed.names if packed is not None and affine_kernel.available() else ())
        source = gemma4_experts.tensors(config, source)
        total, kept, unread = ckpt.nbytes, packed is not None and packed.file is not None, {}
        if packs and affine_kernel.available():  # a GGUF's Q6_K tensors exactly, in groups of 16, and the layers
            config, shapes, source = exact.substitute(ckpt, config, shapes, source)  # a first run left in the GGUF
            config, shapes, unread = gguf_layers.substitute(ckpt, config, shapes, kept)
            total += gguf_layers.nbytes(ckpt)
        try:
            return cls(config, shapes, source, device, target, gpu_layers, vram_budget, packed,
                       None if packing is None else lambda done: packing(min(done, total), total), unread)
        except affine_kernel.Unpacked:  # a kept packing that lacks a layer left in the GGUF: pack it all again
            if not kept:
                raise
            packed.path.unlink(missing_ok=True)
            return cls.from_checkpoint(ckpt, device=device, dtype=dtype, progress=progress, gpu_layers=gpu_layers,
                                       vram_budget=vram_budget)

    @classmethod
    def synthetic(cls, config: dict, *, device: str, dtype: str = "auto", bits: int | None = None,
                  group_size: int = 64, gpu_layers: int | None = None,
                  vram_budget: int | str | None = None) -> "TorchEngine":
        """Random weights in a real architecture's exact shapes (for benchmarks)."""
        config, shapes = synthetic_shapes(config, bits, group_size)
        target = compute_dtype(dtype, [torch.bfloat16], device, config.get("quantization"))
        offload = gpu_layers is not None or vram_budget is not None
        staging = torch.device("cpu" if offload else device)  # streamed layers never visit the device whole
        return cls(config, shapes, lambda: random_tensors(shapes, target, staging), device, target, gpu_layers,
                   vram_budget)

    @classmethod
    def from_tensors(cls, config: dict, shapes: dict, source, device: str = "cpu", dtype: str = "auto",
                     gpu_layers: int | None = None, vram_budget: int | str | None = None) -> "TorchEngine":
        """An engine over tensors made in memory, named as in a checkpoint (benchmarks/gpu_check.py).

        ``shapes`` maps every tensor name to its shape; ``source()`` yields (name, tensor) pairs.
        """
        return cls(config, shapes, source, device,
                   compute_dtype(dtype, [torch.bfloat16], device, config.get("quantization")), gpu_layers, vram_budget)

    def __init__(self, config: dict, shapes: dict, source, device: str, dtype: torch.dtype,
                 gpu_layers: int | None = None, vram_budget=None, packed: PackedCache | None = None,
                 packing=None, unread: dict | None = None):
        """An engine over ``source()``'s (name, tensor) pairs, named and shaped as ``shapes`` says;
        ``packed``: where the CPU packing of these tensors is kept between loads; ``packing(bytes)``: hears the
        source bytes of the layers a first load has packed so far; ``unread``: `build_model`'s."""
        if device not in SPEC.devices:
            raise InvalidArgumentError(f"the torch backend runs on {' or '.join(SPEC.devices)}, not {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError("PyTorch sees no CUDA device here; use --device cpu or a CUDA build of torch")
        self.device = device
        self.torch_device = torch.device(device)
        self._ops = TorchOps(self.torch_device)  # its tensors, as sampling and the batch decoder use them
        self.config = config
        self.args = ModelArgs.from_config(config)
        self.dtype = str(dtype).removeprefix("torch.")
        self.cache_dtype = activation_dtype(self.torch_device, dtype, bool(config.get("quantization")))  # and KV cache
        self.quantization = config.get("quantization")
        self.offload = None  # an OffloadPlan, in bytes as loaded, when layers stream from host memory
        plan = None
        moe = self.args.num_experts > 0  # offloads its routed experts only (offload/experts.py), never whole layers
        if gpu_layers is not None or vram_budget is not None:
            plan = (plan_expert_offload(self.args, shapes, dtype, gpu_layers, vram_budget, config) if moe
                    else plan_offload(self.args, config, shapes, dtype, gpu_layers, vram_budget))
        elif device == "cuda":
            check_fits(self.args, config, shapes, dtype, torch.cuda.mem_get_info(self.torch_device)[0])
        offloaded = plan.offloaded_layers if plan else ()
        whole, experts = ((), offloaded) if moe else (offloaded, ())
        self.experts_streamer = None  # an ExpertStreamer when routed experts live in host memory
        with torch.inference_mode():
            self.model = build_model(self.args, config, shapes, source(), self.torch_device, self.cache_dtype,
                                     dtype, whole, host_experts=experts, packed=packed, packing=packing,
                                     unread=unread)
            if whole:
                self.model.streamer = LayerStreamer(self.model.model.layers, whole, self.torch_device,
                                                    RING_SLOTS, common.category)
            if experts:
                self.experts_streamer = ExpertStreamer(self.model.model.layers, experts, self.torch_device)
        self._params = common.logical_params(shapes, self.quantization)
        if plan is not None:
            streamer = self.model.streamer
            streamed = streamer.streamed_bytes if streamer else plan.streamed_bytes
            resident = list(held.resident_tensor_bytes(self.model, self.experts_streamer))
            fixed = plan.fixed_bytes if moe else sum(n for name, n in resident if layer_of(name) is None)
            self.offload = dataclasses.replace(
                plan, fixed_bytes=fixed, resident_bytes=sum(n for _, n in resident), streamed_bytes=streamed,
                ring_bytes=streamer.ring_bytes if streamer else 0,
                counters=self.experts_streamer.counters if self.experts_streamer else None)
        # Streamed layers change weights under a graph, and dynamic RoPE its frequencies: run those eagerly.
        graphable = device == "cuda" and not offloaded and not self.model.args.rope_dynamic
        self._graphs = GraphDecoder(self.model) if graphable else None
        # CPU: the layers of a decode step in one C++ call, where the model is one it covers (cpu/fused.py)
        # and the library builds (once per machine) and loads (cpu/build.py).
        self._fused = None
        self._rows = None  # make_deterministic's eager path (exact_rows.py), where the fused step does not run
        if device == "cpu" and covers(self.model):
            if build.ensure():
                self._fused = FusedDecoder(self.model)
            elif not os.environ.get("UMAKIT_NO_NATIVE"):
                self.load_notes = (f"decode steps run eagerly, about 1.7x slower: the fused CPU step is "
                                   f"unavailable ({build.reason()})",)
        if device == "cpu" and self._fused is None and build.ensure():
            native_norms(self.model)

    # -- engine interface -----------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> StaticKVCache | QuantizedKVCache:
        """A float cache in the activation dtype, or with ``kv_bits`` (4 or 8) one that quantizes K and V."""
        a = self.args
        start = CUDA_CACHE_TOKENS if self.device == "cuda" else GROW_STEP

        def make(layers: int, kv_heads: int, head_dim: int):
            if kv_bits is not None:
                return QuantizedKVCache(layers, kv_heads, head_dim, a.max_position_embeddings, kv_bits,
                                        self.cache_dtype, self.torch_device, capacity=start)
            return StaticKVCache(layers, kv_heads, head_dim, a.max_position_embeddings, self.cache_dtype,
                                 self.torch_device, capacity=start)

        return kv_cache(a.kv_shapes, make)  # gemma4's layers of two shapes: a RaggedKVCache

    def _forward(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Logits (1, T, V) of ``tokens`` (T,) appended to ``cache``."""
        positions = torch.arange(cache.offset, cache.offset + tokens.shape[0], device=self.torch_device)
        return self.model(tokens[None], positions, cache)

    def logits(self, tokens: Sequence[int], cache: StaticKVCache | None = None) -> np.ndarray:
        cache = cache if cache is not None else self.make_cache()
        with torch.inference_mode():
            ids = torch.tensor(list(tokens), device=self.torch_device)
            exact = self._exact(cache)
            if exact is not None:
                return np.concatenate([exact(ids[i:i + PREFILL_CHUNK], cache).float().numpy()
                                       for i in range(0, len(ids), PREFILL_CHUNK)])
            fused = self._fusing(cache)
            if fused is not None and len(ids) < crossover.FUSED_ROWS:
                # Each row the bits of its own decode step, the one generation runs: a speculative
                # verification accepts exactly what plain decoding would pick, and a score is a reply's.
                return fused(ids, cache).float().cpu().numpy()
            return self._forward(ids, cache)[0].float().cpu().numpy()

    def prefill(self, tokens: Sequence[int], cache: StaticKVCache) -> None:
        """Run ``tokens`` into ``cache``; the head is skipped."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.torch_device)
        with torch.inference_mode():
            exact = self._exact(cache)
            for i in range(0, len(ids), PREFILL_CHUNK):
                chunk = ids[i:i + PREFILL_CHUNK]
                if exact is not None:  # as that many decode steps write them
                    exact.prefill(chunk, cache)
                    continue
                positions = torch.arange(cache.offset, cache.offset + len(chunk), device=self.torch_device)
                self.model(chunk[None], positions, cache, head=False)

    def generate_tokens(
        self,
        prompt: Sequence[int],
        cache: StaticKVCache,
        sampling: SamplingParams,
        seed: int | None = None,
        history: Sequence[int] = (),
    ) -> Iterator[int]:
        common.check_prompt(prompt)
        sampler = common.TokenSampler(self._ops, sampling, seed, recent_tokens(sampling, prompt, history))
        with torch.inference_mode():
            self.prefill(prompt[:-1], cache)
            last = torch.tensor(prompt[-1:], device=self.torch_device)
            # the first token from the step the others come from (the fused one on CPU), as a batch row's and a
            # speculative run's do; a CUDA graph is captured on later steps
            graphed = self._graphing(cache) is not None
            logits = self._forward(last, cache)[:, -1] if graphed else self._decode(last, cache)
        if self.device == "cuda":
            host = torch.empty(1, dtype=torch.long, pin_memory=True)
        while True:
            with torch.inference_mode():
                y, _ = sampler.sample(logits)  # (1,)
            if self.device != "cuda":
                yield int(y)
                with torch.inference_mode():
                    logits = self._decode(y, cache)
                continue
            # CUDA: queue step n+1 before handing out token n, so the device
            # computes it while the host waits only for the token's copy.
            with torch.inference_mode():
                host.copy_(y, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
                logits = self._decode(y, cache)
            copied.synchronize()
            yield int(host[0])

    def _decode(self, token: torch.Tensor, cache: StaticKVCache | QuantizedKVCache) -> torch.Tensor:
        graphs = self._graphing(cache)
        if graphs is not None:
            return graphs(token, cache)
        fused = self._fusing(cache)
        return fused(token, cache) if fused is not None else self._forward(token, cache)[:, -1]

    def _decode_rows(self, tokens: torch.Tensor, positions: list[int], cache, span: int,
                     slots: list[int] | None = None) -> torch.Tensor:
        """Logits (B, V) of one token a row of a batch cache (`TorchBatchDecoder`), row b at ``positions[b]`` of
        slot b, or of slot ``slots[b]`` (a speculating row's token and proposals: consecutive rows of one slot)."""
        fused = self._fusing(cache)
        if fused is not None:
            return fused.rows(tokens, positions, cache, slots)
        where = torch.tensor(positions, dtype=torch.long, device=self.torch_device)
        with crossover.rows_alone():  # each row the kernel's bits of its lone step, however many rows
            return self.model.decode_rows(tokens, where, cache if slots is None else cache.slotted(slots), span)

    def _mixed_rows(self, tokens: torch.Tensor, positions: list[int], cache, span: int, prompt: Sequence[int],
                    prompt_cache) -> torch.Tensor:
        """`_decode_rows`'s logits, with ``prompt`` appended to ``prompt_cache`` in the same pass
        (`Transformer.mixed`): the eager layers, the fused step's rows taking that pass's arithmetic."""
        ids = torch.tensor(list(prompt), dtype=torch.long, device=self.torch_device)
        where = torch.tensor(positions, dtype=torch.long, device=self.torch_device)
        return self.model.mixed(tokens, where, cache, span, ids, prompt_cache)

    def make_deterministic(self) -> None:
        why = ("on CUDA a token's bits depend on the GEMM rows beside it; use --device cpu" if self.device != "cpu"
               else exact_rows.refusal(self.model))
        if why:
            raise InvalidArgumentError(f"--deterministic: {why}")
        self._rows = exact_rows.ExactRows(self)

    def _exact(self, cache) -> FusedDecoder | exact_rows.ExactRows | None:
        """Once the engine is deterministic, the path every token of ``cache`` takes, each row its own decode
        step's bits whatever rows run beside it: the fused CPU step where it runs, else the eager layers' rows.
        Else None."""
        return None if self._rows is None else self._fusing(cache) or self._rows

    def _fusing(self, cache=None) -> FusedDecoder | None:
        """The fused CPU step where it is on and applies now (no hook on a layer it would bypass), and ``cache``,
        if given, is a float one: the step reads and writes its buffers in place."""
        fused = self._fused
        float_cache = cache is None or cache.kv_bits is None
        return fused if fused is not None and float_cache and fused.applies() else None

    def _graphing(self, cache: StaticKVCache | QuantizedKVCache) -> GraphDecoder | None:
        """The CUDA graphs where they are on and ``cache`` is a float one (a graph writes its buffers in place)."""
        return self._graphs if cache.kv_bits is None else None

    def batch_decoder(self, kv_bits: int | None = None, lookup: Lookup | None = None,
                      mixed: bool | None = None) -> TorchBatchDecoder:
        if mixed and self._rows is not None:
            raise InvalidArgumentError("--mixed-steps and --deterministic: a prompt slice in the rows' pass gives "
                                       "them that pass's bits; --deterministic keeps each row's own")
        if mixed and not self.model.mixes:
            raise InvalidArgumentError(f"--mixed-steps: {self.args.model_type}'s layers on the torch engine prefill a "
                                       "prompt in a pass of its own")
        # None: mixed on CUDA, where a decode step's rows are GEMM rows anyway and the weights' one read is the
        # gain; not on a CPU, where each row takes the affine kernel's bits of its lone step (docs/performance.md)
        mixed = self.device == "cuda" and self._rows is None if mixed is None else mixed
        return TorchBatchDecoder(self, kv_bits, lookup, mixed)

    def weight_info(self) -> WeightInfo:
        execution = describe_execution(self.model) + ("; fused decode step" if self._fusing() is not None else "")
        return held.weight_info(self.model, self.experts_streamer, self._params, self.kv_bytes_per_token(),
                                self.quantization, execution, self.offload)

    def export_weights(self):
        raise InvalidArgumentError("the torch backend holds weights in execution form and cannot export them; "
                                   "use --backend mlx")

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        """Cache bytes per token over all layers, K and V (quantized: codes plus a scale and bias per group)."""
        return sum(kv_bytes_per_token(1, heads, size, kv_bits=kv_bits, dtype_bytes=self.cache_dtype.itemsize)
                   for heads, size in self.args.kv_shapes)

    def wired(self):
        """Nothing to wire: CUDA memory is the device's own, and CPU pages are the OS's to keep."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def eager(self):
        """Run decode steps eagerly, without CUDA graphs (as offloading does) or the fused CPU step, e.g. to
        compare them."""
        graphs, fused, self._graphs, self._fused = self._graphs, self._fused, None, None
        try:
            yield
        finally:
            self._graphs, self._fused = graphs, fused

    def reset_peak_memory(self) -> None:
        peak.reset(self.device)

    def peak_memory(self) -> int:
        """Peak device memory on CUDA; on CPU the process's peak resident memory."""
        return peak.measured(self.device)


def _packs(device: str, target: torch.dtype, config: dict) -> bool:
    """Whether a load packs the checkpoint's quantized layers for umakit's CPU kernels (kept in load/packed.py)."""
    return device == "cpu" and target == torch.bfloat16 and bool(config.get("quantization"))
