"""Sampling: its settings (`SamplingParams`) and the sampler's rules, written once for every engine.

A sampler is a pure function ``(logits, recent tokens, random source) -> tokens``, made by `make_sampler`,
and these are its rules, in this order:

0. a logit bias (OpenAI's ``logit_bias``) added to the model's logits;
1. repetition penalty over the last `repetition_context` tokens (positive logits divided by the penalty,
   negative ones multiplied, as in transformers); then OpenAI's presence and frequency penalties over the
   tokens generated so far (`penalize_counts`: minus frequency x count, minus presence once a token came);
2. temperature 0 is greedy (argmax); otherwise the logits are divided by it;
3. top-k, then top-p (nucleus), then min-p filtering of the tempered distribution;
4. one categorical draw, from the engine's own random source.

They are written here over a small interface to an array library (`ArrayOps`): the torch engine's arrays
(backends/torch/sampler.py), MLX's (backends/mlx/sampler.py) and numpy's, in which speculative decoding
computes the very distribution a sampler draws from (speculative/distribution.py). Only the random draw
is each one's own. tests/unit/test_sampling.py runs one suite against all three.

This module imports the standard library and `umakit.core` only: `import umakit` reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

from umakit.core import validate

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.0
DEFAULT_REPETITION_PENALTY = 1.0
DEFAULT_REPETITION_CONTEXT = 64
DEFAULT_PRESENCE_PENALTY = 0.0
DEFAULT_FREQUENCY_PENALTY = 0.0
SAMPLING_FIELDS = tuple(validate.SAMPLING_RANGES)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K  # 0 disables
    min_p: float = DEFAULT_MIN_P  # 0 disables
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY  # 1 disables
    repetition_context: int = DEFAULT_REPETITION_CONTEXT
    presence_penalty: float = DEFAULT_PRESENCE_PENALTY  # 0 disables
    frequency_penalty: float = DEFAULT_FREQUENCY_PENALTY  # 0 disables
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is taken too

    def __post_init__(self):
        # Every way in (CLI flags, /set, batch lines, API keywords) builds one of these: the checks live here once.
        for name in (*SAMPLING_FIELDS, "logit_bias"):
            object.__setattr__(self, name, validate.sampling_field(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_tokens(self) -> bool:
        """Whether the presence or frequency penalty is on (the sampler then counts the tokens it draws)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def with_overrides(self, **kwargs) -> "SamplingParams":
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})


def seed_or_random(seed: int | None) -> int:
    """``seed`` (checked: a signed 64-bit integer) as a non-negative 64-bit integer (every backend's generator
    takes those, some refuse negative ones), or a fresh random one (63 bits) when it is None."""
    seed = validate.seed(seed)
    if seed is not None:
        return seed % 2**64
    return int.from_bytes(os.urandom(8), "little") >> 1  # 63 random bits (the secrets module takes 20 ms to import)


def sampling_params(base: SamplingParams | None = None, **overrides) -> SamplingParams:
    """``base`` (default `SamplingParams()`) with each override that is not None applied."""
    return (base or SamplingParams()).with_overrides(**overrides)


# -- the rules, once, over any array library --------------------------------------------------
class ArrayOps(Protocol):
    """What the rules need of an array library: logits are (..., V), every reduction is over the last axis."""

    neg_inf: Any  # -inf, as the library's where() takes it

    def floating(self, x): ...  # the logits in the dtype the filters compute in
    def gather(self, x, index): ...  # x's values at ``index`` along the last axis
    def scatter(self, x, index, values): ...  # a copy of x with ``values`` put at ``index`` along the last axis
    def where(self, condition, x, y): ...
    def kth_largest(self, x, k: int): ...  # (..., 1)
    def sort_descending(self, x): ...  # (values, order)
    def softmax(self, x): ...
    def cumsum(self, x): ...
    def max(self, x): ...  # (..., 1)
    def argmax(self, x): ...
    def size(self, x) -> int: ...


def bias_row(p: SamplingParams, width: int):
    """``p.logit_bias`` as a dense float32 numpy row (1, ``width``), or None without one."""
    if not p.logit_bias:
        return None
    import numpy as np  # this module imports the standard library only: `import umakit` reads it

    ids, values = zip(*p.logit_bias)
    validate.integer("a logit_bias token id", ids[-1], 0, width - 1)  # sorted: the last is the largest
    row = np.zeros((1, width), dtype=np.float32)
    row[0, list(ids)] = values
    return row


def penalize(ops: ArrayOps, logits, recent, penalty: float):
    """``logits`` with transformers' repetition penalty over the ``recent`` token ids (rule 1)."""
    if penalty == 1.0 or ops.size(recent) == 0:
        return logits
    picked = ops.gather(logits, recent)
    return ops.scatter(logits, recent, ops.where(picked > 0, picked / penalty, picked * penalty))


def penalize_counts(ops: ArrayOps, logits, counts, p: SamplingParams):
    """``logits`` less OpenAI's penalties, from ``counts`` (..., V): how often each token was generated so far."""
    return ops.floating(logits) - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def filtered(ops: ArrayOps, logits, p: SamplingParams):
    """Tempered logits with top-k, top-p and min-p applied, removed entries -inf (rules 2 and 3; not greedy)."""
    logits = ops.floating(logits) / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        logits = ops.where(logits < ops.kth_largest(logits, p.top_k), ops.neg_inf, logits)
    if p.top_p < 1.0:
        ordered, order = ops.sort_descending(logits)
        probs = ops.softmax(ordered)
        above = ops.cumsum(probs) - probs  # the mass strictly above each token
        logits = ops.scatter(logits, order, ops.where(above >= p.top_p, ops.neg_inf, ordered))
    if p.min_p > 0:
        probs = ops.softmax(logits)
        logits = ops.where(probs < p.min_p * ops.max(probs), ops.neg_inf, logits)
    return logits


def make_sampler(ops: ArrayOps, p: SamplingParams, draw: Callable) -> Callable:
    """``sampler(logits (B, V), recent (B, n) ids, random) -> tokens (B,)``: the rules, with ``draw(filtered
    logits, random)`` the engine's categorical draw (rule 4)."""

    def sample(logits, recent, random):
        logits = penalize(ops, logits, recent, p.repetition_penalty)
        if p.greedy:
            return ops.argmax(logits)
        return draw(filtered(ops, logits, p), random)

    return sample


def recent_tokens(sampling: SamplingParams, prompt, history=()) -> list[int]:
    """The ids the repetition penalty looks at before the first token: the last `repetition_context` of
    ``history`` (the text already in the cache) and ``prompt``; none without a penalty."""
    if sampling.repetition_penalty == 1.0:
        return []
    window = sampling.repetition_context
    return (list(history)[-window:] + list(prompt))[-window:]
