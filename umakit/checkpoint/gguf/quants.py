"""GGUF quantization blocks as MLX affine groups, in pure numpy.

MLX's affine format stores, for each group of ``group_size`` consecutive
weights of a row, ``w = scale * q + bias`` with unsigned integer codes ``q``.
Several GGUF block types are exactly that with groups of 32:

    Q4_0  w = d * (q - 8)            -> scale d,        bias -8 d     (4 bits)
    Q4_1  w = d * q + m              -> scale d,        bias m        (4 bits)
    Q5_0  w = d * (q - 16)           -> scale d,        bias -16 d    (5 bits)
    Q5_1  w = d * q + m              -> scale d,        bias m        (5 bits)
    Q8_0  w = d * q, q signed        -> q + 128, scale d, bias -128 d (8 bits)
    Q4_K  w = d*sc_j * q - dmin*m_j  -> one group per 32-wide sub-block (4 bits)
    Q5_K  as Q4_K with 5-bit q                                        (5 bits)

Each scale and bias is a float16 times a small integer, so it is exact in
float32; `pick_dtype` stores it as float16 when that is exact too. Every other
block type has no such form (Q6_K's groups are 16 wide, IQ types use lookup
grids) and is re-quantized by the caller; `lossy_bits` picks the width.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

GROUP_SIZE = 32
MLX_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}  # bf16 kept as raw bits


@dataclass
class Affine:
    """Integer codes with per-group scales and biases, one row per output feature."""

    q: np.ndarray  # (rows, cols) uint8 codes
    scales: np.ndarray  # (rows, cols // group_size) float32
    biases: np.ndarray  # (rows, cols // group_size) float32
    bits: int
    group_size: int = GROUP_SIZE

    def take_rows(self, order: np.ndarray) -> Affine:
        return Affine(self.q[order], self.scales[order], self.biases[order], self.bits, self.group_size)

    def take_cols(self, order: np.ndarray) -> Affine:
        """Columns reordered in whole groups (each group's scale and bias move with it); ValueError otherwise."""
        g = self.group_size
        starts = order.reshape(-1, g)[:, 0]
        if starts.size * g != order.size or (starts % g).any() or (order.reshape(-1, g) - starts[:, None]
                                                                  != np.arange(g)).any():
            raise ValueError(f"a column order that splits groups of {g}")
        groups = starts // g
        return Affine(self.q[:, order], self.scales[:, groups], self.biases[:, groups], self.bits, g)

    def reorder(self, rows: np.ndarray | None, cols: np.ndarray | None) -> Affine:
        aff = self if rows is None else self.take_rows(rows)
        return aff if cols is None else aff.take_cols(cols)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) little-endian bytes -> (n, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are elements 0-15, high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) bits, bit j for element j."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q4_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles16(b[:, 2:]), d, -8 * d


def _q4_1(b: np.ndarray):
    return _nibbles16(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles16(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4), d, -16 * d


def _q5_1(b: np.ndarray):
    return _nibbles16(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray):
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _k_scales(b: np.ndarray):
    """Super-block scale and min, and the 8 sub-block 6-bit (sc, m) pairs packed in 12 bytes."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    lo, hi, mix = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))  # (n, 8) each


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 256): 32-byte chunk c holds sub-block 2c low, 2c+1 high."""
    qs = qs.reshape(-1, 4, 1, 32)  # (n, chunk, 1, byte)
    return ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray):
    scales, biases = _k_scales(b)
    return _k_nibbles(b[:, 16:]), scales, biases


