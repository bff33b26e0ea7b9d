"""Weight quantization in MLX's affine format, as mlx-lm and mlx-community write it.

Two layers, as everywhere in umakit:

- the tensor layer: `quantize_tensor` / `dequantize_tensor` are thin wrappers
  over MLX's own ``mx.quantize`` / ``mx.dequantize``, and `error_bound` states
  how far a round trip may move each element;
- the model layer: a named `Recipe` decides each layer's bits,
  `quantize_model` applies it with ``nn.quantize`` and returns the exact
  ``"quantization"`` block mlx-lm writes into config.json; `quantize` writes a
  quantized checkpoint and `apply_on_load` quantizes a loaded model in memory.

Bits: 2, 3, 4, 5, 6 or 8 (every affine width MLX's kernels support except 1);
group sizes: 32, 64 or 128.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import checkpoint
from .backends.base import WeightInfo
from .errors import CheckpointError, InvalidArgumentError
from .fsutil import atomic_dir

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 64
DEFAULT_RECIPE = "default"
HIGH_BITS = 8  # embeddings, output head and the mixed recipe's sensitive layers
EDGE_BLOCKS = 2  # the mixed recipe keeps this many first and last blocks' sensitive layers at HIGH_BITS
MODE = "affine"
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
# Everything but the weights that a model directory needs, copied as is.
COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja",
    "generation_config.json", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE",
)
_ROUNDING = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}  # two unit roundoffs


# -- tensor layer ---------------------------------------------------------------
@dataclass(frozen=True)
class QuantizedTensor:
    """A matrix in MLX's affine format: w ≈ scales * q + biases, per group of a row."""

    packed: mx.array  # uint32 (..., cols * bits / 32): the integers q, packed low bits first
    scales: mx.array  # (..., cols / group_size), the source dtype
    biases: mx.array  # (..., cols / group_size)
    bits: int
    group_size: int


def check_bits(bits: int, group_size: int) -> None:
    """Raise a one-line error unless MLX's affine kernels support this width and group."""
    if bits not in BITS:
        raise InvalidArgumentError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise InvalidArgumentError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


def quantize_tensor(w: mx.array, bits: int = DEFAULT_BITS, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedTensor:
    """Quantize the last axis of ``w`` (at least 2-D) in groups of ``group_size``."""
    check_bits(bits, group_size)
    if w.ndim < 2 or w.shape[-1] % group_size:
        raise InvalidArgumentError(
            f"cannot quantize shape {list(w.shape)}: need 2 or more dimensions, the last divisible by {group_size}"
        )
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits, mode=MODE)
    return QuantizedTensor(packed, scales, biases, bits, group_size)


def dequantize_tensor(q: QuantizedTensor) -> mx.array:
    """The float matrix ``q`` stands for, in the dtype of its scales."""
    return mx.dequantize(q.packed, q.scales, q.biases, group_size=q.group_size, bits=q.bits, mode=MODE)


