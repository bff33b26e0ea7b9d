"""MLX's arrays as the sampler's rules (`umakit.generate.sampling`) and the engines' shared sequence code
(`umakit.backends.common`) use them, with MLX's random keys as the random source."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from umakit.generate import sampling
from umakit.generate.sampling import SamplingParams, seed_or_random


class MLXOps:
    """`umakit.backends.common.EngineOps` for MLX arrays."""

    neg_inf = float("-inf")

    @staticmethod
    def floating(x):
        return x.astype(mx.float32)

    @staticmethod
    def gather(x, index):
        return mx.take_along_axis(x, index, axis=-1)

    @staticmethod
    def scatter(x, index, values):
        return mx.put_along_axis(x, index, values, axis=-1)

    @staticmethod
    def where(condition, x, y):
        return mx.where(condition, x, y)

    @staticmethod
    def kth_largest(x, k):
        return mx.sort(x, axis=-1)[..., -k][..., None]

    @staticmethod
    def sort_descending(x):
        order = mx.argsort(-x, axis=-1)
        return mx.take_along_axis(x, order, axis=-1), order

    @staticmethod
    def softmax(x):
        return mx.softmax(x, axis=-1)

    @staticmethod
    def cumsum(x):
        return mx.cumsum(x, axis=-1)

    @staticmethod
    def max(x):
        return x.max(axis=-1, keepdims=True)

    @staticmethod
    def argmax(x):
        return mx.argmax(x, axis=-1)

    @staticmethod
    def size(x):
        return x.size

    @staticmethod
    def draw(logits, key):
        return mx.random.categorical(logits, axis=-1, key=key)

    @staticmethod
    def random(seed, greedy):
        return _Keys(seed, greedy).next

    @staticmethod
    def ids(ids):
        return mx.array(list(ids), dtype=mx.uint32)[None]

    @staticmethod
    def append(recent, token, window):
        return mx.concatenate([recent, token[None].astype(mx.uint32)], axis=1)[:, -window:]

    @staticmethod
    def tokens(x):
        return x.astype(mx.uint32)

    @staticmethod
    def concat(xs):
        return mx.concatenate(xs)

    @staticmethod
    def log_softmax(x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    @staticmethod
    def top(x, n):
        if n == 0:
            return mx.zeros((x.shape[0], 0), dtype=mx.int32), mx.zeros((x.shape[0], 0), dtype=mx.float32)
        top = mx.argpartition(-x, kth=n - 1, axis=-1)[:, :n]  # (1, n), unordered
        values = mx.take_along_axis(x, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)

    @staticmethod
    def host(x):
        return mx.array(x)

    @staticmethod
    def zeros(shape):
        return mx.zeros(shape, dtype=mx.float32)


class _Keys:
    """One sequence's random source: a fresh key per sampled token, split off a chain seeded once (a greedy
    draw takes none, so no lazy graph grows step after step)."""

    def __init__(self, seed: int | None, greedy: bool):
        self.key = mx.random.key(seed_or_random(seed))
        self.greedy = greedy

    def next(self) -> mx.array:
        if not self.greedy:
            self.key, sub = mx.random.split(self.key)
            return sub
        return self.key


def make_sampler(p: SamplingParams) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """``sampler(logits (B, V), recent (B, n), key) -> tokens (B,)``."""
    return sampling.make_sampler(MLXOps, p, MLXOps.draw)
