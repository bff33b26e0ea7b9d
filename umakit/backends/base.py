"""The small interface every backend implements.

umakit's decode loop, chat sessions, batching and measurements are written
once against these protocols; a backend only has to load weights, own a KV
cache and produce tokens.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from ..sampling import SamplingParams


@runtime_checkable
class KVCache(Protocol):
    """Per-sequence key/value cache of every layer."""

    @property
    def offset(self) -> int:
        """Tokens held (positions already processed)."""

    @property
    def nbytes(self) -> int:
        """Bytes the cache occupies now."""

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens; returns how many were dropped."""


@dataclass
class WeightInfo:
    """Where the model's bytes are, as loaded on the device."""

    total_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)  # embedding, attention, mlp, head, norms, other
    params: int = 0
    bytes_per_token: int = 0  # weight bytes one decode step reads (one embedding row, not the table)
    kv_bytes_per_token: float = 0.0  # cache bytes per cached token, all layers, K and V
    quantization: str = "none"  # e.g. "4-bit g32 (embeddings 8-bit)"
    streamed_bytes_per_token: int = 0  # of bytes_per_token, those copied host -> device per step (offload)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.params if self.params else 0.0


@runtime_checkable
class Engine(Protocol):
    name: str  # "mlx" | "torch"
    device: str  # "metal" | "cuda" | "cpu"
    dtype: str  # compute dtype, e.g. "float32"
    config: dict  # the checkpoint's config.json

    def make_cache(self, kv_bits: int | None = None) -> KVCache: ...

    def prefill(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Append ``tokens`` to ``cache`` (no sampling, no logits kept)."""

    def generate_tokens(
        self,
        prompt: Sequence[int],
        cache: KVCache,
        sampling: SamplingParams,
        seed: int | None = None,
        history: Sequence[int] = (),
    ) -> Iterator[int]:
        """Prefill ``prompt`` after what ``cache`` holds, then yield sampled tokens forever.

        The first token is yielded once prefill is done (time to first token).
        ``history`` is the text already in the cache, for the repetition penalty.
        """

    def logits(self, tokens: Sequence[int], cache: KVCache | None = None) -> np.ndarray:
        """Float32 logits (T, V) for ``tokens`` appended to ``cache`` (or alone)."""

    def weight_info(self) -> WeightInfo: ...

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        """Cache bytes per token (all layers, K and V) at the given KV quantization."""

    def wired(self) -> AbstractContextManager: ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory(self) -> int: ...
