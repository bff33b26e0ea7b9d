"""MLX sampler: `SamplingParams` as a pure function of logits (see umakit.generate.sampling)."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from umakit.generate.sampling import SamplingParams

Sampler = Callable[[mx.array, mx.array, mx.array], mx.array]


def apply_repetition_penalty(logits: mx.array, recent: mx.array, penalty: float) -> mx.array:
    """logits (B, V); recent (B, n) token ids; transformers' rule."""
    if penalty == 1.0 or recent.size == 0:
        return logits
    picked = mx.take_along_axis(logits, recent, axis=-1)
    picked = mx.where(picked > 0, picked / penalty, picked * penalty)
    return mx.put_along_axis(logits, recent, picked, axis=-1)


def filter_logits(logits: mx.array, p: SamplingParams) -> mx.array:
    """Tempered logits with top-k, top-p and min-p applied (removed entries are -inf)."""
    logits = logits.astype(mx.float32) / p.temperature
    neg_inf = mx.array(-float("inf"), dtype=logits.dtype)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -p.top_k][..., None]  # (B, 1)
        logits = mx.where(logits < kth, neg_inf, logits)
    if p.top_p < 1.0:
        order = mx.argsort(-logits, axis=-1)  # (B, V) descending
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        sorted_logits = mx.where(before >= p.top_p, neg_inf, sorted_logits)
        logits = mx.put_along_axis(logits, order, sorted_logits, axis=-1)
    if p.min_p > 0:
        probs = mx.softmax(logits, axis=-1)
        threshold = p.min_p * probs.max(axis=-1, keepdims=True)
        logits = mx.where(probs < threshold, neg_inf, logits)
    return logits


def make_sampler(p: SamplingParams) -> Sampler:
    """``sampler(logits (B, V), recent (B, n), key) -> tokens (B,)``."""

    def sample(logits: mx.array, recent: mx.array, key: mx.array) -> mx.array:
        logits = apply_repetition_penalty(logits, recent, p.repetition_penalty)
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(filter_logits(logits, p), axis=-1, key=key)

    return sample
