"""The quantized torch KV cache (``kv_bits`` 8 or 4): mlx-lm's QuantizedKVCache, on torch.

K and V of every layer are kept as affine codes in groups of `KV_GROUP_SIZE` along
head_dim, each group with a scale and a bias in the compute dtype, so a token costs
what `umakit.plan.roofline.kv_bytes_per_token` counts. An update quantizes the new
keys and values into the buffers and hands attention the filled span dequantized,
so the model attends as over a float cache. CUDA graphs and the fused CPU step read
and write a float cache in place: the engine decodes eagerly over this one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from umakit.core.affine import KV_BITS, KV_GROUP_SIZE
from umakit.errors import InvalidArgumentError
from umakit.backends.torch.cache import GROW_STEP, grown_capacity


# -- pure functions ---------------------------------------------------------------
def quantize(x: torch.Tensor, bits: int, group_size: int = KV_GROUP_SIZE):
    """Min-max affine codes of ``x`` (..., D) in groups along D: (codes, scales, biases), x ~ scales * q + biases.

    codes are uint8 (..., D * bits / 8), two 4-bit codes a byte, low nibble first (the
    bytes of MLX's little-endian words); scales and biases (..., D / group_size) are in
    x's dtype, rounded before the codes are chosen, so the codes fit the stored scales.
    The arithmetic of quant/layout.py's `quantize` for weights, over a cache's leading
    dimensions and into bytes written in place.
    """
    levels = 2**bits - 1
    g = x.float().unflatten(-1, (-1, group_size))  # (..., groups, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / levels).to(x.dtype).clamp(min=torch.finfo(x.dtype).tiny)
    biases = lo.to(x.dtype)
    q = ((g - biases.float()[..., None]) / scales.float()[..., None]).round_().clamp_(0, levels)
    return pack(q.to(torch.uint8).flatten(-2), bits), scales, biases


def dequantize(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               dtype: torch.dtype, group_size: int = KV_GROUP_SIZE) -> torch.Tensor:
    """Float values (..., D) in ``dtype`` from `quantize`'s output, computed in float32."""
    q = unpack(codes, bits).unflatten(-1, (-1, group_size)).float()  # (..., groups, group)
    return (q * scales.float()[..., None] + biases.float()[..., None]).flatten(-2).to(dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., D) uint8 -> bytes (..., D * bits / 8)."""
    return q if bits == 8 else q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(b: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: bytes (..., D * bits / 8) -> codes (..., D) uint8."""
    return b if bits == 8 else torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)


def check_kv_bits(kv_bits: int, head_dim: int) -> None:
    """Refuse widths the cache lacks and heads that do not split into whole groups (as the MLX engine does)."""
    if isinstance(kv_bits, bool) or kv_bits not in KV_BITS:
        raise InvalidArgumentError(f"kv_bits must be {' or '.join(map(str, KV_BITS))}, got {kv_bits}")
    if head_dim % KV_GROUP_SIZE:
        raise InvalidArgumentError(
            f"a quantized KV cache needs a head size divisible by {KV_GROUP_SIZE}; this model's is {head_dim}"
        )


# -- the cache --------------------------------------------------------------------
class Planes(NamedTuple):
    """K's or V's buffers, each (L, B, nkv, capacity, width): codes, then a scale and a bias per group."""

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor


class QuantizedKVCache:
    """`umakit.backends.base.KVCache` on torch with K and V quantized to ``kv_bits``, grown as `StaticKVCache` is."""

    trimmable = True  # positions are never overwritten: trimming only moves the offset back

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_tokens: int, kv_bits: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = GROW_STEP):
        check_kv_bits(kv_bits, head_dim)
        self.kv_bits = kv_bits
        self.shape = (layers, 1, kv_heads, 0, head_dim)  # (L, B, nkv, S, hd) of the values held
        self.max_tokens = max_tokens
        self.dtype, self.device = dtype, device  # dtype: the scales', biases' and attention's
        self.offset = 0
        self.k = self.v = None
        self._allocate(min(capacity, max_tokens))

    def _allocate(self, capacity: int) -> None:
        self.k, self.v = self._planes(capacity, self.k), self._planes(capacity, self.v)

    def _planes(self, capacity: int, old: Planes | None) -> Planes:
        """Empty buffers of ``capacity`` tokens, holding the first ``offset`` tokens of ``old``."""
        L, B, H, _, D = self.shape
        groups = D // KV_GROUP_SIZE
        made = Planes(*(torch.zeros(L, B, H, capacity, width, dtype=dtype, device=self.device)
                        for width, dtype in ((D * self.kv_bits // 8, torch.uint8), (groups, self.dtype),
                                             (groups, self.dtype))))
        if old is not None:
            for new, kept in zip(made, old, strict=True):
                new[:, :, :, : self.offset] = kept[:, :, :, : self.offset]
        return made

    @property
    def capacity(self) -> int:
        return self.k.codes.shape[3]

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` more tokens; True if the buffers moved."""
        capacity = grown_capacity(self.offset + n, self.capacity, self.max_tokens)
        if capacity is None:
            return False
        self._allocate(capacity)
        return True

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, static: int = 0):
        """Store k, v (B, nkv, T, hd) quantized at ``offset``; return this layer's keys and values so far,
        (B, nkv, offset + T, hd) dequantized to the cache's dtype."""
        assert not static, "a quantized cache runs eagerly: the engine never captures a graph over it"
        T, end = k.shape[2], self.offset + k.shape[2]
        for planes, x in ((self.k, k), (self.v, v)):
            for plane, part in zip(planes, quantize(x, self.kv_bits), strict=True):
                plane[layer].narrow(2, self.offset, T).copy_(part)
        return tuple(dequantize(*(plane[layer].narrow(2, 0, end) for plane in planes), self.kv_bits, self.dtype)
                     for planes in (self.k, self.v))

    def advance(self, n: int) -> None:
        self.offset += n

    # -- umakit's KVCache protocol ----------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(plane.nbytes for planes in (self.k, self.v) for plane in planes)

    def trim(self, n: int) -> int:
        n = max(min(n, self.offset), 0)
        self.offset -= n  # stale entries are overwritten before they are read again
        return n

    def mark(self) -> int:
        return self.offset

    def rewind(self, mark: int) -> int:
        return self.trim(self.offset - mark)

    def copy(self, n: int) -> "QuantizedKVCache":
        L, _, H, _, D = self.shape
        n = max(min(n, self.offset), 0)
        made = QuantizedKVCache(L, H, D, self.max_tokens, self.kv_bits, self.dtype, self.device,
                                capacity=max(-(-n // GROW_STEP) * GROW_STEP, GROW_STEP))
        made.offset = n  # what _planes copies of the planes given
        made.k, made.v = made._planes(made.capacity, self.k), made._planes(made.capacity, self.v)
        return made
