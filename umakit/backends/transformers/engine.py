"""`umakit.backends.base.Engine` on transformers' model classes (see the package's docstring).

The checkpoint loads as transformers loads it (``from_pretrained``: the safetensors mapped, renamed and tied by the
model's own code), in float32 on a CPU (x86 has no fast half-precision arithmetic) and the checkpoint's half type
on CUDA; on a CPU "auto" then holds every float linear layer as FBGEMM's float16 weights with float32 math (the
torch engine's `Fp16Linear`), half the bytes a decode step reads, as the torch engine's CPU default does. A
synthetic model's linear layers can be quantized to umakit's affine layout and run in the torch engine's execution
forms (its affine kernel on a CPU, Triton on CUDA): the quantized linears swapped in for
``nn.Linear``; so are a quantized checkpoint's (MLX's layout: an imported GGUF, GPTQ, AWQ or compressed-tensors
checkpoint, `umakit quantize`'s output), mapped in by the model's own names (mapped.py), routed experts stacked as
mlx-lm stacks them included (switch.py). Around the model: umakit's
cache protocol (cache.py), its sampler, its batch rows (batch_decoder.py) and its measurements. Not here: a
quantized KV cache, offload, and the fused CPU step, which need the compact model code of the torch engine.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from umakit.backends import common
from umakit.backends.base import PREFILL_CHUNK, Lookup, WeightInfo, refuse_options
from umakit.backends.torch import peak
from umakit.backends.torch.quant import forms
from umakit.backends.torch.quant.kernels import Fp16Linear
from umakit.backends.torch.quant.layout import QuantizedLinear, quantize as quantize_weights
from umakit.backends.torch.sampler import TorchOps
from umakit.backends.transformers import SPEC
from umakit.backends.transformers.batch_decoder import TransformersBatchDecoder
from umakit.backends.transformers.cache import TransformersCache
from umakit.backends.transformers import recurrent
from umakit.checkpoint import config as config_compat
from umakit.checkpoint.hfquant.detect import native_block
from umakit.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedModelError
from umakit.generate.sampling import SamplingParams, recent_tokens
from umakit.plan.roofline import kv_bytes_per_token

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ROUTED = ".experts."  # transformers' name for a layer's routed experts


class TransformersEngine:
    """`umakit.backends.base.Engine` on a transformers model."""

    spec = SPEC
    name = SPEC.name
    features = SPEC.features
    offload = None
    load_notes: tuple[str, ...] = ()

    @classmethod
    def from_checkpoint(cls, ckpt, *, device: str, dtype: str = "auto", progress=None,
                        quantize: int | dict | None = None, gpu_layers: int | None = None,
                        vram_budget: int | str | None = None) -> TransformersEngine:
        refuse_options(SPEC, quantize=quantize, gpu_layers=gpu_layers, vram_budget=vram_budget)
        ckpt = ckpt.complete()  # its maps take a GGUF's Q6_K layers' shapes from their 8-bit copies (mapped.py)
        target, half = _dtype(dtype, device), _half_weights(dtype, device)
        stacked = any(common.ROUTED_EXPERTS in name for name in ckpt.tensors or ())
        if isinstance(ckpt.config.get("quantization"), dict) or stacked:  # MLX's layout: mapped.py
            from umakit.backends.transformers import mapped

            _check_device(device)
            with _quiet() as transformers:
                model, params = mapped.load(transformers, ckpt, torch.device(device), target)
            return cls(model, ckpt.config, device, target, params=params, quantization=ckpt.config.get("quantization"),
                       half_weights=half)
        native = native_block(ckpt.config)
        if native:  # gpt-oss's MXFP4 experts: packed (mxfp4.py)
            from umakit.backends.transformers import mxfp4

            _check_device(device)
            with _quiet() as transformers:
                model, params, dense = mxfp4.load(transformers, ckpt, torch.device(device), target)
            engine = cls(model, ckpt.config, device, target, params=params, quantization=native, half_weights=half)
            if dense:
                engine.load_notes = (f"{dense} expert projections run dequantized to {engine.dtype}: their MXFP4 "
                                     f"scales lie outside what the packed form holds exactly",)
            return engine
        with _quiet() as transformers:
            try:
                model, info = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=target,
                                                                                output_loading_info=True)
            except RuntimeError as e:  # tensors of other shapes than its model's (another layout: mlx-lm's, say)
                raise UnsupportedModelError(f"{ckpt.path}: transformers' model does not take this checkpoint's "
                                            f"tensors ({str(e).splitlines()[0][:200]})") from None
        from umakit.backends.transformers.mapped import check_loaded

        check_loaded(ckpt, model, info)
        return cls(model, ckpt.config, device, target, half_weights=half)

    @classmethod
    def synthetic(cls, config: dict, *, device: str, dtype: str = "auto", bits: int | None = None,
                  group_size: int = 64, gpu_layers: int | None = None,
                  vram_budget: int | str | None = None) -> TransformersEngine:
        """Random weights in the architecture's exact shapes; ``bits``: its linear layers quantized."""
        refuse_options(SPEC, gpu_layers=gpu_layers, vram_budget=vram_budget)
        target = _dtype(dtype, device)
        with _quiet() as transformers:
            hf_config = transformers.AutoConfig.for_model(**config)
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=target)
        return cls(model, config, device, target, bits, group_size, half_weights=_half_weights(dtype, device))

    def __init__(self, model: nn.Module, config: dict, device: str, dtype: torch.dtype, bits: int | None = None,
                 group_size: int = 64, params: int | None = None, quantization: dict | None = None,
                 half_weights: bool = False):
        """``params``, ``quantization``: of a model loaded quantized (mapped.py), whose packed layers hold no
        parameters; ``half_weights``: float linear layers as FBGEMM's float16 weights (a CPU's "auto")."""
        _check_device(device)
        self.device, self.torch_device = device, torch.device(device)
        self.dtype = str(dtype).removeprefix("torch.")
        self.config = dict(config)
        self.quantization: dict | None = quantization
        self.model = model.to(self.torch_device).eval()
        # before any quantization: the weights
        self._params = params if params is not None else sum(p.numel() for p in self.model.parameters())
        if bits is not None:
            self.quantization = {"bits": bits, "group_size": group_size}
            self.config["quantization"] = dict(self.quantization)
            _quantize_linears(self.model, bits, group_size, self.torch_device, dtype)
        if half_weights:  # named as the torch engine names its CPU default: float16 weights, float32 math
            self.dtype = "float16"
            for path, module in list(self.model.named_modules()):
                if type(module) is nn.Linear:
                    parent, _, attr = path.rpartition(".")
                    setattr(self.model.get_submodule(parent), attr, Fp16Linear(module))
        self._ops = TorchOps(self.torch_device)
        accepts = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in accepts else "past_key_values"
        self._keeps = "logits_to_keep" in accepts
        self._cache_dtype = dtype
        _quiet_kernel_fallbacks()
        if device == "cpu":
            recurrent.install(self.model)

    # -- forward passes ---------------------------------------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> TransformersCache:
        if kv_bits is not None:
            raise InvalidArgumentError("the transformers backend has no quantized KV cache (--kv-bits); use "
                                       "--backend mlx, or the torch backend for the families it runs")
        from transformers import DynamicCache

        return TransformersCache(DynamicCache(config=self.model.config))

    def _forward(self, ids: torch.Tensor, cache: TransformersCache, head: bool = True) -> torch.Tensor:
        """Logits (T, V) of ``ids`` (T,) appended to ``cache`` (the last position's alone without ``head``)."""
        where = torch.arange(cache.offset, cache.offset + len(ids), device=self.torch_device)
        options = {self._cache_arg: cache.hf, "use_cache": True, "position_ids": where[None]}
        if not head and self._keeps:
            options["logits_to_keep"] = 1
        out = self.run(ids[None], **options)
        cache.advance(len(ids))
        return out.logits[0]

    def run(self, *args, **kwargs):
        """The model's forward pass, with umakit's CPU steps where they apply (recurrent.py)."""
        with recurrent.umakit_forward():
            return self.model(*args, **kwargs)

    def step_logits(self, token: int, cache: TransformersCache) -> torch.Tensor:
        """Logits (1, V) of one token appended to ``cache`` (a decode step; batch_decoder.py)."""
        return self._forward(torch.tensor([token], device=self.torch_device), cache)[-1:]

    def logits(self, tokens: Sequence[int], cache: TransformersCache | None = None) -> np.ndarray:
        cache = cache if cache is not None else self.make_cache()
        with torch.inference_mode():
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.torch_device)
            return self._forward(ids, cache).float().cpu().numpy()

    def prefill(self, tokens: Sequence[int], cache: TransformersCache) -> None:
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.torch_device)
        with torch.inference_mode():
            for i in range(0, len(ids), PREFILL_CHUNK):
                self._forward(ids[i:i + PREFILL_CHUNK], cache, head=False)

    def generate_tokens(self, prompt: Sequence[int], cache: TransformersCache, sampling: SamplingParams,
                        seed: int | None = None, history: Sequence[int] = ()) -> Iterator[int]:
        common.check_prompt(prompt)
        sampler = common.TokenSampler(self._ops, sampling, seed, recent_tokens(sampling, prompt, history))
        with torch.inference_mode():
            self.prefill(prompt[:-1], cache)
            logits = self.step_logits(prompt[-1], cache)
        while True:
            with torch.inference_mode():
                y, _ = sampler.sample(logits)
            token = int(y)
            yield token
            with torch.inference_mode():
                logits = self.step_logits(token, cache)

    def make_deterministic(self) -> None:
        refuse_options(SPEC, deterministic=True)

    def batch_decoder(self, kv_bits: int | None = None, lookup: Lookup | None = None,
                      mixed: bool | None = None) -> TransformersBatchDecoder:
        refuse_options(SPEC, mixed=mixed)
        if kv_bits is not None:
            raise InvalidArgumentError("the transformers backend has no quantized KV cache (--kv-bits)")
        if lookup is not None and not self.make_cache().trimmable:
            kind = config_compat.architecture(self.config)
            raise InvalidArgumentError(f"speculative decoding (--prompt-lookup, --draft) gives back the positions of "
                                       f"proposals it rejects, which {kind}'s cache (sliding windows or a recurrent "
                                       "state) cannot")
        return TransformersBatchDecoder(self, lookup)

    # -- measurements -----------------------------------------------------------------------------------
    def weight_info(self) -> WeightInfo:
        by_cat: dict[str, int] = {}
        routed, seen = 0, set()
        held = [(name, t.numel() * t.element_size(), t.data_ptr())
                for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                if not name.endswith("inv_freq")]  # RoPE's tables are no weights
        held += [(f"{name}.weight", m.packed_nbytes, None) for name, m in self.model.named_modules()
                 if isinstance(m, Fp16Linear)]  # FBGEMM's packed weights are not tensors
        for name, n, where in held:
            if where is not None and where in seen:  # a tied head
                continue
            seen.add(where)
            by_cat[common.category(name)] = by_cat.get(common.category(name), 0) + n
            routed += n if ROUTED in name or common.ROUTED_EXPERTS in name else 0
        text = config_compat.text_config(self.config)
        experts = text.get("num_local_experts") or text.get("num_experts")
        share = text.get("num_experts_per_tok", 1) / experts if experts else 1.0
        return common.weight_info(by_cat, self._params, text.get("vocab_size", 0), self.kv_bytes_per_token(),
                                  self.quantization, forms.describe_execution(self.model), 0, routed, share)

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        """Bytes a token adds to the attention layers' caches (linear-attention layers keep a fixed state)."""
        c = config_compat.text_config(self.config)
        kinds = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
        layers = sum(1 for k in kinds if "attention" in k and "linear" not in k)
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        return kv_bytes_per_token(layers, heads, head_dim, kv_bits=kv_bits, dtype_bytes=self._cache_dtype.itemsize)

    def export_weights(self):
        raise InvalidArgumentError("the transformers backend does not export weights; use --backend mlx")

    def wired(self):
        return contextlib.nullcontext()

    def reset_peak_memory(self) -> None:
        peak.reset(self.device)

    def peak_memory(self) -> int:
        """Peak device memory on CUDA; on CPU the process's peak resident memory."""
        return peak.measured(self.device)


