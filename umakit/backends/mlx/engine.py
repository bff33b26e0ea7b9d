"""MLX engine: mlx-lm's model classes, with umakit's loading, cache and decode loop."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from umakit.core import affine
from umakit.checkpoint import config as config_compat
from umakit.checkpoint.files import Checkpoint, validate_checkpoint
from umakit.checkpoint.hfquant.detect import native_block
from umakit.errors import BackendUnavailableError, CheckpointError, InvalidArgumentError, UnsupportedModelError
from umakit.quantize.recipes import parse_spec, quantize_model
from umakit.plan.roofline import kv_bytes_per_token
from umakit.generate.sampling import SamplingParams, recent_tokens
from umakit.backends import common
from umakit.backends.base import PREFILL_CHUNK, Lookup, WeightInfo, refuse_options
from umakit.backends.mlx import SPEC, fused_experts, rope, wiring
from umakit.backends.mlx.batch_decoder import MLXBatchDecoder
from umakit.backends.mlx.cache import MLXCache
from umakit.backends.mlx.architectures import mlx_lm_type, reads_rope_scaling
from umakit.backends.mlx.mlx_lm_import import import_mlx_lm
from umakit.backends.mlx.sampler import MLXOps

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
CLEAR_EVERY = 256  # decode steps between returns of freed buffers to the system (as mlx-lm does)


def release_buffers() -> None:
    """Give freed buffers back: on Metal they otherwise stay cached (and wired), crowding out the weights."""
    mx.clear_cache()


def auto_dtype(config: dict, weights: dict) -> mx.Dtype:
    """The compute dtype "auto" takes on a GPU: the checkpoint's declared half type, else the half type
    holding most bytes of its matrices (norms and scales kept in float32 by an import do not outvote them)."""
    declared = config.get("torch_dtype") or config.get("dtype")
    if declared in ("float16", "bfloat16"):
        return DTYPES[declared]
    sizes: dict = {}
    for v in weights.values():
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != mx.float64 and v.ndim >= 2:
            sizes[v.dtype] = sizes.get(v.dtype, 0) + v.nbytes
    return max(sizes, key=sizes.get) if sizes else mx.float16


def _cast(v: mx.array, target: mx.Dtype) -> mx.array:
    # The GPU has no float64: such a tensor is cast on the CPU stream.
    return v.astype(target, stream=mx.cpu) if v.dtype == mx.float64 else v.astype(target)


def cast_weights(weights: dict, target: mx.Dtype, castable=lambda name: True) -> dict:
    """Floating tensors cast to ``target``, except where ``castable(name)`` (an mlx-lm model's
    `cast_predicate`, e.g. MoE router biases kept in float32) says to keep the stored type."""
    def cast(name: str, v: mx.array) -> mx.array:
        if not mx.issubdtype(v.dtype, mx.floating):
            return v
        if castable(name):
            return _cast(v, target)
        return _cast(v, mx.float32) if v.dtype == mx.float64 else v  # kept, but the GPU has no float64

    return {k: cast(k, v) for k, v in weights.items()}


def _sanitized(model, weights: dict) -> dict:
    """mlx-lm's ``sanitize``, also for quantized routed experts stored one by one (an imported GPTQ, AWQ or
    compressed-tensors MoE): sanitize stacks their ``weight``s, and their scales and biases are stacked the same
    way, by running it on them under the weights' names."""
    if not hasattr(model, "sanitize"):
        return weights
    stacked = {}
    for suffix in ("scales", "biases"):
        part = {k.removesuffix(suffix) + "weight": weights[k] for k in weights
                if ".experts." in k and k.endswith("." + suffix)}
        if not part:
            continue
        try:
            done = model.sanitize(dict(part))
        except (KeyError, ValueError, IndexError):
            continue  # sanitize needs more than the experts: left as they are, and refused by name below
        for k in part:
            weights.pop(k.removesuffix("weight") + suffix)
        stacked.update({k.removesuffix("weight") + suffix: v for k, v in done.items()})
    weights = model.sanitize(weights)
    weights.update(stacked)
    return weights


def _castable(model: nn.Module):
    return getattr(model, "cast_predicate", lambda name: True)  # mlx-lm's own default (convert.py)


