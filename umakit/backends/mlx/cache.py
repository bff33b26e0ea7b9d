"""The MLX KV cache: mlx-lm's per-layer caches behind umakit's KVCache protocol."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from umakit.core.affine import KV_BITS, KV_GROUP_SIZE
from umakit.errors import InvalidArgumentError
from umakit.backends.mlx.mlx_lm_import import import_mlx_lm

_cache = import_mlx_lm("models.cache")
KVCache, QuantizedKVCache, make_prompt_cache = _cache.KVCache, _cache.QuantizedKVCache, _cache.make_prompt_cache
ArraysCache = _cache.ArraysCache


@dataclass
class MLXCache:
    """`umakit.backends.base.KVCache` on MLX."""

    layers: list  # one mlx-lm cache per layer, passed to the model as is
    kv_bits: int | None = None

    @classmethod
    def for_model(cls, model, kv_bits: int | None = None) -> "MLXCache":
        layers = make_prompt_cache(model)
        if kv_bits is not None:
            if kv_bits not in KV_BITS:
                raise InvalidArgumentError(f"kv_bits must be {' or '.join(map(str, KV_BITS))}, got {kv_bits}")
            head_dim = model.layers[0].self_attn.head_dim if hasattr(model, "layers") else None
            if head_dim is not None and head_dim % KV_GROUP_SIZE:
                raise InvalidArgumentError(
                    f"a quantized KV cache needs a head size divisible by {KV_GROUP_SIZE}; this model's is {head_dim}"
                )
            if not all(type(c) is KVCache for c in layers):
                raise InvalidArgumentError("this model's cache (sliding window or recurrent layers) cannot be quantized")
            layers = [QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=kv_bits) for _ in layers]
        return cls(layers, kv_bits)

    @property
    def offset(self) -> int:
        # The minimum, so that a step interrupted half-way through the layers
        # still leaves a consistent length to trim back to. A recurrent layer's state has no length: the
        # attention layers beside it say it.
        return min((c.offset for c in self.layers if hasattr(c, "offset")), default=0)

    @property
    def trimmable(self) -> bool:
        # A rotating (sliding-window) layer overwrites old positions once full: it cannot always be rewound.
        return all(type(c) in (KVCache, QuantizedKVCache) for c in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def copy(self, n: int) -> "MLXCache":
        if not self.trimmable:
            raise InvalidArgumentError("this model's cache (sliding window or recurrent layers) cannot be copied")
        n = max(min(n, self.offset), 0)
        layers = []
        for c in self.layers:
            made = KVCache() if type(c) is KVCache else QuantizedKVCache(group_size=c.group_size, bits=c.bits)
            if n:
                cut = (lambda a: a[..., :n, :]) if type(c) is KVCache else (lambda t: tuple(a[..., :n, :] for a in t))
                made.keys, made.values, made.offset = cut(c.keys), cut(c.values), n
            layers.append(made)
        return MLXCache(layers, self.kv_bits)

    def mark(self) -> tuple:
        """(length, the states trimming cannot give back: a recurrent layer's arrays, a rotating layer's window)."""
        kept, arrays = {}, []
        for i, c in enumerate(self.layers):
            if type(c) is ArraysCache:
                kept[i] = list(c.cache)  # replaced, never written into, by the model's steps
            elif type(c) not in (KVCache, QuantizedKVCache):  # a rotating window's buffers are written into
                state = tuple(a + 0 for a in c.state) if getattr(c, "keys", None) is not None else None
                kept[i] = (state, c.meta_state)
                arrays += list(state or ())
        mx.eval(arrays)
        return self.offset, kept

    def rewind(self, mark: tuple) -> int:
        offset, kept = mark
        dropped = self.offset - offset
        for i, c in enumerate(self.layers):
            if i in kept and type(c) is ArraysCache:
                c.cache = list(kept[i])
            elif i in kept:
                state, meta = kept[i]
                if state:
                    c.state = tuple(a + 0 for a in state)  # the mark stays as it was, for another rewind
                c.meta_state = meta
            else:
                c.trim(c.offset - offset)
        return dropped

    def trim(self, n: int) -> int:
        keep = max(self.offset - n, 0)
        if all(getattr(c, "offset", keep) == keep for c in self.layers) and keep == self.offset:
            return 0
        if not all(c.is_trimmable() for c in self.layers):
            raise InvalidArgumentError("this model's cache cannot be trimmed")
        dropped = self.offset - keep
        for c in self.layers:
            c.trim(c.offset - keep)
        return dropped
