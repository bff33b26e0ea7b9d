"""The tensor layer of quantization: one matrix to MLX's affine format and back.

`quantize_tensor` / `dequantize_tensor` are thin wrappers over MLX's own
``mx.quantize`` / ``mx.dequantize``; `error_bound` states how far a round trip
may move each element. Widths and group sizes are `umakit.core.affine`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from umakit.core.affine import BITS, DEFAULT_BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, MODE
from umakit.errors import InvalidArgumentError

_ROUNDING = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}  # two unit roundoffs


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
