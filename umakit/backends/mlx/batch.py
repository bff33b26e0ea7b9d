"""MLX batched decoder: many sequences advanced by one forward pass per step.

The rows share mlx-lm's batch caches (`BatchKVCache`, `BatchRotatingKVCache`
for sliding-window layers): keys and values are left-padded to a common
length and each row keeps its own offset, so RoPE positions and the attention
mask are per row. New rows are prefilled together in a cache of their own and
only then appended, so a prefill never writes into a running row's cache.
Each row samples with its own settings and its own random key chain, the
same chain `MLXEngine.generate_tokens` uses, so a seeded row reproduces a
seeded single-sequence run.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import mlx.core as mx

from ...errors import InvalidArgumentError, UnsupportedModelError
from ..base import PREFILL_CHUNK, BatchRow
from ...hardware import cpu_kv_budget
from ...sampling import seed_or_random
from .mlx_lm_import import import_mlx_lm
from .sampling import make_sampler

_cache = import_mlx_lm("models.cache")
BatchKVCache, BatchRotatingKVCache = _cache.BatchKVCache, _cache.BatchRotatingKVCache
KVCache, RotatingKVCache, make_prompt_cache = _cache.KVCache, _cache.RotatingKVCache, _cache.make_prompt_cache

PAD_WASTE = 1.5  # prefill rows together while padded tokens stay under this factor of real ones


class _RowSampler:
    """One row's sampling state: its sampler, random key and recent tokens."""

    def __init__(self, row: BatchRow):
        p = row.sampling
        self.plain = p.greedy and p.repetition_penalty == 1.0  # a batched argmax serves it
        self.sampler = make_sampler(p)
        self.key = mx.random.key(seed_or_random(row.seed))
        self.window = p.repetition_context
        self.recent = mx.array(list(row.prompt)[-self.window:], dtype=mx.uint32)[None]  # (1, n)

    def sample(self, logits: mx.array) -> mx.array:
        """logits (1, V) -> token (1,), advancing the key and the recent window."""
        self.key, sub = mx.random.split(self.key)
        token = self.sampler(logits, self.recent, sub).astype(mx.uint32)
        self.recent = mx.concatenate([self.recent, token[None]], axis=1)[:, -self.window:]
        return token


def _batch_layer(layer, left_padding: list[int], model_type: str):
    """An empty batch cache standing in for one layer's single-sequence cache."""
    if type(layer) is KVCache:
        return BatchKVCache(left_padding)
    if type(layer) is RotatingKVCache and layer.keep == 0:
        return BatchRotatingKVCache(layer.max_size, left_padding)
    raise UnsupportedModelError(
        f"batched decoding does not support {type(layer).__name__} cache layers (model_type {model_type}) yet"
    )


def _prefill_groups(rows: Sequence[BatchRow]) -> list[list[BatchRow]]:
    """Rows sorted by length and cut where padding them together would waste compute."""
    groups: list[list[BatchRow]] = []
    for row in sorted(rows, key=lambda r: len(r.prompt)):
        group = groups[-1] if groups else None
        if group is not None:
            real = sum(len(r.prompt) for r in group) + len(row.prompt)
            if len(row.prompt) * (len(group) + 1) <= PAD_WASTE * real + len(group) + 1:
                group.append(row)
                continue
        groups.append([row])
    return groups


