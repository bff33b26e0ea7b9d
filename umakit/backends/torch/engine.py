"""PyTorch engine: umakit's compact model, streamed from safetensors, on CUDA or CPU.

How quantized (MLX affine) layers run, by compute dtype:

CPU, float32           dequantized once at load: exact, but reads 4 bytes a weight.
CPU, float16 ("auto"   float16 weights, float32 inputs and sums (FBGEMM): 2 bytes a
 where FBGEMM exists)  weight, weights rounded to float16 (x86 only). 3.5x the decode
                       speed of float32 on SmolLM2 (benchmarks/cpu_engines.py), with
                       the same greedy tokens; float32 elsewhere.
CPU, bfloat16          torch's int4 kernels after an exact repack: ~0.6 bytes a
                       weight, inputs and outputs rounded to bfloat16.
CUDA ("auto": the checkpoint's half type)  tinygemm int4 in bfloat16, otherwise a
                       fused Triton dequantize-matvec; the decode step is a CUDA graph.

With ``gpu_layers``/``vram_budget`` the layers past the resident ones live in
host memory and stream through a ring of device buffers on every forward
pass (offload.py here; the split: umakit/offload.py). Streamed layers need
execution forms made of plain tensors, so on CPU they run in float32, and
the decode step runs eagerly (no CUDA graph).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import sys
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ...checkpoint import Checkpoint
from ...errors import BackendUnavailableError, CheckpointError, DoesNotFitError, InvalidArgumentError
from ...offload import RING_SLOTS, OffloadPlan, parse_size, plan_layers
from ...plan import plan_model
from ...roofline import kv_bytes_per_token
from ...sampling import SamplingParams, seed_or_random
from ..base import WeightInfo
from . import quant
from .cache import GROW_STEP, StaticKVCache
from .model import ModelArgs, RMSNorm, Transformer, fuse_projections, rope_inv_freq
from .offload import LayerStreamer
from .sampling import make_sampler

PREFILL_STEP = 512  # tokens per prefill chunk: bounds attention memory on long prompts
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAFETENSORS_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
CUDA_CACHE_TOKENS = 4096  # initial KV capacity on CUDA, so captured decode graphs rarely go stale


class TorchEngine:
    name = "torch"

    def __init__(self, ckpt: Checkpoint, device: str = "cpu", dtype: str = "auto", progress=None,
                 gpu_layers: int | None = None, vram_budget: int | str | None = None):
        """``gpu_layers`` (keep the first N layers resident) or ``vram_budget`` (bytes, or "24GB") stream the
        other layers from host memory on every forward pass (see umakit/offload.py)."""
        shapes = {k: t.shape for k, t in ckpt.tensors.items()}
        floats = [SAFETENSORS_FLOATS[t.dtype] for t in ckpt.tensors.values() if t.dtype in SAFETENSORS_FLOATS]
        staging = "cpu" if gpu_layers is not None or vram_budget is not None else device
        self._setup(ckpt.config, shapes, lambda: _stream(ckpt, staging, progress), device,
                    _compute_dtype(dtype, floats, device), gpu_layers, vram_budget)

    @classmethod
    def from_tensors(cls, config: dict, shapes: dict, source, device: str = "cpu", dtype: str = "auto",
                     gpu_layers: int | None = None, vram_budget: int | str | None = None):
        """An engine over tensors made in memory, named as in a checkpoint (synthetic benchmark models).

        ``shapes`` maps every tensor name to its shape; ``source()`` yields (name, tensor) pairs.
        """
        self = cls.__new__(cls)
        self._setup(config, shapes, source, device, _compute_dtype(dtype, [torch.bfloat16], device),
                    gpu_layers, vram_budget)
        return self

    @classmethod
    def synthetic(cls, config: dict, device: str = "cpu", dtype: str = "auto",
                  bits: int | None = None, group_size: int = 64, gpu_layers: int | None = None,
                  vram_budget: int | str | None = None) -> "TorchEngine":
        """Random weights in a real architecture's exact shapes (for benchmarks)."""
        config = dict(config)
        args = ModelArgs.from_config(config)
        with torch.device("meta"):
            model = Transformer(args)
        shapes: dict[str, tuple] = {}
        for path, m in model.named_modules():
            if isinstance(m, RMSNorm):
                shapes[f"{path}.weight"] = tuple(m.weight.shape)
            if not isinstance(m, (nn.Linear, nn.Embedding)) or (path == "lm_head" and args.tie_word_embeddings):
                continue
            rows, cols = m.weight.shape
            if bits and cols % group_size == 0:
                shapes[f"{path}.weight"] = (rows, cols * bits // 32)
                shapes[f"{path}.scales"] = shapes[f"{path}.biases"] = (rows, cols // group_size)
            else:
                shapes[f"{path}.weight"] = (rows, cols)
            if getattr(m, "bias", None) is not None:
                shapes[f"{path}.bias"] = (rows,)
        if bits:
            config["quantization"] = {"group_size": group_size, "bits": bits}
        target = _compute_dtype(dtype, [torch.bfloat16], device)

        offload = gpu_layers is not None or vram_budget is not None
        staging = torch.device("cpu" if offload else device)  # streamed layers never visit the device whole

        def source():
            for name, shape in shapes.items():
                packed = name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales" in shapes
                yield name, _random_tensor(name, shape, packed, target, staging)

        return cls.from_tensors(config, shapes, source, device, str(target).removeprefix("torch."),
                                gpu_layers, vram_budget)

    def _setup(self, config: dict, shapes: dict, source, device: str, dtype: torch.dtype,
               gpu_layers: int | None = None, vram_budget=None) -> None:
        if device not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"the torch backend runs on cuda or cpu, not {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError("PyTorch sees no CUDA device here; use --device cpu or a CUDA build of torch")
        self.device = device
        self._device = torch.device(device)
        self.config = config
        self.args = ModelArgs.from_config(config)
        self.dtype = str(dtype).removeprefix("torch.")
        # On CPU, float16 means float16 weights with float32 activations, cache
        # and accumulation (quant.Fp16Linear): x86 CPUs have no fast half math.
        half_weights = device == "cpu" and dtype == torch.float16 and quant.Fp16Linear.available()
        self._dtype = torch.float32 if half_weights else dtype  # activations and KV cache
        self.quantization = config.get("quantization")
        self.offload = None  # an OffloadPlan, in bytes as loaded, when layers stream from host memory
        plan = None
        if gpu_layers is not None or vram_budget is not None:
            plan = _plan_offload(self.args, config, shapes, dtype, gpu_layers, vram_budget)
        elif device == "cuda":
            _check_fits(self.args, config, shapes, dtype, torch.cuda.mem_get_info(self._device)[0])
        offloaded = plan.offloaded_layers if plan else ()
        with torch.inference_mode():
            self.model = build_model(self.args, config, shapes, source(), self._device, self._dtype, dtype, offloaded)
            if offloaded:
                self.model.streamer = LayerStreamer(self.model.model.layers, offloaded, self._device, RING_SLOTS,
                                                    _category)
        self._params = _logical_params(config, shapes)
        if plan is not None:
            streamer = self.model.streamer
            streamed = streamer.streamed_bytes if streamer else 0
            resident = list(self._resident_tensor_bytes())
            self.offload = dataclasses.replace(
                plan, fixed_bytes=sum(n for name, n in resident if _layer_of(name) is None),
                resident_bytes=sum(n for _, n in resident), streamed_bytes=streamed,
                ring_bytes=streamer.ring_bytes if streamer else 0)
        self._graphs = None
        if device == "cuda" and not offloaded:  # streamed layers change weights under a graph: run eagerly
            from .kernels import GraphDecoder

            self._graphs = GraphDecoder(self.model)

    # -- engine interface -----------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> StaticKVCache:
        if kv_bits is not None:
            raise InvalidArgumentError("the torch backend does not quantize the KV cache; leave kv_bits unset")
        a = self.args
        start = CUDA_CACHE_TOKENS if self.device == "cuda" else GROW_STEP
        return StaticKVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, a.max_position_embeddings,
                             self._dtype, self._device, capacity=start)

    def _forward(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """Logits (1, T, V) of ``tokens`` (T,) appended to ``cache``."""
        positions = torch.arange(cache.offset, cache.offset + tokens.shape[0], device=self._device)
        return self.model(tokens[None], positions, cache)

    def logits(self, tokens: Sequence[int], cache: StaticKVCache | None = None) -> np.ndarray:
        cache = cache if cache is not None else self.make_cache()
        with torch.inference_mode():
            out = self._forward(torch.tensor(list(tokens), device=self._device), cache)
            return out[0].float().cpu().numpy()

    def prefill(self, tokens: Sequence[int], cache: StaticKVCache) -> None:
        """Run ``tokens`` into ``cache``; the head is skipped."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self._device)
        with torch.inference_mode():
            for i in range(0, len(ids), PREFILL_STEP):
                chunk = ids[i:i + PREFILL_STEP]
                positions = torch.arange(cache.offset, cache.offset + len(chunk), device=self._device)
                self.model(chunk[None], positions, cache, head=False)

    def generate_tokens(
        self,
        prompt: Sequence[int],
        cache: StaticKVCache,
        sampling: SamplingParams,
        seed: int | None = None,
        history: Sequence[int] = (),
    ) -> Iterator[int]:
        if not prompt:
            raise InvalidArgumentError("the prompt is empty: there is nothing to continue from")
        sampler = make_sampler(sampling)
        generator = torch.Generator(device=self._device)
        generator.manual_seed(seed_or_random(seed))
        window = sampling.repetition_context
        penalty = sampling.repetition_penalty != 1.0
        recent = (list(history)[-window:] + list(prompt))[-window:] if penalty else []
        recent = torch.tensor(recent, dtype=torch.long, device=self._device)[None]  # (1, n)
        with torch.inference_mode():
            self.prefill(prompt[:-1], cache)
            logits = self._forward(torch.tensor(prompt[-1:], device=self._device), cache)[:, -1]  # (1, V)
        if self.device == "cuda":
            host = torch.empty(1, dtype=torch.long, pin_memory=True)
        while True:
            with torch.inference_mode():
                y = sampler(logits, recent, generator)  # (1,)
                if penalty:
                    recent = torch.cat([recent, y[:, None]], dim=1)[:, -window:]
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

    def _decode(self, token: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        if self._graphs is not None:
            return self._graphs(token, cache)
        return self._forward(token, cache)[:, -1]

    def _resident_tensor_bytes(self) -> Iterator[tuple[str, int]]:
        """(name, bytes) of every weight held on the device for good (streamed layers excluded)."""
        seen: set[int] = set()
        streamer = self.model.streamer
        for name, t in _named_tensors(self.model):
            if streamer is not None and _layer_of(name) in streamer.position:
                continue  # views into the streaming ring
            if t.data_ptr() in seen:
                continue  # a tied head shares the embedding's storage
            seen.add(t.data_ptr())
            yield name, t.numel() * t.element_size()
        for name, m in self.model.named_modules():
            if isinstance(m, quant.Fp16Linear):  # FBGEMM's packed weights are not tensors
                yield name, m.packed_nbytes

    def weight_info(self) -> WeightInfo:
        by_cat: dict[str, int] = {}
        for name, n in self._resident_tensor_bytes():
            by_cat[_category(name)] = by_cat.get(_category(name), 0) + n
        streamer = self.model.streamer
        if streamer is not None:  # the host copies of the streamed layers
            for cat, n in streamer.bytes_by_category.items():
                by_cat[cat] = by_cat.get(cat, 0) + n
        total = sum(by_cat.values())
        embed = by_cat.get("embedding", 0)
        tied = "head" not in by_cat
        # A decode step reads one embedding row, but a tied head reads the whole table.
        per_token = total if tied else total - embed + embed // self.args.vocab_size
        return WeightInfo(
            total_bytes=total,
            by_category=by_cat,
            params=self._params,
            bytes_per_token=per_token,
            kv_bytes_per_token=self.kv_bytes_per_token(),
            quantization=_describe_quantization(self.quantization, self.model),
            streamed_bytes_per_token=streamer.streamed_bytes if streamer is not None else 0,
        )

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        """Cache bytes per token over all layers, K and V (this backend's cache is never quantized)."""
        a = self.args
        return kv_bytes_per_token(a.num_hidden_layers, a.num_key_value_heads, a.head_dim,
                                  kv_bits=kv_bits, dtype_bytes=self._dtype.itemsize)

    def wired(self):
        """Nothing to wire: CUDA memory is the device's own, and CPU pages are the OS's to keep."""
        return contextlib.nullcontext()

    def reset_peak_memory(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif sys.platform == "linux":
            with contextlib.suppress(OSError):  # resets VmHWM; some sandboxes forbid it
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")

    def peak_memory(self) -> int:
        """Peak device memory on CUDA; on CPU the process's peak resident memory."""
        if self.device == "cuda":
            return torch.cuda.max_memory_allocated()
        with contextlib.suppress(OSError, ValueError, StopIteration):
            with open("/proc/self/status") as f:
                return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


# -- loading ---------------------------------------------------------------------
def _compute_dtype(dtype: str, floats: list, device: str) -> torch.dtype:
    """The requested dtype; "auto" is float16 weights with float32 math on an x86 CPU, and the checkpoint's
    half precision on CUDA."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device == "cpu":
        # Half the bytes of float32 and the same float32 arithmetic (see the table above).
        return torch.float16 if quant.Fp16Linear.available() else torch.float32
    halves = [f for f in floats if f != torch.float32]
    return max(set(halves), key=halves.count) if halves else torch.bfloat16


def _quant_spec(path: str, q: dict, tensors) -> dict | None:
    """mlx-lm's rule: a per-module dict overrides; otherwise quantized iff ``{path}.scales`` exists."""
    if isinstance(q.get(path), dict):
        return {k: q[path].get(k, q.get(k)) for k in ("bits", "group_size")}
    if q.get(path) is False or f"{path}.scales" not in tensors:
        return None
    return {"bits": q.get("bits"), "group_size": q.get("group_size")}


def _swap_quantized(model: Transformer, q: dict, tensors, dtype: torch.dtype) -> None:
    for path, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        spec = _quant_spec(path, q, tensors)
        if spec is None:
            continue
        if spec["bits"] not in quant.BITS or spec["group_size"] not in quant.GROUP_SIZES:
            raise CheckpointError(f"{path}: {spec['bits']}-bit groups of {spec['group_size']} are not supported")
        try:
            if isinstance(module, nn.Embedding):
                new = quant.QuantizedEmbedding(module.num_embeddings, module.embedding_dim, **spec, dtype=dtype,
                                               device="meta")
            else:
                new = quant.QuantizedLinear(module.in_features, module.out_features, module.bias is not None,
                                            **spec, device="meta")
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)


def _sanitize(name: str) -> str | None:
    """The model's name for a checkpoint tensor (None: not a weight of this model)."""
    if "rotary_emb.inv_freq" in name:
        return None
    return name


def _expected(model: Transformer) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update({k: v for k, v in model.named_buffers() if k != "inv_freq" and v is not None})
    return out


def _stream(ckpt: Checkpoint, device: str, progress=None):
    """Each tensor of the checkpoint in turn, read straight to ``device``.

    ``progress(bytes_done, bytes_total)`` hears about every tensor read.
    """
    from safetensors import safe_open

    done, total = 0, ckpt.nbytes
    for file in ckpt.files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
                done += ckpt.tensors[key].nbytes
                if progress:
                    progress(done, total)


def build_model(args: ModelArgs, config: dict, shapes: dict, source, device: torch.device,
                dtype: torch.dtype, weights: torch.dtype | None = None, offloaded: Sequence[int] = ()) -> Transformer:
    """Build the model on the meta device, then fill it from ``source`` one tensor at a time.

    ``dtype`` is that of activations and float tensors, ``weights`` that of the
    linear layers' execution form (default: ``dtype``). The ``offloaded`` layers
    are read into host memory and converted one at a time on the device (so
    it never holds two of them), in a form made of plain tensors that can be
    streamed; the engine then hands them to a `LayerStreamer`.
    """
    weights = weights or dtype
    with torch.device("meta"):
        model = Transformer(args)
    _swap_quantized(model, config.get("quantization") or {}, shapes, dtype)
    names = {n: k for k in shapes if (n := _sanitize(k)) is not None}
    expected = _expected(model)
    tied = args.tie_word_embeddings or not any(n.startswith("lm_head.") for n in names)
    if tied:
        expected = {k: v for k, v in expected.items() if not k.startswith("lm_head.")}
    _check(expected, names, shapes)

    streamed = frozenset(offloaded)
    host = torch.device("cpu")
    for key, t in source:
        name = _sanitize(key)
        if name is None:
            continue
        target = host if _layer_of(name) in streamed else device
        if t.is_floating_point() and not name.endswith((".scales", ".biases")):
            t = t.to(device=target, dtype=dtype)
        _assign(model, name, t.to(target))

    embed = model.model.embed_tokens
    if tied:
        if isinstance(embed, quant.QuantizedEmbedding):
            model.lm_head = embed.as_linear()
        else:
            model.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, device="meta")
            model.lm_head.weight = embed.weight
    fuse_projections(model, quant.concat)
    for i in sorted(streamed):
        block = model.model.layers[i].to(device)
        quant.convert_model(block, device, weights, tensors_only=lambda path: True)
        block.to(host)
    quant.convert_model(model, device, weights, tensors_only=lambda path: _layer_of(path) in streamed)
    if tied and isinstance(embed, quant.QuantizedEmbedding) and isinstance(model.lm_head, nn.Linear):
        # The tied head was dequantized: look rows up in it and drop the packed table.
        model.model.embed_tokens = nn.Embedding.from_pretrained(model.lm_head.weight, freeze=True)
    model.inv_freq = rope_inv_freq(args).to(device)
    return model.eval()


def _layer_of(name: str) -> int | None:
    """The block index of a tensor or module path ("model.layers.3.mlp..." -> 3), None outside the blocks."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])


def _check_fits(args: ModelArgs, config: dict, shapes: dict, weights: torch.dtype, free_bytes: int) -> None:
    """Refuse, before reading any weight, a model that cannot fit the free VRAM whole, naming the flag that streams it."""
    whole = _plan_offload(args, config, shapes, weights, args.num_hidden_layers, None)
    need = whole.resident_bytes + whole.reserved_bytes
    if need <= free_bytes:
        return
    try:
        split = _plan_offload(args, config, shapes, weights, None, free_bytes)
        fix = (f"keep {split.gpu_layers} of {args.num_hidden_layers} layers on the GPU and stream the rest: "
               f"--gpu-layers {split.gpu_layers} (or --vram-budget {free_bytes / 1e9:.0f}GB)")
    except DoesNotFitError:  # not even with every layer streamed
        fix = "use a more quantized model (umakit quantize --bits 4)"
    raise DoesNotFitError(f"the model needs about {need / 1e9:.1f} GB of GPU memory but {free_bytes / 1e9:.1f} GB "
                          f"is free; {fix}")


def _plan_offload(args: ModelArgs, config: dict, shapes: dict, weights: torch.dtype, gpu_layers: int | None,
                  vram_budget) -> OffloadPlan:
    """Which layers stream, from the checkpoint's tensor sizes in the execution dtype (what CUDA runs).

    The budget also holds what `umakit plan` counts besides weights, for `CUDA_CACHE_TOKENS` tokens
    of context: the KV cache and a prefill chunk's working memory (16-bit, as on a GPU).
    """
    per_layer = [0] * args.num_hidden_layers
    fixed = 0
    for name, shape in shapes.items():
        if (name := _sanitize(name)) is None:
            continue
        count = int(np.prod(shape))
        packed = name.endswith(".weight") and f"{name.removesuffix('.weight')}.scales" in shapes
        nbytes = count * (4 if packed else 2 if name.endswith((".scales", ".biases")) else weights.itemsize)
        layer = _layer_of(name)
        if layer is None:
            fixed += nbytes
        else:
            per_layer[layer] += nbytes
    extra = plan_model(config, context=min(args.max_position_embeddings, CUDA_CACHE_TOKENS))
    budget = None if vram_budget is None else parse_size(vram_budget)
    return plan_layers(per_layer, fixed, gpu_layers=gpu_layers, vram_budget=budget,
                       reserved_bytes=extra.kv_bytes + extra.working_bytes, ring_slots=RING_SLOTS)


def _check(expected: dict, names: dict, shapes: dict) -> None:
    """Name the first missing, unexpected or mis-shaped tensor before any data is read."""
    missing = [k for k in expected if k not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    unexpected = [k for k in names if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {unexpected[0]}{more} for this model_type")
    for name, key in names.items():
        shape = tuple(expected[name].shape)
        if tuple(shapes[key]) != shape:
            raise CheckpointError(f"tensor {key} has shape {list(shapes[key])} but the config implies {list(shape)}")


def _assign(model: nn.Module, name: str, t: torch.Tensor) -> None:
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[attr] = t


def _logical_params(config: dict, shapes: dict) -> int:
    """Weights the model has (a packed word holds 32/bits of them; scales and biases are not counted)."""
    q = config.get("quantization") or {}
    n = 0
    for name, shape in shapes.items():
        if name.endswith((".scales", ".biases")) or "rotary_emb" in name:
            continue
        count = int(np.prod(shape))
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{module}.scales" in shapes:
            count = count * 32 // (_quant_spec(module, q, shapes) or {"bits": 32})["bits"]
        n += count
    return n


def _random_tensor(name: str, shape: tuple, packed: bool, dtype: torch.dtype, device: torch.device):
    """A synthetic weight: random codes and small scales when ``packed``, unit norms, small floats."""
    if packed:
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device).view(torch.uint32)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".scales"):
        return torch.full(shape, 0.002, dtype=dtype, device=device)
    if name.endswith(".biases"):
        return torch.full(shape, -0.001, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype, device=device) * 0.02


def _named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from ((k, v) for k, v in model.named_buffers(remove_duplicate=False) if k != "inv_freq")


def _category(name: str) -> str:
    if "embed" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "head"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    return "other"


def _describe_quantization(q: dict | None, model: Transformer) -> str:
    if not q:
        return "none"
    overrides = {v["bits"] for k, v in q.items() if isinstance(v, dict) and "bits" in v}
    extra = f", some layers {'/'.join(map(str, sorted(overrides)))}-bit" if overrides - {q["bits"]} else ""
    return f"{q['bits']}-bit g{q['group_size']}{extra} ({quant.describe_execution(model)})"
