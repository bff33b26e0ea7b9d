"""Sampling settings shared by every backend.

Each backend turns a `SamplingParams` into a pure function
``(logits, recent_tokens, key) -> token`` with its own array library; both
follow the order below, and one shared test suite checks that they agree:

1. repetition penalty over the last `repetition_context` tokens (positive
   logits divided by the penalty, negative ones multiplied, as in transformers);
2. temperature 0 is greedy (argmax), otherwise logits are divided by it;
3. top-k, then top-p (nucleus), then min-p filtering of the tempered
   distribution; then one categorical draw.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

from umakit.core import validate

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.0
DEFAULT_REPETITION_PENALTY = 1.0
DEFAULT_REPETITION_CONTEXT = 64
SAMPLING_FIELDS = tuple(validate.SAMPLING_RANGES)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K  # 0 disables
    min_p: float = DEFAULT_MIN_P  # 0 disables
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY  # 1 disables
    repetition_context: int = DEFAULT_REPETITION_CONTEXT

    def __post_init__(self):
        # Every way in (CLI flags, /set, batch lines, API keywords) builds one of these: the checks live here once.
        for name in SAMPLING_FIELDS:
            object.__setattr__(self, name, validate.sampling_field(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_overrides(self, **kwargs) -> "SamplingParams":
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})


def seed_or_random(seed: int | None) -> int:
    """``seed`` (checked: a signed 64-bit integer) as a non-negative 64-bit integer (every backend's generator
    takes those, some refuse negative ones), or a fresh random one (63 bits) when it is None."""
    seed = validate.seed(seed)
    return seed % 2**64 if seed is not None else secrets.randbits(63)


def sampling_params(base: SamplingParams | None = None, **overrides) -> SamplingParams:
    """``base`` (default `SamplingParams()`) with each override that is not None applied."""
    return (base or SamplingParams()).with_overrides(**overrides)