class MLXBatchDecoder:
    """`umakit.backends.base.BatchDecoder` for `MLXEngine`."""

    def __init__(self, engine):
        self._engine = engine
        self._model = engine.model
        self._model_type = engine.config.get("model_type", "?")
        self._device = mx.gpu if engine.device == "metal" else mx.cpu
        for layer in make_prompt_cache(self._model):  # refuse unsupported layers up front
            _batch_layer(layer, [0], self._model_type)
        self._reset()

    def _reset(self) -> None:
        self._cache: list | None = None  # one batch cache per layer; rows in self._ids order
        self._ids: list[int] = []
        self._rows: list[_RowSampler] = []
        self._next: mx.array | None = None  # (B,) the tokens the next forward pass reads
        self._ready: list[bool] = []  # whether _next[i] is a sampled token (not a prompt's last)

    @property
    def size(self) -> int:
        return len(self._ids)

    def add(self, rows: Sequence[BatchRow]) -> None:
        for row in rows:
            if not row.prompt:
                raise InvalidArgumentError("a prompt is empty: there is nothing to continue from")
        with mx.stream(self._device):
            for group in _prefill_groups(rows):
                self._append(group, self._prefill(group))

    def _prefill(self, group: list[BatchRow]) -> list:
        """A fresh batch cache holding each row's prompt but its last token."""
        heads = [list(r.prompt[:-1]) for r in group]
        length = max(len(h) for h in heads)
        pads = [length - len(h) for h in heads]
        cache = [_batch_layer(c, pads, self._model_type) for c in make_prompt_cache(self._model)]
        if length:
            tokens = mx.array([[0] * p + h for p, h in zip(pads, heads)], dtype=mx.uint32)  # (b, L) left-padded
            chunk = max(PREFILL_CHUNK // len(group), 16)  # bounds attention memory per chunk
            for start in range(0, length, chunk):
                self._model(tokens[:, start:start + chunk], cache=cache)
                mx.eval([c.state for c in cache])
        return cache

    def _append(self, group: list[BatchRow], cache: list) -> None:
        if self._cache is None:
            self._cache = cache
        else:
            for running, new in zip(self._cache, cache):
                running.extend(new)  # pads both sides to a common length; copies, never writes in place
        last = mx.array([r.prompt[-1] for r in group], dtype=mx.uint32)
        self._next = last if self._next is None else mx.concatenate([self._next, last])
        self._ids += [r.id for r in group]
        self._rows += [_RowSampler(r) for r in group]
        self._ready += [False] * len(group)

    def step(self) -> list[tuple[int, int]]:
        if not self._ids:
            return []
        with mx.stream(self._device):
            inputs = self._next
            logits = self._model(inputs[:, None], cache=self._cache)[:, -1, :]  # (B, V)
            self._next = self._sample(logits)
            # Queue step n+1 before reading step n: the device computes while
            # the caller detokenizes and checks stops.
            mx.async_eval(self._next)
            report = [i for i, ready in enumerate(self._ready) if ready]
            tokens = inputs.tolist() if report else []
        self._ready = [True] * len(self._ids)
        return [(self._ids[i], tokens[i]) for i in report]

    def _sample(self, logits: mx.array) -> mx.array:
        if all(r.plain for r in self._rows):
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        greedy = mx.argmax(logits, axis=-1).astype(mx.uint32) if any(r.plain for r in self._rows) else None
        picked = [
            greedy[i:i + 1] if r.plain else r.sample(logits[i:i + 1])
            for i, r in enumerate(self._rows)
        ]
        return mx.concatenate(picked)

    def remove(self, ids: Iterable[int]) -> None:
        drop = set(ids)
        keep = [i for i, rid in enumerate(self._ids) if rid not in drop]
        if len(keep) == len(self._ids):
            return
        if not keep:
            self._reset()
            return
        with mx.stream(self._device):
            for c in self._cache:
                c.filter(keep)
            self._next = self._next[mx.array(keep)]
        self._ids = [self._ids[i] for i in keep]
        self._rows = [self._rows[i] for i in keep]
        self._ready = [self._ready[i] for i in keep]

    def kv_budget_bytes(self) -> int:
        if self._engine.device == "metal":
            working_set = int(mx.metal.device_info()["max_recommended_working_set_size"])
            return working_set - self._engine.weight_info().total_bytes
        return cpu_kv_budget()  # the weights are already resident

    def context_tokens(self) -> int:
        return max((c.size() for c in self._cache), default=0) if self._cache else 0