def error_bound(w: mx.array, q: QuantizedTensor) -> mx.array:
    """Per-element bound on ``|dequantize_tensor(q) - w|``, the shape of ``w``.

    Rounding to the nearest grid point costs at most half a step, ``|s|/2``.
    MLX also snaps each group's grid so that 0.0 is exactly representable; the
    snapped grid can stop short of the group's far end, and values beyond it
    are clipped, by at most one step ``|s|`` (for an odd number of levels
    ``2**bits - 1``). Half-precision scales and biases add their own rounding,
    relative to the group's range.
    """
    n = 2**q.bits - 1
    shape = (*w.shape[:-1], w.shape[-1] // q.group_size, q.group_size)
    s = q.scales.astype(mx.float32)[..., None]  # (..., groups, 1)
    b = q.biases.astype(mx.float32)[..., None]
    lo, hi = mx.minimum(b, b + n * s), mx.maximum(b, b + n * s)
    x = w.astype(mx.float32).reshape(shape)  # (..., groups, group_size)
    inside = (x >= lo) & (x <= hi)
    step = mx.abs(s)
    rounding = _ROUNDING.get(q.scales.dtype, 2.0**-7) * (mx.abs(b) + n * step)
    return (mx.where(inside, step / 2, step) + rounding).reshape(w.shape)


# -- recipes ------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """What a recipe knows about one quantizable layer."""

    path: str  # module path, e.g. "model.layers.3.mlp.down_proj"
    kind: str  # "linear", "embedding" or "head"
    block: int | None  # transformer block index; None outside the blocks
    n_blocks: int


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    bits_for: Callable[[Layer, int], int | None]  # (layer, requested bits) -> bits, or None to keep float


def _default_bits(layer: Layer, bits: int) -> int:
    # The embedding and head see every token; 8 bits there costs little and keeps the logits close.
    return bits if layer.kind == "linear" else HIGH_BITS


def _mixed_bits(layer: Layer, bits: int) -> int:
    edge = layer.block is not None and (layer.block < EDGE_BLOCKS or layer.block >= layer.n_blocks - EDGE_BLOCKS)
    sensitive = layer.path.rsplit(".", 1)[-1] in ("v_proj", "down_proj")
    return HIGH_BITS if layer.kind != "linear" or (edge and sensitive) else bits


RECIPES = {
    r.name: r
    for r in (
        Recipe("default", f"linear layers at the requested bits; embeddings and output head at {HIGH_BITS}",
               _default_bits),
        Recipe("mixed", f"as default, plus v_proj and down_proj of the first and last {EDGE_BLOCKS} blocks "
               f"at {HIGH_BITS} bits", _mixed_bits),
        Recipe("uniform", "every quantizable layer, embeddings and head included, at the requested bits",
               lambda layer, bits: bits),
    )
}


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise InvalidArgumentError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]


