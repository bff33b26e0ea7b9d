"""`umakit.backends.base.BatchDecoder` for `TransformersEngine`: each row keeps its own transformers cache, so
rows of every cache kind (attention, sliding windows, the recurrent state of a hybrid model) batch together, and
a step samples all rows at once (umakit's sampler: penalties, log-probabilities, constraints). Each row's next
token is its own forward pass, so a row's tokens are exactly its lone run's; the passes are not yet one padded
forward pass (the weights are read once a row, not once a step)."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from umakit.backends import common
from umakit.backends.base import BatchRow
from umakit.backends.transformers.cache import TransformersCache
from umakit.generate.sampling import recent_tokens
from umakit.hardware.local import cpu_kv_budget


class TransformersBatchDecoder:
    def __init__(self, engine):
        self._engine = engine
        self._ids: list[int] = []
        self._caches: list[TransformersCache] = []
        self._rows: list[common.TokenSampler] = []
        self._next: list[int] = []  # the token each row feeds to its next step
        self._logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}

    @property
    def size(self) -> int:
        return len(self._ids)

    def add(self, rows: Sequence[BatchRow]) -> None:
        common.check_rows(rows, TransformersCache)
        for row in rows:
            cache = row.cache if row.cache is not None else self._engine.make_cache()
            self._engine.prefill(row.prompt[cache.offset:-1], cache)  # all but the last token, as generate does
            self._ids.append(row.id)
            self._caches.append(cache)
            self._rows.append(common.TokenSampler(self._engine._ops, row.sampling, row.seed,
                                                  recent_tokens(row.sampling, row.prompt), row.logprobs,
                                                  row.constraint))
            self._next.append(row.prompt[-1])

    def step(self) -> list[tuple[int, int]]:
        self._logprobs = {}
        if not self._ids:
            return []
        engine = self._engine
        with torch.inference_mode():
            logits = torch.cat([engine.step_logits(token, cache) for token, cache in zip(self._next, self._caches)])
            picked, figures = common.sample_rows(engine._ops, self._rows, logits)
            picked = picked.tolist()
            for row, token in zip(self._rows, picked):
                row.accept(token)
            self._logprobs = {rid: common.read_figures(f) for rid, f in zip(self._ids, figures) if f is not None}
        self._next = picked
        return list(zip(self._ids, picked))

    def logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        return dict(self._logprobs)

    def export(self, row_id: int) -> TransformersCache:
        cache = self._caches[common.position(self._ids, row_id)]
        return cache.copy(cache.offset)

    def remove(self, ids: Iterable[int]) -> None:
        keep = common.kept(self._ids, ids)
        if keep is None:
            return
        self._ids, self._caches, self._rows, self._next = common.take(keep, self._ids, self._caches, self._rows,
                                                                      self._next)

    def kv_budget_bytes(self) -> int:
        if self._engine.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            return int(free * 0.9)
        return cpu_kv_budget()

    def context_tokens(self) -> int:
        return max((c.offset for c in self._caches), default=0)
