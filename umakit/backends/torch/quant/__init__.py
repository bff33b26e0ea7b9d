"""Quantized layers on torch: the MLX layout as is (layout.py), the execution forms on torch's kernels
(kernels.py), and which form each layer runs as on each device and dtype (forms.py).

The layout's and the kernels' names are re-exported here (``quant.Int4PackLinear``)."""

from umakit.backends.torch.quant.kernels import Fp16Linear, Int4PackLinear, dense, unpack_cpu_int4pack
from umakit.backends.torch.quant.layout import (
    Concat,
    QuantizedEmbedding,
    QuantizedLinear,
    concat,
    dequantize,
    pack,
    quantize,
    unpack,
)

__all__ = ["Concat", "Fp16Linear", "Int4PackLinear", "QuantizedEmbedding", "QuantizedLinear", "concat", "dense",
           "dequantize", "pack", "quantize", "unpack", "unpack_cpu_int4pack"]
