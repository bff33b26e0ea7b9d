"""The model layer of quantization: named recipes choose each layer's bits, one pass applies them.

`plan_quantization` asks a `Recipe` for the bits of every quantizable layer;
`quantize_model` applies the plan in place with ``nn.quantize`` and returns the
config.json ``quantization`` block mlx-lm writes (`umakit.core.affine.quantization_block`);
`apply_on_load` is what an engine runs to quantize a freshly loaded float model.
Engines import this module: it depends only on mlx, the errors and `umakit.core.affine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from umakit.core.affine import DEFAULT_BITS, DEFAULT_GROUP_SIZE, HIGH_BITS, MODE, quantization_block
from umakit.errors import InvalidArgumentError
from umakit.quantize.tensor import check_bits

DEFAULT_RECIPE = "default"
EDGE_BLOCKS = 2  # the mixed recipe keeps this many first and last blocks' sensitive layers at HIGH_BITS


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


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; a one-line error naming the choices otherwise."""
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
    r = get_recipe(recipe)
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
    block = quantization_block({p: (group_size, b) for p, b in plan.items() if b is not None}, group_size, bits)

    def predicate(path: str, module: nn.Module):
        b = plan.get(path)
        return False if b is None else {"group_size": group_size, "bits": b, "mode": MODE}

    nn.quantize(model, group_size=group_size, bits=bits, mode=MODE, class_predicate=predicate)
    return block, notes


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
    name = spec.get("recipe", DEFAULT_RECIPE)
    check_bits(bits, group_size)
    get_recipe(name)
    return bits, group_size, name


def apply_on_load(model: nn.Module, spec: int | dict) -> dict:
    """Quantize a freshly loaded float model in memory; returns its config block.

    The float weights are released as each layer is evaluated, so peak memory
    stays near the float model's.
    """
    bits, group_size, name = parse_spec(spec)
    block, _ = quantize_model(model, bits, group_size, name)
    mx.eval(model.parameters())
    return block
