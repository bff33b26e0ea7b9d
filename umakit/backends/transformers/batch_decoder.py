"""`umakit.backends.base.BatchDecoder` for `TransformersEngine`: a step is one forward pass of every row, their
caches stacked into one left-padded batch cache (stacking.py: attention layers, sliding windows, the recurrent
state of a hybrid model's linear-attention layers), and samples all rows at once (umakit's sampler: penalties,
log-probabilities, constraints). A row is prefilled in a cache of its own and joins the batch at its next step;
a cache of a kind stacking.py does not know steps its rows one by one, each its own forward pass. Batched, a
row's logits are its lone run's up to the rounding of a batch's matrix products."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from umakit.backends import common
from umakit.backends.base import BatchRow
from umakit.backends.transformers import stacking
from umakit.backends.transformers.cache import TransformersCache
from umakit.generate.sampling import recent_tokens
from umakit.hardware.local import cpu_kv_budget


class TransformersBatchDecoder:
    def __init__(self, engine):
        self._engine = engine
        self._ids: list[int] = []
        self._caches: list[TransformersCache | None] = []  # each row's own cache; None while stacked
        self._batch = None  # the rows' stacked transformers cache, while stacked
        self._lengths: list[int] = []  # tokens each row's cache holds
        self._rows: list[common.TokenSampler] = []
        self._next: list[int] = []  # the token each row feeds to its next step
        self._logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}

    @property
    def size(self) -> int:
        return len(self._ids)

    def add(self, rows: Sequence[BatchRow]) -> None:
        common.check_rows(rows, TransformersCache)
        self._unstack()
        for row in rows:
            cache = row.cache if row.cache is not None else self._engine.make_cache()
            self._engine.prefill(row.prompt[cache.offset:-1], cache)  # all but the last token, as generate does
            self._ids.append(row.id)
            self._caches.append(cache)
            self._lengths.append(cache.offset)
            self._rows.append(common.TokenSampler(self._engine._ops, row.sampling, row.seed,
                                                  recent_tokens(row.sampling, row.prompt), row.logprobs,
                                                  row.constraint))
            self._next.append(row.prompt[-1])

    def _stack(self) -> bool:
        """Stack the rows' caches, if not yet and if their kind allows; whether they are stacked."""
        if self._batch is None and len(self._ids) > 1 and all(stacking.stackable(c.hf) for c in self._caches):
            self._batch = stacking.stack([c.hf for c in self._caches], self._lengths)
            self._caches = [None] * len(self._ids)
        return self._batch is not None

    def _unstack(self) -> None:
        if self._batch is not None:
            self._caches = [TransformersCache(stacking.row(self._batch, i, n), n) for i, n in enumerate(self._lengths)]
            self._batch = None

    def step(self) -> list[tuple[int, int]]:
        self._logprobs = {}
        if not self._ids:
            return []
        engine = self._engine
        with torch.inference_mode():
            if self._stack():
                logits = self._batched()
            else:
                logits = torch.cat([engine.step_logits(t, c) for t, c in zip(self._next, self._caches)])
                self._lengths = [c.offset for c in self._caches]
            picked, figures = common.sample_rows(engine._ops, self._rows, logits)
            picked = picked.tolist()
            for row, token in zip(self._rows, picked):
                row.accept(token)
            self._logprobs = {rid: common.read_figures(f) for rid, f in zip(self._ids, figures) if f is not None}
        self._next = picked
        return list(zip(self._ids, picked))

    def _batched(self) -> torch.Tensor:
        """Logits (B, V) of every row's next token, in one forward pass over the stacked cache."""
        engine, device = self._engine, self._engine.torch_device
        longest = max(self._lengths)
        ids = torch.tensor(self._next, dtype=torch.long, device=device)[:, None]
        where = torch.tensor(self._lengths, dtype=torch.long, device=device)[:, None]
        out = engine.model(ids, **{engine._cache_arg: self._batch}, use_cache=True, position_ids=where,
                           attention_mask=stacking.mask(self._lengths, longest, device))
        self._lengths = [n + 1 for n in self._lengths]
        return out.logits[:, -1, :]

    def logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        return dict(self._logprobs)

    def export(self, row_id: int) -> TransformersCache:
        i = common.position(self._ids, row_id)
        if self._batch is not None:
            return TransformersCache(stacking.row(self._batch, i, self._lengths[i]), self._lengths[i])
        cache = self._caches[i]
        return cache.copy(cache.offset)

    def remove(self, ids: Iterable[int]) -> None:
        keep = common.kept(self._ids, ids)
        if keep is None:
            return
        if self._batch is not None and keep:
            stacking.select(self._batch, keep)
        elif not keep:
            self._batch = None
        self._ids, self._caches, self._lengths, self._rows, self._next = common.take(
            keep, self._ids, self._caches, self._lengths, self._rows, self._next)
        if self._batch is not None and (len(self._ids) < 2 or min(self._lengths) > 0 and
                                        max(self._lengths) < self._longest_stored()):
            self._unstack()  # a lone row, or padding no row needs any more: restacked at the next step

    def _longest_stored(self) -> int:
        """Positions the stacked cache's attention layers hold (the longest row's, or more after removals)."""
        return max((layer.keys.shape[-2] for layer in self._batch.layers
                    if type(layer) is stacking.DynamicLayer and layer.is_initialized), default=0)

    def kv_budget_bytes(self) -> int:
        if self._engine.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            return int(free * 0.9)
        return cpu_kv_budget()

    def context_tokens(self) -> int:
        return max(self._lengths, default=0)