def _q5_k(b: np.ndarray):
    scales, biases = _k_scales(b)
    # Bit j of high byte i is the fifth bit of element i of sub-block j.
    high = np.unpackbits(b[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8)  # (n, i, j)
    high = high.transpose(0, 2, 1).reshape(-1, 256)
    return _k_nibbles(b[:, 48:]) | (high << 4), scales, biases


# type -> (block decoder, bits); a decoder maps (n_blocks, type_size) bytes to
# codes (n_blocks, block_size) and scales, biases (n_blocks, block_size // 32).
EXACT: dict[T, tuple[Callable, int]] = {
    T.Q4_0: (_q4_0, 4),
    T.Q4_1: (_q4_1, 4),
    T.Q5_0: (_q5_0, 5),
    T.Q5_1: (_q5_1, 5),
    T.Q8_0: (_q8_0, 8),
    T.Q4_K: (_q4_k, 4),
    T.Q5_K: (_q5_k, 5),
}


def _q6_k(b: np.ndarray):
    """Q6_K (ql[128], qh[64], int8 scales[16], d): w = d * sc_j * (q - 32), one scale per 16 weights. Of each
    half (128 weights), quarter j's weight l is ql's nibble and qh's 2-bit field: low nibbles of ql[l] (j = 0)
    and ql[32 + l] (j = 1), high nibbles of both (j = 2, 3), qh[l] bits 2j, 2j + 1 above them. Written in place
    into one array (a concatenation and a shift per quarter took 1.6x as long)."""
    n = len(b)
    ql, qh = b[:, :128].reshape(n, 2, 2, 32), b[:, 128:192].reshape(n, 2, 1, 32)
    q = np.empty((n, 2, 4, 32), dtype=np.uint8)  # (n, half, j, l)
    np.bitwise_and(ql, 0x0F, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    high = np.empty_like(q)  # qh's field j moved to bits 4-5
    np.left_shift(qh, 4, out=high[:, :, 0:1])
    np.left_shift(qh, 2, out=high[:, :, 1:2])
    high[:, :, 2:3] = qh
    np.right_shift(qh, 2, out=high[:, :, 3:4])
    high &= 0x30
    q |= high
    scales = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    return q.reshape(n, 256), scales, -32 * scales


# Block types exact as affine groups of 16, which MLX does not take (its groups are 32, 64 or 128): imported
# exactly for umakit's CPU kernel (`Affine` with group_size 16), re-quantized for the others on first use
# (requantized.py).
EXACT16: dict[T, tuple[Callable, int]] = {T.Q6_K: (_q6_k, 6)}
EXACT16_GROUP = 16


CHUNK_BLOCKS = 4096  # blocks decoded at a time: about 1M weights, so the decoders' temporaries stay in cache


_POOL: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child makes its own


def each_chunk(fn: Callable[[int, int], object], n: int, step: int) -> list:
    """``fn(lo, hi)`` over [0, n) in chunks of ``step``, on every core this process may use (numpy lets go of the
    GIL in its loops): the results in order. Each chunk writes its own rows of the caller's arrays, so the outputs
    are those of one loop, and memory holds a chunk's temporaries a core."""
    chunks = [(lo, min(n, lo + step)) for lo in range(0, n, max(1, step))]
    if len(chunks) < 2:
        return [fn(lo, hi) for lo, hi in chunks]
    pid = os.getpid()
    if pid not in _POOL:
        _POOL.clear()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
        _POOL[pid] = ThreadPoolExecutor(cores, thread_name_prefix="umakit-import")
    return list(_POOL[pid].map(lambda c: fn(*c), chunks))


def _decoded(decode: Callable, data: np.ndarray, qtype: T, group: int):
    """``decode`` over ``data``'s blocks a chunk at a time: codes (n, block), scales and biases (n, block // group)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    n, per = len(blocks), block_size // group
    q = np.empty((n, block_size), dtype=np.uint8)
    scales, biases = np.empty((n, per), dtype=np.float32), np.empty((n, per), dtype=np.float32)

    def chunk(lo: int, hi: int) -> None:
        q[lo:hi], scales[lo:hi], biases[lo:hi] = decode(blocks[lo:hi])

    each_chunk(chunk, n, CHUNK_BLOCKS)
    return q, scales, biases


def to_affine16(data: np.ndarray, qtype: T, cols: int) -> Affine:
    """`to_affine` for the `EXACT16` types."""
    decode, bits = EXACT16[qtype]
    rows = data.shape[0]
    q, scales, biases = _decoded(decode, data, qtype, EXACT16_GROUP)
    groups = cols // EXACT16_GROUP
    return Affine(q.reshape(rows, cols), scales.reshape(rows, groups), biases.reshape(rows, groups), bits,
                  EXACT16_GROUP)


def to_affine(data: np.ndarray, qtype: T, cols: int) -> Affine:
    """Decode a 2-D tensor's raw blocks, (rows, bytes per row), to affine groups."""
    decode, bits = EXACT[qtype]
    rows = data.shape[0]
    q, scales, biases = _decoded(decode, data, qtype, GROUP_SIZE)
    return Affine(
        q=q.reshape(rows, cols),
        scales=scales.reshape(rows, cols // GROUP_SIZE),
        biases=biases.reshape(rows, cols // GROUP_SIZE),
        bits=bits,
    )


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack (rows, cols) codes into MLX's (rows, cols * bits / 32) uint32 words.

    Code j of a row occupies bits [j * bits, (j + 1) * bits) of the row read as
    one little-endian bit string, for every width MLX supports.
    """
    rows, cols = q.shape
    assert bits in MLX_BITS and cols % 32 == 0 and q.dtype == np.uint8
    if bits == 8:
        return np.ascontiguousarray(q).view("<u4")
    out = np.empty((rows, cols * bits // 32), dtype="<u4")

    def chunk(lo: int, hi: int) -> None:
        if bits == 4:  # two codes a byte, the first in the low nibble
            out[lo:hi] = np.ascontiguousarray(q[lo:hi, 0::2] | (q[lo:hi, 1::2] << 4)).view("<u4")
            return
        codes = q[lo:hi].reshape(-1, cols // 8, 8)
        # 8 codes fill exactly `bits` bytes of a little-endian uint64, lane by lane (numpy's reduce over an axis
        # of 8 took 6x as long)
        word = codes[..., 0].astype(np.uint64)
        for j in range(1, 8):
            word |= codes[..., j].astype(np.uint64) << np.uint64(j * bits)
        packed = word[..., None].view(np.uint8)[..., :bits]  # (r, cols / 8, bits)
        out[lo:hi] = np.ascontiguousarray(packed).reshape(len(codes), -1).view("<u4")

    each_chunk(chunk, rows, (1 << 18) // cols)  # rows a chunk: its uint64 words stay in a core's cache
    return out


def unpack(words: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """`pack`'s inverse: (rows, cols * bits / 32) MLX words -> (rows, cols) uint8 codes, on every core."""
    rows = words.shape[0]
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(rows, -1)
    out = np.empty((rows, cols), dtype=np.uint8)

    def chunk(lo: int, hi: int) -> None:
        b, q = raw[lo:hi], out[lo:hi]
        if bits == 8:
            q[:] = b
        elif bits == 6:  # a Q6_K's (the only width a load unpacks): four codes in three bytes, 6 + 2|4 + 4|2 + 6 bits
            b0, b1, b2 = b[:, 0::3], b[:, 1::3], b[:, 2::3]
            q[:, 0::4] = b0 & 0x3F
            q[:, 1::4] = (b0 >> 6) | ((b1 & 0x0F) << 2)
            q[:, 2::4] = (b1 >> 4) | ((b2 & 0x03) << 4)
            q[:, 3::4] = b2 >> 2
        else:  # 8 codes in the low `bits` bytes of a little-endian uint64
            lanes = np.zeros((hi - lo, cols // 8, 8), dtype=np.uint8)
            lanes[..., :bits] = b.reshape(hi - lo, cols // 8, bits)
            shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
            q[:] = ((lanes.view("<u8") >> shifts) & np.uint64((1 << bits) - 1)).reshape(hi - lo, cols)

    each_chunk(chunk, rows, max(1, (1 << 18) // cols))
    return out


def pick_dtype(scales: np.ndarray, biases: np.ndarray) -> np.dtype:
    """float16 when both round-trip through it exactly, else float32."""
    for x in (scales, biases):
        h = x.astype(np.float16)
        if not (np.isfinite(h).all() and np.array_equal(h.astype(np.float32), x)):
            return np.dtype(np.float32)
    return np.dtype(np.float16)


def lossy_bits(qtype: T) -> int:
    """Narrowest MLX width holding at least the type's bits per weight (Q6_K -> 8, Q3_K -> 4)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    need = math.ceil(type_size * 8 / block_size)
    return next((b for b in MLX_BITS if b >= need), MLX_BITS[-1])


# Block types whose values are a scale times a code centred on zero: re-quantized symmetric, as Q8_0 is.
SYMMETRIC = frozenset({T.Q6_K, T.Q3_K})


CHUNK_VALUES = 1 << 18  # float32 values a chunk: 1 MB, so each pass over it stays in a core's cache


def symmetric8(values: Callable[[int, int], np.ndarray], rows: int, cols: int,
               amax: Callable[[int, int], np.ndarray] | None = None) -> tuple[tuple, int, float]:
    """A (rows, cols) tensor, whose float32 rows ``values(lo, hi)`` gives a chunk at a time, as 8-bit groups of 32
    with bias = -128 * scale (Q8_0's form): packed MLX arrays, bits and the largest error. Memory holds the codes
    and a chunk, not the tensor in float32 and its temporaries. As fine a step as min-max groups (max |w| / 127
    against (max - min) / 255), and a CPU kernel that knows the bias from the scale reads half the scale bytes (a
    Q6_K tensor 8.5 bits a weight on the torch engine, not 9). ``amax(lo, hi)``: each group's largest |value|,
    where the caller has it for less than ``values`` costs (which is then called once a chunk, not twice)."""
    step = CHUNK_VALUES // max(cols, 1)
    largest = np.empty((rows, cols // GROUP_SIZE), dtype=np.float32)

    def most(lo: int, hi: int) -> None:
        largest[lo:hi] = (amax(lo, hi) if amax else
                          np.abs(values(lo, hi).reshape(hi - lo, -1, GROUP_SIZE)).max(axis=-1))

    each_chunk(most, rows, step)
    scales = largest / 127
    half = scales.astype(np.float16).astype(np.float32)
    if np.isfinite(half).all() and not ((half == 0) & (largest > 0)).any():
        scales = half  # float16 where no group overflows or vanishes in it
    safe = np.where(scales > 0, scales, 1)
    biases = scales * -128
    q = np.empty((rows, cols), dtype=np.uint8)

    def codes(lo: int, hi: int) -> float:  # in place: each pass over a chunk that stays in cache, no temporaries
        groups = values(lo, hi).reshape(hi - lo, -1, GROUP_SIZE)
        c = np.divide(groups, safe[lo:hi, :, None])
        np.rint(c, out=c)
        np.clip(c, -128, 127, out=c)
        c += 128
        q[lo:hi] = c.reshape(hi - lo, cols)
        c *= scales[lo:hi, :, None]  # back to values, their distance from the tensor's the error
        c += biases[lo:hi, :, None]
        c -= groups
        return float(np.abs(c, out=c).max()) if groups.size else 0.0

    err = max(each_chunk(codes, rows, step), default=0.0)
    dtype = pick_dtype(scales, biases)
    return (pack(q, 8), scales.astype(dtype), biases.astype(dtype)), 8, err


def can_dequantize(qtype: T) -> bool:
    """Whether the gguf package can dequantize ``qtype`` (probed on one zero block)."""
    from gguf import quants

    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False
    return True
