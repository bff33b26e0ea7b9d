"""Torch sampler: `SamplingParams` as a pure function of logits (see umakit.generate.sampling).

The same steps as the MLX sampler; the categorical draw is an exponential
race (argmax of p / E, E ~ Exp(1)), which needs no host synchronisation.
"""

from __future__ import annotations

from typing import Callable

import torch

from umakit.generate.sampling import SamplingParams

Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]


def apply_repetition_penalty(logits: torch.Tensor, recent: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (B, V); recent (B, n) token ids; transformers' rule."""
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    picked = logits.gather(-1, recent)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, recent, picked)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tempered logits with top-k, top-p and min-p applied (removed entries are -inf)."""
    logits = logits.float() / p.temperature
    neg_inf = float("-inf")
    if 0 < p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, neg_inf)
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        sorted_logits = sorted_logits.masked_fill(before >= p.top_p, neg_inf)
        logits = logits.scatter(-1, order, sorted_logits)
    if p.min_p > 0:
        probs = logits.softmax(dim=-1)
        threshold = p.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, neg_inf)
    return logits


def make_sampler(p: SamplingParams) -> Sampler:
    """``sampler(logits (B, V), recent (B, n) int64, generator) -> tokens (B,) int64``."""

    def sample(logits: torch.Tensor, recent: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        logits = apply_repetition_penalty(logits, recent, p.repetition_penalty)
        if p.greedy:
            return logits.argmax(dim=-1)
        logits = filter_logits(logits, p)
        race = torch.empty_like(logits).exponential_(generator=generator)
        return (logits.softmax(dim=-1) / race).argmax(dim=-1)

    return sample