def _architecture(config: dict):
    """mlx-lm's (Model, ModelArgs) for a config; a clear error for unknown types."""
    config_compat.check_mlx(config)
    model_type = config["model_type"]
    models = import_mlx_lm("models")
    known = sorted(p.stem for p in Path(models.__path__[0]).glob("*.py") if not p.stem.startswith("_"))
    if model_type not in known:
        # mlx-lm serves some types with another's code (e.g. mistral -> llama; a text-only qwen3_5 -> qwen3_5)
        model_type = mlx_lm_type(model_type)
    if model_type not in known:
        raise UnsupportedModelError(
            f"model_type {config['model_type']!r} is not supported by mlx-lm; supported: {', '.join(known)}"
        )
    arch = import_mlx_lm(f"models.{model_type}")
    scaling = config_compat.text_config(config).get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind != "default" and not reads_rope_scaling(arch.__file__):
        raise UnsupportedModelError(
            f"mlx-lm's {model_type} model never reads rope_scaling, and this checkpoint sets it ({kind}): it would "
            f"run with unscaled positions, its answers wrong; use --backend torch, which applies it, or remove "
            f"rope_scaling from config.json to run the model as trained, within its original context")
    return arch.Model, arch.ModelArgs


class MLXEngine:
    """`umakit.backends.base.Engine` on MLX: mlx-lm's model classes, umakit's loading and decode loop."""

    spec = SPEC
    name = SPEC.name
    features = SPEC.features
    offload = None  # MLX keeps every weight in (unified) memory

    def __init__(self, device: str):
        if device not in SPEC.devices:
            raise InvalidArgumentError(f"the mlx backend runs on {' or '.join(SPEC.devices)}, not {device!r}")
        if device == "metal" and not mx.metal.is_available():
            raise BackendUnavailableError("Metal is not available on this machine; use --device cpu")
        self.device = device
        self._mx_device = mx.gpu if device == "metal" else mx.cpu
        self.load_notes: tuple[str, ...] = ()
        self.quantization: dict | None = None

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, *, device: str, dtype: str = "auto", progress=None,
                        quantize: int | dict | None = None, gpu_layers: int | None = None,
                        vram_budget: int | str | None = None) -> "MLXEngine":
        refuse_options(SPEC, gpu_layers=gpu_layers, vram_budget=vram_budget)
        ckpt = ckpt.complete()  # MLX's layout throughout: a GGUF's Q6_K layers as their 8-bit copies
        validate_checkpoint(ckpt)  # the same checks, and messages, as the torch engine's
        self = cls(device)
        self.config = ckpt.config
        with mx.stream(self._mx_device):
            self._load(ckpt, dtype, progress)
            if quantize is not None:
                self._quantize_in_memory(quantize)
        return self

    def _quantize_in_memory(self, spec: int | dict) -> None:
        if self.quantization:
            raise InvalidArgumentError(
                f"the checkpoint is already quantized ({affine.describe(self.quantization)}); "
                "quantize on load needs a float checkpoint"
            )
        bits, group_size, recipe = parse_spec(spec)
        self.quantization, notes = quantize_model(self.model, bits, group_size, recipe)
        mx.eval(self.model.parameters())  # the float weights are released as each layer is evaluated
        release_buffers()
        self.load_notes = (*self.load_notes, *notes)
        self.config = {**self.config, "quantization": self.quantization}

    @classmethod
    def synthetic(cls, config: dict, *, device: str, dtype: str = "auto", bits: int | None = None,
                  group_size: int = affine.DEFAULT_GROUP_SIZE, gpu_layers: int | None = None,
                  vram_budget: int | str | None = None) -> "MLXEngine":
        """Random weights in a real architecture's exact shapes (for benchmarks)."""
        refuse_options(SPEC, gpu_layers=gpu_layers, vram_budget=vram_budget)
        self = cls(device)
        self.config = dict(config)
        with mx.stream(self._mx_device):
            model_cls, args_cls = _architecture(self.config)
            model = model_cls(args_cls.from_dict(self.config))  # mlx's initialisers: random, never all zeros
            target = self._compute_dtype(dtype, {}) if dtype != "auto" or device == "cpu" else mx.float16
            model.update(tree_unflatten(list(cast_weights(dict(tree_flatten(model.parameters())), target,
                                                          _castable(model)).items())))
            if bits is not None:
                nn.quantize(model, group_size=group_size, bits=bits)
                self.quantization = self.config["quantization"] = {"group_size": group_size, "bits": bits}
            mx.eval(model.parameters())
        self.model = model
        self.dtype = next(k for k, v in DTYPES.items() if v == target)
        return self

    # -- loading ------------------------------------------------------------
    def _load(self, ckpt: Checkpoint, dtype: str, progress=None) -> None:
        model_cls, args_cls = _architecture(ckpt.config)
        try:
            model = model_cls(args_cls.from_dict(ckpt.config))
        except (TypeError, KeyError, ValueError) as e:
            raise UnsupportedModelError(f"config.json does not fit mlx-lm's {ckpt.model_type} model: {e}") from e
        text = config_compat.text_config(ckpt.config)
        rope.correct(model, text.get("rope_scaling"), float(text.get("rope_theta", 10000.0)))
        weights = {}
        for f in ckpt.files:  # lazy: nothing is read until evaluated
            weights.update(mx.load(str(f)))
        weights = _sanitized(model, fused_experts.unfused(weights, text))
        self.quantization = ckpt.config.get("quantization") or native_block(ckpt.config)
        if self.quantization:
            _hook_up_quantization(model, weights, self.quantization)
        target = self._compute_dtype(dtype, weights, ckpt.config)
        weights = cast_weights(weights, target, _castable(model))
        common.check_weights({k: v.shape for k, v in tree_flatten(model.parameters())},
                             {k: v.shape for k, v in weights.items()})
        model.load_weights(list(weights.items()), strict=False)
        del weights  # drop the lazy source arrays so each converts and frees in turn
        split = self._split(model, ckpt)
        params = tree_flatten(model.parameters())
        done, total = 0, sum(a.nbytes for _, a in params) if split else ckpt.nbytes
        for name, array in params:  # read tensor by tensor, reporting bytes
            mx.eval(array)
            done += ckpt.tensors[name].nbytes if name in ckpt.tensors and not split else array.nbytes
            if progress:
                progress(min(done, total), total)
        model.eval()
        self.model = model
        self.dtype = next(k for k, v in DTYPES.items() if v == target)
        release_buffers()  # the lazily converted source arrays

    def _split(self, model, ckpt: Checkpoint) -> bool:
        """Called between binding the lazy weights and reading them: an engine over a shard of the
        model (backends/distributed) splits it here, so only its part is ever read. True if it did."""
        return False

    def _agree(self, token: mx.array) -> mx.array:
        """The token every process of the run feeds next (one process: its own draw)."""
        return token

    def _take(self, token: mx.array) -> int:
        """Wait for ``token`` on the host (a sharded engine bounds that wait)."""
        return token.item()

    def _compute_dtype(self, dtype: str, weights: dict, config: dict | None = None) -> mx.Dtype:
        if dtype != "auto":
            if dtype not in DTYPES:
                raise InvalidArgumentError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
            return DTYPES[dtype]
        if self.device == "cpu":
            # MLX-CPU emulates half precision and its quantized matmul accumulates
            # in the activation dtype: float32 is both faster and correct there.
            return mx.float32
        return auto_dtype(config or {}, weights)

    # -- engine interface -----------------------------------------------------
    def make_cache(self, kv_bits: int | None = None) -> MLXCache:
        return MLXCache.for_model(self.model, kv_bits=kv_bits)

    def logits(self, tokens: Sequence[int], cache: MLXCache | None = None) -> np.ndarray:
        cache = cache if cache is not None else self.make_cache()
        with mx.stream(self._mx_device):
            out = self.model(mx.array([int(t) for t in tokens])[None], cache=cache.layers)  # (1, T, V)
            out = out[0].astype(mx.float32)
            mx.eval(out)
        return np.array(out)

    def prefill(self, tokens: Sequence[int], cache: MLXCache) -> None:
        """Run ``tokens`` into ``cache`` without computing any logits."""
        with mx.stream(self._mx_device):
            for i in range(0, len(tokens), PREFILL_CHUNK):
                self.model(mx.array(list(tokens[i:i + PREFILL_CHUNK]), dtype=mx.uint32)[None], cache=cache.layers)
                mx.eval([c.state for c in cache.layers])  # only the cache: the unused logits are never computed
                release_buffers()

    def generate_tokens(
        self,
        prompt: Sequence[int],
        cache: MLXCache,
        sampling: SamplingParams,
        seed: int | None = None,
        history: Sequence[int] = (),
    ) -> Iterator[int]:
        common.check_prompt(prompt)
        sampler = common.TokenSampler(MLXOps, sampling, seed, recent_tokens(sampling, prompt, history))

        def step(tokens: mx.array) -> mx.array:
            logits = self.model(tokens[None], cache=cache.layers)[:, -1, :]  # (1, V)
            return sampler.sample(logits, self._agree)[0]  # (1,)

        # All but the last token fill the cache without the output head; only the last
        # position's logits are computed (a 150k-token head over a 512-token chunk would
        # cost more than the whole prefill).
        self.prefill(list(prompt[:-1]), cache)
        with mx.stream(self._mx_device):
            y = step(mx.array([int(prompt[-1])], dtype=mx.uint32))
            mx.async_eval(y)
            for n in itertools.count(1):
                # Queue step n+1 before handing out token n, so the host's work
                # of building the next graph overlaps the device computing it.
                next_y = step(y)
                mx.async_eval(next_y)
                yield self._take(y)
                y = next_y
                if n % CLEAR_EVERY == 0:
                    release_buffers()

    def batch_decoder(self, kv_bits: int | None = None, lookup: Lookup | None = None,
                      mixed: bool | None = None) -> MLXBatchDecoder:
        refuse_options(SPEC, batch_kv_bits=kv_bits, mixed=mixed)
        return MLXBatchDecoder(self, lookup)

    def make_deterministic(self) -> None:
        refuse_options(SPEC, deterministic=True)

    def weight_info(self) -> WeightInfo:
        params = dict(tree_flatten(self.model.parameters()))
        by_cat: dict[str, int] = {}
        for name, a in params.items():
            by_cat[common.category(name)] = by_cat.get(common.category(name), 0) + a.nbytes
        routed = sum(a.nbytes for name, a in params.items() if common.is_routed_expert(name))
        return common.weight_info(by_cat, common.logical_params({k: a.shape for k, a in params.items()},
                                                                self.quantization),
                                  self.config.get("vocab_size") or 1, self.kv_bytes_per_token(), self.quantization,
                                  routed_bytes=routed, routed_read_share=common.routed_share(self.config))

    def export_weights(self) -> dict[str, mx.array]:
        """The parameters by checkpoint name, quantized layers as packed weight, scales and biases."""
        return dict(tree_flatten(self.model.parameters()))

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        """Cache bytes per token over all layers, K and V (quantized: with group overhead)."""
        c = self.config.get("text_config", self.config)
        heads = c.get("num_attention_heads", 1)
        return kv_bytes_per_token(
            c.get("num_hidden_layers", 0), c.get("num_key_value_heads") or heads,
            c.get("head_dim") or c.get("hidden_size", 0) // heads,
            kv_bits=kv_bits, dtype_bytes=DTYPES[self.dtype].size, group_size=affine.KV_GROUP_SIZE,
        )

    def wired(self) -> contextlib.AbstractContextManager:
        """Keep the weights resident (wired) on Metal while generating; restore after.

        The policy and its nesting are `umakit.backends.mlx.wiring`'s; ``UMAKIT_NO_WIRE=1`` turns it off.
        """
        if self.device != "metal" or wiring.wiring_disabled():
            return contextlib.nullcontext()
        return wiring.WIRING.hold(self.weight_info().total_bytes)

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    def peak_memory(self) -> int:
        return mx.get_peak_memory()


def _hook_up_quantization(model: nn.Module, weights: dict, q: dict) -> None:
    """Swap in quantized layers wherever the checkpoint stores scales (mlx-lm's rule)."""

    def predicate(path: str, module: nn.Module):
        # a text-only checkpoint's entries name its layers without the multimodal wrapper's prefix (TEXT_ONLY)
        entry = q.get(path, q.get(path.removeprefix("language_model.")))
        if isinstance(entry, dict):
            return entry
        if entry is False:
            return False
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    try:
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", affine.MODE),
                    class_predicate=predicate)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"config.json has an invalid quantization block {q}: {e}") from e
