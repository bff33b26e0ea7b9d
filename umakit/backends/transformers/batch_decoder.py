"""`umakit.backends.base.BatchDecoder` for `TransformersEngine`: a step is one forward pass of every row, their
caches stacked into one left-padded batch cache (stacking.py: attention layers, sliding windows, the recurrent
state of a hybrid model's linear-attention layers), and samples all rows at once (umakit's sampler: penalties,
log-probabilities, constraints). A row is prefilled in a cache of its own and joins the batch at its next step;
a cache of a kind stacking.py does not know steps its rows one by one, each its own forward pass. Batched, a
row's logits are its lone run's up to the rounding of a batch's matrix products.

With a `Lookup` (prompt lookup or a draft model), a step where some greedy row has proposals runs every row on its
own cache, a speculating row's token and proposals in one forward pass; the row keeps what its argmax confirms and
its cache gives back the rest (full-attention caches only: the engine refuses the others)."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from umakit.backends import common
from umakit.backends.base import BatchRow, Lookup
from umakit.backends.transformers import stacking
from umakit.backends.transformers.cache import TransformersCache
from umakit.generate.lookup import RowLookup
from umakit.generate.sampling import recent_tokens
from umakit.hardware.local import cpu_kv_budget


class TransformersBatchDecoder:
    def __init__(self, engine, lookup: Lookup | None = None):
        self._engine = engine
        self._lookup = lookup
        self._lookups: list[RowLookup | None] = []  # a greedy row's proposals, where the decoder speculates
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
            sampler = common.TokenSampler(self._engine._ops, row.sampling, row.seed,
                                          recent_tokens(row.sampling, row.prompt), row.logprobs, row.constraint)
            self._rows.append(sampler)
            lookup = self._lookup
            speculates = lookup is not None and sampler.plain and row.constraint is None and row.logprobs is None
            self._lookups.append(RowLookup(row.prompt, lookup.ngram, lookup.tokens, lookup.draft and lookup.draft())
                                 if speculates else None)
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

    mixes = False  # transformers' layers attend as one part: a prompt slice gets a pass of its own

    def step(self, prefill=None) -> list[tuple[int, int]]:
        common.prefill_apart(self._engine, prefill)
        self._logprobs = {}
        if not self._ids:
            return []
        engine = self._engine
        plans = [r.propose(self._lookup.tokens) if r is not None else [] for r in self._lookups]
        if any(plans):
            return self._speculate(plans)
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
        for lookup, token in zip(self._lookups, picked):
            if lookup is not None:  # its text grows without proposals too: what it may copy next
                lookup.commit([token], [])
        return list(zip(self._ids, picked))

    def _speculate(self, plans: list[list[int]]) -> list[tuple[int, int]]:
        """One forward pass a row over its token and its proposals; a row keeps the proposals its own argmax
        confirms, then its pick after them, and its cache gives back the positions of the others."""
        self._unstack()
        engine, out = self._engine, []
        with torch.inference_mode():
            logits = [engine._forward(torch.tensor([t, *plan], device=engine.torch_device), cache)
                      for t, plan, cache in zip(self._next, plans, self._caches)]
            picked, figures = common.sample_rows(engine._ops, self._rows, torch.stack([x[0] for x in logits]))
            picked = picked.tolist()
            self._logprobs = {rid: common.read_figures(f) for rid, f in zip(self._ids, figures) if f is not None}
            best = [engine._ops.argmax(x[1:]).tolist() if len(x) > 1 else [] for x in logits]
        for i, plan in enumerate(plans):
            emitted = [picked[i]]
            for j, proposed in enumerate(plan):
                if emitted[-1] != proposed:
                    break
                emitted.append(best[i][j])
            self._caches[i].trim(len(plan) + 1 - len(emitted))  # the proposals' positions past the last confirmed
            for token in emitted:
                self._rows[i].accept(token)
                out.append((self._ids[i], token))
            if self._lookups[i] is not None:
                self._lookups[i].commit(emitted, plan)
            self._lengths[i] = self._caches[i].offset
            self._next[i] = emitted[-1]
        return out

    def _batched(self) -> torch.Tensor:
        """Logits (B, V) of every row's next token, in one forward pass over the stacked cache."""
        engine, device = self._engine, self._engine.torch_device
        longest = max(self._lengths)
        ids = torch.tensor(self._next, dtype=torch.long, device=device)[:, None]
        where = torch.tensor(self._lengths, dtype=torch.long, device=device)[:, None]
        out = engine.run(ids, **{engine._cache_arg: self._batch}, use_cache=True, position_ids=where,
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
        self._ids, self._caches, self._lengths, self._rows, self._next, self._lookups = common.take(
            keep, self._ids, self._caches, self._lengths, self._rows, self._next, self._lookups)
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