def _check_device(device: str) -> None:
    if device not in SPEC.devices:
        raise InvalidArgumentError(f"the transformers backend runs on {' or '.join(SPEC.devices)}, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("PyTorch sees no CUDA device here; use --device cpu or a CUDA build of torch")


def _half_weights(dtype: str, device: str) -> bool:
    """Whether float linear layers run as FBGEMM's float16 weights: "auto" on a CPU that has FBGEMM."""
    return dtype == "auto" and device == "cpu" and Fp16Linear.available()


def _dtype(dtype: str, device: str) -> torch.dtype:
    """The compute dtype: as asked, or "auto": float32 on a CPU, bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _quiet_kernel_fallbacks() -> None:
    """transformers notes on a model's first forward pass that a hub kernel (flash-linear-attention's, say) falls
    back to its PyTorch reference where it is not installed or not for the device (a CPU): a note it would print
    in the middle of a reply, as the library never does. That note alone is dropped (a filter on its logger)."""
    log = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _FallbackNote) for f in log.filters):
        log.addFilter(_FallbackNote())


class _FallbackNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference" not in record.getMessage()


@contextlib.contextmanager
def _quiet():
    """transformers, its notes and progress bars kept off the terminal: the library never prints."""
    import transformers
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        yield transformers
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _quantize_linears(model: nn.Module, bits: int, group_size: int, device: torch.device, dtype: torch.dtype):
    """Every ``nn.Linear`` of the decoder layers (not the head) quantized to umakit's affine layout and swapped
    for the torch engine's execution form of it (its affine kernel on a CPU that has it, Triton on CUDA)."""
    form = torch.bfloat16 if device.type == "cpu" else dtype  # "bfloat16" names the packed CPU forms
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear or "lm_head" in path or module.in_features % group_size:
            continue
        packed, scales, biases = quantize_weights(module.weight.detach().float().cpu(), bits, group_size)
        q = QuantizedLinear(module.in_features, module.out_features, module.bias is not None, bits, group_size,
                            device="meta")
        q.weight, q.scales, q.biases = packed.to(device), scales.half().to(device), biases.half().to(device)
        q.bias = module.bias.detach() if module.bias is not None else None
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, forms.for_execution(q, device, form))