def _block_index(path: str) -> int | None:
    parts = path.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _kind(path: str, module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "head" if path.rsplit(".", 1)[-1] in ("lm_head", "output") else "linear"


def plan_quantization(
    model: nn.Module, bits: int = DEFAULT_BITS, group_size: int = DEFAULT_GROUP_SIZE, recipe: str = DEFAULT_RECIPE
) -> tuple[dict[str, int | None], list[str]]:
    """Bits for every quantizable layer (None: stays float) and notes on the exceptions."""
    check_bits(bits, group_size)
    r = _recipe(recipe)
    already = [p for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if already:
        raise InvalidArgumentError(f"the model is already quantized ({already[0]}, ...); start from float weights")
    # nn.quantize's own rule: a layer is quantizable when it can make its quantized twin.
    layers = [(p, m) for p, m in model.named_modules() if hasattr(m, "to_quantized")]
    n_blocks = 1 + max((b for p, _ in layers if (b := _block_index(p)) is not None), default=-1)
    plan: dict[str, int | None] = {}
    indivisible: dict[int, list[str]] = {}
    for path, module in sorted(layers):
        b = r.bits_for(Layer(path, _kind(path, module), _block_index(path), n_blocks), bits)
        width = module.weight.shape[-1]  # input features of a linear layer, dims of an embedding
        if b is not None and width % group_size:
            indivisible.setdefault(width, []).append(path)
            b = None
        plan[path] = b
    notes = [
        f"{len(paths)} layer(s) stay float: input width {w} is not divisible by group size {group_size} "
        f"(e.g. {paths[0]})"
        for w, paths in sorted(indivisible.items())
    ]
    return plan, notes


def quantize_model(
    model: nn.Module, bits: int = DEFAULT_BITS, group_size: int = DEFAULT_GROUP_SIZE, recipe: str = DEFAULT_RECIPE
) -> tuple[dict, list[str]]:
    """Quantize ``model`` in place (lazily); return mlx-lm's config block and notes.

    The block is ``{"group_size", "bits", "mode"}`` plus one entry per layer
    whose bits differ from the top-level ones, keyed by module path. Layers
    left float need no entry: loaders quantize only layers that have scales.
    """
    plan, notes = plan_quantization(model, bits, group_size, recipe)
    config: dict = {"group_size": group_size, "bits": bits, "mode": MODE}
    for path, b in plan.items():
        if b is not None and b != bits:
            config[path] = {"group_size": group_size, "bits": b, "mode": MODE}

    def predicate(path: str, module: nn.Module):
        b = plan.get(path)
        return False if b is None else {"group_size": group_size, "bits": b, "mode": MODE}

    nn.quantize(model, group_size=group_size, bits=bits, mode=MODE, class_predicate=predicate)
    return config, notes


def quantized_layers(model: nn.Module) -> dict[str, int]:
    """Module path -> bits of every quantized layer."""
    return {p: m.bits for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace quantized layers by float ones holding the dequantized weights (mlx-lm's own pass).

    Quantizing the result again is not lossless, even at the same bits and
    group size: MLX snaps each group's grid so 0.0 is exact, which moves it off
    a min-max grid such as GGUF's Q4_1 (on SmolLM2's Q4_1 import, 4-bit g32
    keeps only about half of the codes).
    """
    from mlx_lm.utils import dequantize_model as _dequantize

    return _dequantize(model)


def parse_spec(spec: int | dict) -> tuple[int, int, str]:
    """``4`` or ``{"bits": 4, "group_size": 64, "recipe": "default"}`` -> (bits, group_size, recipe)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, dict)):
        raise InvalidArgumentError(f"quantize= takes bits (e.g. 4) or a dict with bits, group_size, recipe; got {spec!r}")
    if isinstance(spec, int):
        spec = {"bits": spec}
    unknown = set(spec) - {"bits", "group_size", "recipe"}
    if unknown:
        raise InvalidArgumentError(f"unknown quantize= key(s): {', '.join(sorted(unknown))}; use bits, group_size, recipe")
    bits = spec.get("bits", DEFAULT_BITS)
    group_size = spec.get("group_size", DEFAULT_GROUP_SIZE)
    recipe = spec.get("recipe", DEFAULT_RECIPE)
    check_bits(bits, group_size)
    _recipe(recipe)
    return bits, group_size, recipe


def apply_on_load(model: nn.Module, spec: int | dict) -> dict:
    """Quantize a freshly loaded float model in memory; returns its config block.

    The float weights are released as each layer is evaluated, so peak memory
    stays near the float model's.
    """
    bits, group_size, recipe = parse_spec(spec)
    config, _ = quantize_model(model, bits, group_size, recipe)
    mx.eval(model.parameters())
    return config


# -- checkpoints ------------------------------------------------------------------
@dataclass
class QuantizeReport:
    src: Path
    dst: Path
    bits: int
    group_size: int
    recipe: str
    layers: dict[int, int]  # bits -> number of quantized layers
    float_layers: int  # quantizable layers left float
    notes: list[str]
    source_bytes: int  # weight files on disk
    bytes: int
    weights: WeightInfo
    seconds: float
    ppl_before: object | None = None  # evaluate.PerplexityResult
    ppl_after: object | None = None
    quantization: dict = field(default_factory=dict)  # the config.json block

    @property
    def bits_per_weight(self) -> float:
        return self.weights.bits_per_weight

    @property
    def ppl_change(self) -> float | None:
        """Relative perplexity change, e.g. 0.03 for +3 %."""
        if self.ppl_before is None or self.ppl_after is None:
            return None
        return self.ppl_after.ppl / self.ppl_before.ppl - 1


def _source_dtype(ckpt: checkpoint.Checkpoint) -> str:
    declared = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype")
    if declared in ("float16", "bfloat16", "float32"):
        return declared
    names = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float32"}
    counts: dict[str, int] = {}
    for t in ckpt.tensors.values():
        counts[names[t.dtype]] = counts.get(names[t.dtype], 0) + t.nbytes
    return max(counts, key=counts.get)


def _check_float(ckpt: checkpoint.Checkpoint) -> None:
    q = ckpt.config.get("quantization") or ckpt.config.get("quantization_config")
    ints = [t for t in ckpt.tensors.values() if t.dtype not in checkpoint.FLOAT_DTYPES]
    if q or ints:
        what = "config.json has a quantization block" if q else f"tensor {ints[0].name} is {ints[0].dtype}"
        raise CheckpointError(f"{ckpt.path} is already quantized ({what}); quantize a float16/bfloat16/float32 checkpoint")


def _shards(weights: dict[str, mx.array]) -> list[dict[str, mx.array]]:
    shards: list[dict[str, mx.array]] = []
    size = 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def write_checkpoint(
    model: nn.Module, config: dict, dst: str | os.PathLike, files_from: Path, force: bool = False
) -> Path:
    """Write ``model``'s parameters and ``config`` as a model directory, atomically.

    Layout as mlx-lm's ``save``: model.safetensors (or 5 GB shards) with an
    index, config.json, and the tokenizer and generation files of ``files_from``.
    """
    weights = dict(tree_flatten(model.parameters()))
    with atomic_dir(dst, force=force) as tmp:
        shards = _shards(weights)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
        (tmp / "config.json").write_text(json.dumps(config, indent=4))
        for name in COPIED_FILES:
            if (files_from / name).is_file():
                shutil.copy2(files_from / name, tmp / name)
    return Path(dst)


def quantize(
    src: str | os.PathLike | None,
    dst: str | os.PathLike,
    bits: int = DEFAULT_BITS,
    group_size: int = DEFAULT_GROUP_SIZE,
    recipe: str = DEFAULT_RECIPE,
    force: bool = False,
    eval_text: str | None = None,
) -> QuantizeReport:
    """Quantize the float checkpoint ``src`` into an mlx-community-style directory ``dst``.

    Scales, biases and the layers left float keep the source's float dtype.
    With ``eval_text``, the perplexity of both models on it is measured (default backend).
    Nothing is left at ``dst`` if anything fails.
    """
    from . import backends
    from .backends.mlx.engine import MLXEngine

    check_bits(bits, group_size)
    _recipe(recipe)
    dst = Path(dst)
    if dst.exists() and not force:
        raise InvalidArgumentError(f"{dst} already exists (use --force to overwrite)")
    src_path = checkpoint.resolve(src)
    if dst.resolve() == src_path.resolve():
        raise InvalidArgumentError(f"{dst} is the source checkpoint; write the quantized model elsewhere")
    ckpt = checkpoint.open_checkpoint(src_path)
    _check_float(ckpt)
    before = None
    if eval_text is not None:  # measured first: a bad text fails before anything is written
        from . import load
        from .evaluate import perplexity

        before = perplexity(load(src_path), eval_text)
    t0 = time.perf_counter()
    engine = MLXEngine(ckpt, device=backends.resolve("mlx")[1], dtype=_source_dtype(ckpt))
    block, notes = quantize_model(engine.model, bits, group_size, recipe)
    mx.eval(engine.model.parameters())
    engine.quantization = block  # what the loader sets from config.json, for weight_info
    config = json.loads((src_path / "config.json").read_text())
    config.pop("_name_or_path", None)
    config["quantization"] = block
    config["quantization_config"] = block
    write_checkpoint(engine.model, config, dst, files_from=src_path, force=force)
    per_bits: dict[int, int] = {}
    for b in quantized_layers(engine.model).values():
        per_bits[b] = per_bits.get(b, 0) + 1
    report = QuantizeReport(
        src=src_path, dst=dst, bits=bits, group_size=group_size, recipe=recipe,
        layers=dict(sorted(per_bits.items())),
        float_layers=sum(1 for _, m in engine.model.named_modules() if hasattr(m, "to_quantized")),
        notes=notes, source_bytes=sum(f.stat().st_size for f in ckpt.files),
        bytes=sum(f.stat().st_size for f in dst.glob("*.safetensors")),
        weights=engine.weight_info(), seconds=time.perf_counter() - t0, quantization=block,
    )
    del engine
    if before is not None:
        report.ppl_before = before
        report.ppl_after = perplexity(load(dst), eval_text)
    return report
