"""Weight quantization in MLX's affine format, as mlx-lm and mlx-community write it.

Two layers, as everywhere in umakit, and a pipeline on top:

- `tensor`: `quantize_tensor` / `dequantize_tensor` over MLX's own kernels,
  and `error_bound`, how far a round trip may move each element;
- `recipes`: a named `Recipe` decides each layer's bits, `quantize_model`
  applies it and returns the config.json ``quantization`` block, and
  `apply_on_load` quantizes a loaded model in memory (what engines import);
- `pipeline`: `quantize` writes a quantized checkpoint through `umakit.load`
  and `umakit.checkpoint.writer`.

Bits and group sizes are `umakit.core.affine`'s (`BITS`, `GROUP_SIZES`).
The pipeline's names load on first use: importing it here would pull the whole
model layer into every engine that imports `recipes`.
"""

from umakit.core.affine import BITS, DEFAULT_BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, HIGH_BITS, MODE
from umakit.quantize.recipes import (
    DEFAULT_RECIPE,
    EDGE_BLOCKS,
    RECIPES,
    Layer,
    Recipe,
    apply_on_load,
    dequantize_model,
    parse_spec,
    plan_quantization,
    quantize_model,
    quantized_layers,
)
from umakit.quantize.tensor import QuantizedTensor, check_bits, dequantize_tensor, error_bound, quantize_tensor

_PIPELINE = ("QuantizeReport", "quantize")

__all__ = [
    "BITS", "DEFAULT_BITS", "DEFAULT_GROUP_SIZE", "DEFAULT_RECIPE", "EDGE_BLOCKS", "GROUP_SIZES", "HIGH_BITS", "MODE",
    "Layer", "QuantizedTensor", "Recipe", "RECIPES", "apply_on_load", "check_bits", "dequantize_model",
    "dequantize_tensor", "error_bound", "parse_spec", "plan_quantization", "quantize_model", "quantize_tensor",
    "quantized_layers", *_PIPELINE,
]


def __getattr__(name: str):
    if name in _PIPELINE:
        from umakit.quantize import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
