"""A KV cache over layers whose keys and values differ in shape (gemma4: sliding layers' heads of one size and
count, global layers' of another): one uniform cache per shape, each layer's calls routed to its own.

The uniform caches are the engine's own (cache.py's `StaticKVCache`, quant_cache.py's `QuantizedKVCache`,
batch_decoder.py's `BatchKVCache`), so everything they do (growth, trimming, copies, quantized planes, batch
slots) holds per group; a call that is not a layer's goes to every group alike.
"""

from __future__ import annotations

from typing import Callable, Sequence

Shape = tuple[int, int]  # (kv heads, head size)


def kv_cache(shapes: Sequence[Shape], make: Callable[[int, int, int], object]):
    """``make(layers, kv_heads, head_dim)`` for a model whose slots are alike; a `RaggedKVCache` of one such cache
    per shape otherwise."""
    kinds = list(dict.fromkeys(shapes))
    if len(kinds) == 1:
        return make(len(shapes), *kinds[0])
    where, seen = [], [0] * len(kinds)
    for shape in shapes:
        g = kinds.index(shape)
        where.append((g, seen[g]))
        seen[g] += 1
    return RaggedKVCache([make(n, *kind) for n, kind in zip(seen, kinds)], where)


class RaggedKVCache:
    """`umakit.backends.base.KVCache` on torch (and a batch cache) as several uniform ones; ``where[slot]`` is the
    slot's (group, layer within the group)."""

    def __init__(self, groups: list, where: list[tuple[int, int]]):
        self.groups, self.where = groups, where

    def update(self, layer: int, k, v, positions, *rest):
        g, i = self.where[layer]
        return self.groups[g].update(i, k, v, positions, *rest)

    def __getattr__(self, name: str):
        # what every group holds alike (offset, capacity, kv_bits, trimmable, max_tokens, rows), read off the
        # first; the buffers' identity (k, v: a CUDA graph's key) changes for all groups at once
        if name in ("offset", "capacity", "kv_bits", "trimmable", "max_tokens", "rows", "k", "v", "dtype",
                    "device"):
            return getattr(self.groups[0], name)
        raise AttributeError(name)

    def reserve(self, *args) -> bool:
        return any([g.reserve(*args) for g in self.groups])  # every group grows, the same way

    def advance(self, n: int) -> None:
        for g in self.groups:
            g.advance(n)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def trim(self, n: int) -> int:
        return [g.trim(n) for g in self.groups][0]

    def mark(self) -> int:
        return self.groups[0].mark()

    def rewind(self, mark: int) -> int:
        return [g.rewind(mark) for g in self.groups][0]

    def copy(self, n: int) -> "RaggedKVCache":
        return RaggedKVCache([g.copy(n) for g in self.groups], self.where)

    # -- a batch cache's (`BatchKVCache`): single-sequence caches are ragged alike --------------------------------
    def put(self, slot: int, single: "RaggedKVCache") -> None:
        for mine, theirs in zip(self.groups, single.groups, strict=True):
            mine.put(slot, theirs)

    def get(self, slot: int, n: int, single: "RaggedKVCache") -> None:
        for mine, theirs in zip(self.groups, single.groups, strict=True):
            mine.get(slot, n, theirs)

    def keep(self, slots: list[int], span: int) -> None:
        for g in self.groups:
            g.keep(slots, span)

    def slotted(self, slots: list[int]) -> "RaggedKVCache":
        return RaggedKVCache([g.slotted(slots) for g in self.groups], self.where)
