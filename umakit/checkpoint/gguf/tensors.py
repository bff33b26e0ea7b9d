"""One GGUF tensor in MLX's layout: kept as it is (floats), repacked exactly (the affine block types), re-quantized
(the others), or dequantized; `convert` writes what these return."""

from __future__ import annotations

import numpy as np

from umakit.checkpoint.gguf import quants
from umakit.checkpoint.gguf.arch import ArchSpec


def reordered(values: np.ndarray, order: np.ndarray | None, cols: np.ndarray | None = None) -> np.ndarray:
    values = values if order is None else values[order]
    return values if cols is None else values[:, cols]


def float_tensor(t, hf: str, spec: ArchSpec, order: np.ndarray | None, cols: np.ndarray | None = None):
    import mlx.core as mx

    data = np.asarray(t.data)
    bf16 = t.tensor_type == quants.T.BF16
    if bf16:
        data = data.view(np.uint16)
    data = reordered(data, order, cols)
    if spec.fix is not None:
        if bf16:  # widened exactly to float32 to be changed, and kept so
            data, bf16 = (data.astype(np.uint32) << 16).view(np.float32), False
        data = spec.fix(hf, data)
    arr = mx.array(np.ascontiguousarray(data))
    if bf16:
        arr = arr.view(mx.bfloat16)
    if spec.norm_offset and hf.endswith("norm.weight"):
        arr = (arr.astype(mx.float32) - spec.norm_offset).astype(arr.dtype)
    return arr


def exact(t, order: np.ndarray | None, cols: np.ndarray | None = None) -> tuple[tuple, int, None]:
    """Repack a block type that is an affine format already; values do not change."""
    aff = quants.to_affine(np.asarray(t.data), t.tensor_type, cols=int(t.shape[0])).reorder(order, cols)
    dtype = quants.pick_dtype(aff.scales, aff.biases)
    return (quants.pack(aff.q, aff.bits), aff.scales.astype(dtype), aff.biases.astype(dtype)), aff.bits, None


def requantize(t, order: np.ndarray | None, cols: np.ndarray | None = None) -> tuple[tuple, int, float]:
    """Dequantize with the gguf package, re-quantize to MLX; return arrays, bits, max abs error. A chunk of rows
    at a time (`quants.CHUNK_VALUES`), so memory never holds the tensor in float32; every group is quantized on
    its own, so the chunks give what one pass gives, and float16 scales and biases are kept where every chunk's
    are finite in it."""
    import mlx.core as mx
    from gguf import quants as gguf_quants

    data, width = np.asarray(t.data), int(t.shape[0])

    def values(lo: int, hi: int) -> np.ndarray:  # float32 rows lo..hi of the reordered tensor
        v = gguf_quants.dequantize(data[lo:hi] if order is None else data[order[lo:hi]], t.tensor_type)
        return v if cols is None else v[:, cols]

    bits = quants.lossy_bits(t.tensor_type)
    if t.tensor_type in quants.SYMMETRIC and bits == 8:
        return quants.symmetric8(values, data.shape[0], width)
    step = max(1, quants.CHUNK_VALUES // width)
    parts, errors, half = [], [0.0, 0.0], True
    for lo in range(0, data.shape[0], step):
        ref = mx.array(values(lo, lo + step))
        w, scales, biases = mx.quantize(ref, group_size=quants.GROUP_SIZE, bits=bits)
        halves = scales.astype(mx.float16), biases.astype(mx.float16)
        half = half and all(mx.all(mx.isfinite(x)).item() for x in halves)
        for i, (s, b) in enumerate(((scales, biases), halves) if half else ((scales, biases),)):
            back = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=quants.GROUP_SIZE,
                                 bits=bits)
            errors[i] = max(errors[i], mx.max(mx.abs(back - ref)).item())
        mx.eval(w, scales, biases)
        parts.append((w, scales, biases))
    w, scales, biases = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    if half:
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    mx.eval(w, scales, biases)
    return (w, scales, biases), bits, float(errors[1] if half else errors[0])


def exact16(t, order: np.ndarray | None,
            cols: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A `quants.EXACT16` tensor's codes and scales in groups of 16, exactly (MLX's packing, float32 scales; the
    biases are -2^(bits-1) times them), which the torch engine's CPU kernel reads (backends/torch/load/exact.py);
    and its codes unpacked, (rows, cols) uint8, for `requantized16`."""
    aff = quants.to_affine16(np.asarray(t.data), t.tensor_type, cols=int(t.shape[0])).reorder(order, cols)
    held = {"weight": quants.pack(aff.q, aff.bits), "scales": np.ascontiguousarray(aff.scales, dtype=np.float32)}
    return held, aff.q


def requantized16(codes: np.ndarray, scales: np.ndarray, bits: int) -> tuple[tuple, int, float]:
    """The 8-bit copy for MLX's groups of a layer `exact16` holds (its codes, (rows, cols) uint8, and float32
    scales): arrays, bits and the largest error, as `requantize` makes a symmetric type's, from the same values
    (scale x (code - 2^(bits-1)), the gguf package's products bit for bit)."""
    (rows, cols), group = codes.shape, quants.EXACT16_GROUP
    centre = 2 ** (bits - 1)

    def values(lo: int, hi: int) -> np.ndarray:
        centred = codes[lo:hi].reshape(hi - lo, -1, group).astype(np.float32)
        centred -= centre
        centred *= scales[lo:hi, :, None]
        return centred.reshape(hi - lo, cols)

    def amax(lo: int, hi: int) -> np.ndarray:  # max |scale * code| = |scale| * max |code|: rounding is monotone
        centred = codes[lo:hi].reshape(hi - lo, -1, group).view(np.int8) - np.int8(centre)
        most = np.abs(centred).max(axis=-1).astype(np.float32) * np.abs(scales[lo:hi])
        return most.reshape(hi - lo, -1, quants.GROUP_SIZE // group).max(axis=-1)

    return quants.symmetric8(values, rows, cols, amax)


def dequantized(t):
    """A quantized tensor as float32 (the gguf package's values), for a checkpoint whose engines take no
    MLX-quantized tensors beside its own format (gpt-oss's MXFP4)."""
    import mlx.core as mx
    from gguf import quants as gguf_quants

    return mx.array(np.ascontiguousarray(gguf_quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32))
