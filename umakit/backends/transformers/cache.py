"""`umakit.backends.base.KVCache` over a transformers cache: whatever the model's own layers keep (attention keys
and values, sliding windows, the recurrent and convolution states of linear-attention layers)."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer

from umakit.errors import InvalidArgumentError


class TransformersCache:
    """A transformers ``DynamicCache`` (made for the model's config, so each layer keeps what it needs) and the
    positions it holds. Only a cache of full-attention layers can be rewound: a sliding window has overwritten
    old positions, and a recurrent state holds no positions at all (`trimmable`)."""

    def __init__(self, hf, offset: int = 0):
        self.hf = hf
        self._offset = offset

    @property
    def offset(self) -> int:
        return self._offset

    def advance(self, n: int) -> None:
        """``n`` tokens went in (the engine's forward pass)."""
        self._offset += n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.hf))

    @property
    def kv_bits(self) -> int | None:
        return None

    @property
    def trimmable(self) -> bool:
        # full-attention layers only: a linear-attention layer says it can be cropped, but only where it recorded
        # every past state (which umakit's caches do not ask of it)
        sliding = getattr(self.hf, "is_sliding", None) or []
        layers = getattr(self.hf, "layers", None) or []
        return bool(getattr(self.hf, "is_croppable", False)) and not any(sliding) and all(
            type(layer) is DynamicLayer for layer in layers)

    def trim(self, n: int) -> int:
        n = max(0, min(n, self._offset))
        if not n:
            return 0
        if not self.trimmable:
            raise InvalidArgumentError("this model's cache (sliding windows or recurrent state) cannot be trimmed")
        self.hf.crop(-n)  # transformers 5: a negative count removes that many tokens
        self._offset -= n
        return n

    def mark(self) -> tuple:
        """(length, copies of what cropping cannot give back: sliding windows, linear-attention states)."""
        kept = {}
        for i, layer in enumerate(getattr(self.hf, "layers", ())):
            if type(layer) is DynamicLayer:
                continue
            kept[i] = {k: _cloned(v) for k, v in vars(layer).items()}
        return self._offset, kept

    def rewind(self, mark: tuple) -> int:
        offset, kept = mark
        dropped = self._offset - offset
        for i, layer in enumerate(getattr(self.hf, "layers", ())):
            if i in kept:
                for k, v in kept[i].items():
                    setattr(layer, k, _cloned(v))
            elif layer.is_initialized:
                layer.keys, layer.values = layer.keys[..., :offset, :], layer.values[..., :offset, :]
        self._offset = offset
        return dropped

    def copy(self, n: int) -> TransformersCache:
        if not 0 <= n <= self._offset:
            raise InvalidArgumentError(f"a copy of {n} tokens from a cache of {self._offset}")
        if n < self._offset and not self.trimmable:
            raise InvalidArgumentError("this model's cache (sliding windows or recurrent state) cannot be cut to "
                                       "a prefix")
        out = TransformersCache(copy.deepcopy(self.hf), self._offset)
        out.trim(self._offset - n)
        return out


def _cloned(v):
    """A layer attribute kept aside: its tensors copied (a linear-attention layer writes into its states)."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _cloned(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_cloned(x) for x in v]
    return v


def _tensors(obj, depth: int = 0):
    """Every tensor a cache holds: its layers' attributes, one or two levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    elif depth < 3 and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from _tensors(item, depth + 1)
