"""The sampling distribution of one position, in numpy, for verifying speculated tokens.

Speculation needs the target's (and a draft's) whole distribution at each
position, not only a sampled token, and it must be the very distribution the
engines' samplers draw from: the same steps in the same order as
`umakit.generate.sampling` describes (repetition penalty, then greedy or temperature,
top-k, top-p, min-p). Every engine's `logits` returns float32 numpy, so one
implementation serves both; `tests/test_speculative.py` checks it against
the engines' samplers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from umakit.generate.sampling import SamplingParams


def penalized(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """logits (V,) with transformers' repetition penalty over the distinct ``recent`` ids."""
    if penalty == 1.0 or not len(recent):
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    picked = out[ids]
    out[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def probabilities(logits: np.ndarray, recent: Sequence[int], p: SamplingParams) -> np.ndarray:
    """The distribution (V,) float64 a sampler with settings ``p`` draws from (one-hot when greedy)."""
    logits = penalized(np.asarray(logits, dtype=np.float32), recent, p.repetition_penalty)
    if p.greedy:
        out = np.zeros(logits.shape[-1])
        out[int(np.argmax(logits))] = 1.0
        return out
    x = logits.astype(np.float64) / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    if p.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = _softmax(x[order])
        before = np.cumsum(probs) - probs  # mass strictly above each token
        drop = order[before >= p.top_p]
        x[drop] = -np.inf
    if p.min_p > 0:
        probs = _softmax(x)
        x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    return _softmax(x)


def greedy_token(logits: np.ndarray, recent: Sequence[int], p: SamplingParams) -> int:
    """The token a greedy sampler picks: argmax after the repetition penalty."""
    return int(np.argmax(penalized(np.asarray(logits, dtype=np.float32), recent, p.repetition_penalty)))


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs``."""
    return int(rng.choice(probs.shape[-1], p=probs / probs.sum()))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()
