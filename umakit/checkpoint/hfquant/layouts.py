"""The integer checkpoints GPU users download, GPTQ, AWQ and compressed-tensors' ``pack-quantized``, as MLX's
affine groups, exactly, in numpy.

Each stores, for a group of consecutive input weights of an output row, w = scale * (q - zero) with unsigned
codes q: MLX's affine form with that scale and bias = -scale * zero. What differs is where the codes are:
- GPTQ (AutoGPTQ, GPTQModel; `checkpoint_format` "gptq"): ``qweight`` (in * bits / 32, out) int32, each output's
  codes along the input as a little-endian bit stream, which is MLX's packing transposed; ``qzeros`` (groups,
  out * bits / 32) packed along the output, each zero stored less one ("gptq_v2": as it is); ``scales`` (groups,
  out); ``g_idx`` (in,), each input's group, which act-order (``desc_act``) permutes.
- AWQ (AutoAWQ's GEMM layout): ``qweight`` (in, out / 8) int32 of 4-bit codes along the output, eight to a word in
  the order 0, 2, 4, 6, 1, 3, 5, 7; ``qzeros`` (groups, out / 8) the same; ``scales`` (groups, out).
- compressed-tensors ``pack-quantized``: ``weight_packed`` (out, in * bits / 32) int32, MLX's packing of the signed
  codes plus 2^(bits-1); ``weight_scale`` (out, groups); where asymmetric, ``weight_zero_point`` packed the same
  way along the output, (out * bits / 32, groups); ``weight_shape`` (out, in).
Groups wider than MLX's 128 (a row's one scale, GPTQ's group -1 or compressed-tensors' "channel") become groups of
128, 64 or 32 that repeat the scale: exact, at the price of the repeated scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from umakit.checkpoint.gguf.quants import pack
from umakit.core.affine import GROUP_SIZES
from umakit.errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # which of a word's eight outputs each nibble holds


@dataclass
class Layer:
    """One linear layer in MLX's affine form."""

    weight: np.ndarray  # (out, in * bits / 32) uint32, MLX's packing
    scales: np.ndarray  # (out, in / group) float32
    biases: np.ndarray  # (out, in / group) float32
    bits: int
    group: int


def codes(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(..., n) 32-bit words -> (..., count) uint8: code j at bits [j * bits, (j + 1) * bits) of each row's
    little-endian bit stream (MLX's packing, GPTQ's and compressed-tensors'; the inverse of gguf.quants.pack)."""
    w = np.ascontiguousarray(words).view(np.uint32)
    if bits in (4, 8):  # whole bytes, a 4-bit code in a byte's low nibble before its high one
        b = w.view(np.uint8)
        q = b if bits == 8 else np.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
        return q[..., :count]
    if 32 % bits == 0:
        shifts = np.arange(32 // bits, dtype=np.uint32) * bits
        out = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return out.reshape(*w.shape[:-1], -1)[..., :count].astype(np.uint8)
    stream = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")[..., : count * bits]
    stream = stream.reshape(*w.shape[:-1], count, bits)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)


def as_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's values as float32, a bfloat16 one read as its raw 16 bits."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _regroup(scales: np.ndarray, zeros: np.ndarray, group: int, cols: int, where: str):
    """(out, in / group) scales and zeros -> MLX's group size, repeating each where ``group`` is wider."""
    g = next((g for g in sorted(GROUP_SIZES, reverse=True) if group % g == 0 and cols % g == 0), None)
    if g is None:
        raise CheckpointError(f"{where}: groups of {group} weights have no exact form in MLX's groups of "
                              f"{', '.join(map(str, GROUP_SIZES))}")
    rep = group // g
    return np.repeat(scales, rep, axis=1), np.repeat(zeros, rep, axis=1), g


def _layer(weight: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, group: int, where: str) -> Layer:
    cols = weight.shape[1] * 32 // bits
    if cols % group or scales.shape[1] != cols // group or zeros.shape != scales.shape:
        raise CheckpointError(f"{where}: {scales.shape[1]} groups of scales do not cover {cols} inputs in "
                              f"groups of {group}")
    scales, zeros, group = _regroup(scales, zeros, group, cols, where)
    return Layer(np.ascontiguousarray(weight).view(np.uint32), scales, -scales * zeros.astype(np.float32), bits, group)


def _check_g_idx(g_idx: np.ndarray | None, cols: int, group: int, where: str) -> None:
    if g_idx is None:
        return
    if not np.array_equal(g_idx.astype(np.int64), np.arange(cols) // group):
        raise CheckpointError(
            f"{where} was quantized with act-order (desc_act: its g_idx puts inputs of one group apart), which "
            "MLX's groups of consecutive weights cannot hold exactly; use a checkpoint made without desc_act"
        )


def gptq(t: dict, bits: int, group: int, zeros_offset: int, where: str) -> Layer:
    """``t``: the module's ``qweight``, ``qzeros``, ``scales`` (float32) and optional ``g_idx``;
    ``zeros_offset``: 1 where zeros are stored less one (GPTQ's "gptq" format), 0 for "gptq_v2"."""
    qweight, scales = t["qweight"], t["scales"]
    cols, out = qweight.shape[0] * 32 // bits, qweight.shape[1]
    group = cols if group <= 0 else group
    _check_g_idx(t.get("g_idx"), cols, group, where)
    zeros = codes(t["qzeros"], bits, out).astype(np.int32) + zeros_offset  # (groups, out)
    return _layer(qweight.T, scales.T, zeros.T, bits, group, where)


def awq(t: dict, group: int, where: str) -> Layer:
    """``t``: the module's ``qweight``, ``qzeros`` and ``scales`` (float32); 4 bits."""
    def outputs(words: np.ndarray) -> np.ndarray:  # (rows, out / 8) -> (rows, out), the nibbles put in order
        nibbles = codes(words, 4, words.shape[1] * 8).reshape(len(words), -1, 8)
        return nibbles[..., np.argsort(AWQ_ORDER)].reshape(len(words), -1)

    q = outputs(t["qweight"])  # (in, out)
    group = q.shape[0] if group <= 0 else group
    return _layer(pack(np.ascontiguousarray(q.T), 4), t["scales"].T, outputs(t["qzeros"]).T, 4, group, where)


def compressed(t: dict, bits: int, group: int | None, symmetric: bool, where: str) -> Layer:
    """``t``: the module's ``weight_packed``, ``weight_scale`` (float32), ``weight_shape`` and, asymmetric,
    ``weight_zero_point``; ``group`` None: one scale a row."""
    packed, scales = t["weight_packed"], t["weight_scale"]
    out, cols = (int(v) for v in t["weight_shape"])
    if packed.shape != (out, cols * bits // 32) or cols * bits % 32:
        raise CheckpointError(f"{where}: weight_packed is {list(packed.shape)}, not the packing of {out}x{cols} "
                              f"{bits}-bit codes")
    _check_g_idx(t.get("weight_g_idx"), cols, group or cols, where)
    offset = 1 << (bits - 1)
    if symmetric:
        zeros = np.full(scales.shape, offset, dtype=np.int32)
    else:
        zeros = codes(t["weight_zero_point"].T, bits, out).T.astype(np.int32)  # offset as the codes are
    return _layer(packed, scales, zeros, bits, group or cols, where)
