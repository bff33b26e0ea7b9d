"""The sampling distribution of one position, in numpy, for verifying speculated tokens.

Speculation needs the target's (and a draft's) whole distribution at each
position, not only a sampled token, and it must be the very distribution the
engines' samplers draw from: the sampler's rules of `umakit.generate.sampling`,
here on numpy arrays (in float64). Every engine's `logits` returns float32
numpy, so one implementation serves them all; tests/unit/test_sampling.py runs
the samplers' shared suite on it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from umakit.generate import sampling
from umakit.generate.sampling import SamplingParams


class NumpyOps:
    """`umakit.generate.sampling.ArrayOps` for numpy arrays; the filters compute in float64."""

    neg_inf = -np.inf

    @staticmethod
    def floating(x):
        return np.asarray(x, dtype=np.float64)

    @staticmethod
    def gather(x, index):
        return np.take_along_axis(x, index, axis=-1)

    @staticmethod
    def scatter(x, index, values):
        out = x.copy()
        np.put_along_axis(out, index, values, axis=-1)
        return out

    @staticmethod
    def where(condition, x, y):
        return np.where(condition, x, y)

    @staticmethod
    def kth_largest(x, k):
        return np.partition(x, -k, axis=-1)[..., -k:][..., :1]

    @staticmethod
    def sort_descending(x):
        order = np.argsort(-x, axis=-1, kind="stable")
        return np.take_along_axis(x, order, axis=-1), order

    @staticmethod
    def softmax(x):
        e = np.exp(x - np.max(x, axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    @staticmethod
    def cumsum(x):
        return np.cumsum(x, axis=-1)

    @staticmethod
    def max(x):
        return np.max(x, axis=-1, keepdims=True)

    @staticmethod
    def argmax(x):
        return np.argmax(x, axis=-1)

    @staticmethod
    def size(x):
        return np.size(x)


def _ids(recent: Sequence[int]) -> np.ndarray:
    return np.asarray(recent, dtype=np.int64)


def probabilities(logits: np.ndarray, recent: Sequence[int], p: SamplingParams) -> np.ndarray:
    """The distribution (V,) float64 a sampler with settings ``p`` draws from (one-hot when greedy)."""
    logits = sampling.penalize(NumpyOps, np.asarray(logits, dtype=np.float32), _ids(recent), p.repetition_penalty)
    if p.greedy:
        out = np.zeros(logits.shape[-1])
        out[int(np.argmax(logits))] = 1.0
        return out
    return NumpyOps.softmax(sampling.filtered(NumpyOps, logits, p))


def greedy_token(logits: np.ndarray, recent: Sequence[int], p: SamplingParams) -> int:
    """The token a greedy sampler picks: argmax after the repetition penalty."""
    penalized = sampling.penalize(NumpyOps, np.asarray(logits, dtype=np.float32), _ids(recent), p.repetition_penalty)
    return int(np.argmax(penalized))


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs``."""
    return int(rng.choice(probs.shape[-1], p=probs / probs.sum()))
