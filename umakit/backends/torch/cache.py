"""The torch KV cache: one preallocated buffer per K and V for all layers.

Eager calls write at ``offset`` and attend to the filled part; a static call
(a captured CUDA graph) writes at device-side positions and attends to a fixed
span of slots under a mask, so every decode step in that span has one shape.
The quantized cache (``kv_bits``) grows the same way; it lives in quant_cache.py.
"""

from __future__ import annotations

from typing import Protocol

import torch

from umakit.errors import InvalidArgumentError

GROW_STEP = 256  # capacity grows in multiples of this many tokens


def grown_capacity(need: int, capacity: int, max_tokens: int) -> int | None:
    """The capacity a cache grows to so that it holds ``need`` tokens; None when ``capacity`` holds them already."""
    if need <= capacity:
        return None
    if need > max_tokens:
        raise InvalidArgumentError(
            f"{need} tokens do not fit the model's context of {max_tokens}; shorten the prompt or reply"
        )
    return min(-(-need // GROW_STEP) * GROW_STEP, max_tokens)


class LayerKV(Protocol):
    """What a model layer needs from a cache (the engine's cache also implements umakit's KVCache)."""

    offset: int
    capacity: int

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, static: int): ...

    def advance(self, n: int) -> None: ...


class StaticKVCache:
    """`umakit.backends.base.KVCache` on torch: K and V of every layer in one buffer each, grown in steps."""

    kv_bits = None  # this engine's cache holds the activation dtype
    trimmable = True  # positions are never overwritten: trimming only moves the offset back

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = GROW_STEP):
        self.shape = (layers, 1, kv_heads, 0, head_dim)  # (L, B, nkv, S, hd)
        self.max_tokens = max_tokens
        self.dtype, self.device = dtype, device
        self.offset = 0
        self.k = self.v = None
        self._allocate(min(capacity, max_tokens))

    def _allocate(self, capacity: int) -> None:
        L, B, H, _, D = self.shape
        k = torch.zeros(L, B, H, capacity, D, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[:, :, :, : self.offset] = self.k[:, :, :, : self.offset]
            v[:, :, :, : self.offset] = self.v[:, :, :, : self.offset]
        self.k, self.v = k, v
        self.layers = list(zip(k.unbind(0), v.unbind(0), strict=True))  # per-layer views, made once

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, n: int) -> bool:
        """Make room for ``n`` more tokens; True if the buffers moved (captured graphs are stale)."""
        capacity = grown_capacity(self.offset + n, self.capacity, self.max_tokens)
        if capacity is None:
            return False
        self._allocate(capacity)
        return True

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, static: int = 0):
        """Store k, v (B, nkv, T, hd); return this layer's keys and values to attend to.

        ``static`` > 0: write at the device-side ``positions`` and return the first
        ``static`` slots, so the shapes do not depend on the offset.
        """
        kc, vc = self.layers[layer]
        if static:
            kc.index_copy_(2, positions, k)
            vc.index_copy_(2, positions, v)
            return kc[:, :, :static], vc[:, :, :static]
        T, end = k.shape[2], self.offset + k.shape[2]
        kc.narrow(2, self.offset, T).copy_(k)
        vc.narrow(2, self.offset, T).copy_(v)
        return kc.narrow(2, 0, end), vc.narrow(2, 0, end)

    def advance(self, n: int) -> None:
        self.offset += n

    # -- umakit's KVCache protocol ----------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def trim(self, n: int) -> int:
        n = max(min(n, self.offset), 0)
        self.offset -= n  # stale entries are overwritten before they are read again
        return n

    def mark(self) -> int:
        return self.offset

    def rewind(self, mark: int) -> int:
        return self.trim(self.offset - mark)

    def copy(self, n: int) -> "StaticKVCache":
        L, _, H, _, D = self.shape
        n = max(min(n, self.offset), 0)
        made = StaticKVCache(L, H, D, self.max_tokens, self.dtype, self.device,
                             capacity=max(-(-n // GROW_STEP) * GROW_STEP, GROW_STEP))
        made.k[:, :, :, :n] = self.k[:, :, :, :n]
        made.v[:, :, :, :n] = self.v[:, :, :, :n]
        made.offset = n
        return made
