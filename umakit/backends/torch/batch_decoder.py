"""Torch batched decoder: many sequences advanced by one forward pass per step.

All rows share one KV buffer per layer, (rows, nkv, S, hd), rows kept
contiguous in slots 0..B-1. Each row has its own length, so a decode step
gives every row its own RoPE position and key mask (`Transformer.decode_rows`)
and writes its new key and value at its own index. A new row is prefilled
alone through the engine's single-sequence path and its cache then copied
into a free slot, so a prefill never writes into a running row's cache (a
row that brings its own cache is prefilled past it the same way, and `export`
copies a row's slot back out into a single cache). Each
row samples with its own settings and its own `torch.Generator`, seeded and
drawn from as `TorchEngine.generate_tokens` does, so a seeded row reproduces
a seeded single-sequence run.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from umakit.backends import common
from umakit.backends.base import PREFILL_CHUNK, BatchRow, Lookup
from umakit.backends.common import TokenSampler
from umakit.backends.torch.cache import GROW_STEP, StaticKVCache
from umakit.backends.torch.quant_cache import QuantizedKVCache, check_kv_bits, dequantize, quantize
from umakit.backends.torch.ragged_cache import RaggedKVCache, kv_cache
from umakit.core.affine import KV_GROUP_SIZE
from umakit.errors import InvalidArgumentError
from umakit.generate.sampling import recent_tokens
from umakit.generate.lookup import RowLookup
from umakit.hardware import cpu_kv_budget

# Tokens a speculating step feeds at most, rows and proposals together: each costs the fused step a row's
# arithmetic, which past this many outweighs the weights' one read that proposals share (crossover.FUSED_ROWS).
LOOKUP_ROWS = 16


class BatchKVCache:
    """K and V for all layers, in buffers (L, rows, nkv, capacity, width) written at per-row positions: the float
    keys and values (``k``, ``v``), or with ``kv_bits`` their codes, scales and biases as a single
    `QuantizedKVCache` holds them (quant_cache.py), each row read back dequantized."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, kv_bits: int | None = None):
        if kv_bits is not None:
            check_kv_bits(kv_bits, head_dim)
        self.kv_bits = kv_bits
        self.shape = (layers, kv_heads, head_dim)
        self.max_tokens = max_tokens
        self.dtype, self.device = dtype, device
        self.buffers: list[torch.Tensor] = []
        self._allocate(0, 0, 0)

    def _planes(self) -> list[tuple[int, torch.dtype]]:
        """Width and dtype of each buffer: K's, then V's."""
        _, _, D = self.shape
        if self.kv_bits is None:
            return [(D, self.dtype)] * 2
        return [(D * self.kv_bits // 8, torch.uint8), (D // KV_GROUP_SIZE, self.dtype),
                (D // KV_GROUP_SIZE, self.dtype)] * 2

    def _allocate(self, rows: int, capacity: int, keep: int) -> None:
        """New buffers of ``rows`` x ``capacity``, keeping the first ``keep`` positions of the old rows."""
        L, H, _ = self.shape
        made = [torch.zeros(L, rows, H, capacity, width, dtype=dtype, device=self.device)
                for width, dtype in self._planes()]
        if self.buffers and keep:
            n = min(rows, self.rows)
            for new, old in zip(made, self.buffers, strict=True):
                new[:, :n, :, :keep] = old[:, :n, :, :keep]
        self.buffers = made
        self.layers = [tuple(b[i] for b in made) for i in range(L)]  # per-layer views, made once

    @property
    def k(self) -> torch.Tensor:
        return self.buffers[0]  # the float keys (the fused step's), or the keys' codes

    @property
    def v(self) -> torch.Tensor:
        return self.buffers[len(self.buffers) // 2]

    @property
    def rows(self) -> int:
        return self.buffers[0].shape[1]

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[3]

    def reserve(self, rows: int, tokens: int, used: int) -> None:
        """Room for ``rows`` rows of ``tokens`` positions; ``used`` positions hold data now."""
        if tokens > self.max_tokens:
            raise InvalidArgumentError(
                f"{tokens} tokens do not fit the model's context of {self.max_tokens}; shorten the prompt or reply"
            )
        if rows <= self.rows and tokens <= self.capacity:
            return
        capacity = max(self.capacity, min(-(-tokens // GROW_STEP) * GROW_STEP, self.max_tokens))
        self._allocate(max(rows, self.rows), capacity, used)

    def _single(self, single) -> list[torch.Tensor]:
        """A single-sequence cache's buffers, in this cache's order."""
        return [single.k, single.v] if self.kv_bits is None else [*single.k, *single.v]

    def put(self, slot: int, single) -> None:
        """Copy a single-sequence cache's filled positions into row ``slot``."""
        n = single.offset
        for mine, theirs in zip(self.buffers, self._single(single), strict=True):
            mine[:, slot, :, :n] = theirs[:, 0, :, :n]

    def get(self, slot: int, n: int, single) -> None:
        """Copy row ``slot``'s positions up to ``n`` into a single-sequence cache, after the ones it holds."""
        at = single.offset
        single.reserve(n - at)
        for mine, theirs in zip(self.buffers, self._single(single), strict=True):
            theirs[:, 0, :, at:n] = mine[:, slot, :, at:n]
        single.advance(n - at)

    def keep(self, slots: list[int], span: int) -> None:
        """Make slot i hold what slot ``slots[i]`` held (its first ``span`` positions), copying only the rows that
        move: `common.compacted` moves the fewest, each from beyond the new size into a hole before it."""
        for i, old in enumerate(slots):
            if old != i:
                for buf in self.buffers:
                    buf[:, i, :, :span] = buf[:, old, :, :span]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, span: int,
               slots: torch.Tensor | None = None):
        """Store k, v (B, nkv, 1, hd), row b at ``positions[b]`` of slot b (of ``slots[b]`` where given: several
        rows may be consecutive tokens of one slot); return each row's slot's first ``span`` positions."""
        B = k.shape[0]
        rows = torch.arange(B, device=k.device) if slots is None else slots
        held = slice(0, B) if slots is None else slots
        if self.kv_bits is None:
            kc, vc = self.layers[layer]
            kc[rows, :, positions] = k[:, :, 0]  # (B, nkv, hd) at (row b, position b)
            vc[rows, :, positions] = v[:, :, 0]
            return kc[held, :, :span], vc[held, :, :span]  # (B, nkv, S, hd)
        planes = self.layers[layer]
        out = []
        for kept, x in ((planes[:3], k), (planes[3:], v)):
            for plane, part in zip(kept, quantize(x, self.kv_bits), strict=True):
                plane[rows, :, positions] = part[:, :, 0]
            out.append(dequantize(*(plane[held, :, :span] for plane in kept), self.kv_bits, self.dtype))
        return tuple(out)

    def slotted(self, slots: list[int]) -> "_Slotted":
        """This cache as a model's eager step sees it when row b is a token of slot ``slots[b]``."""
        return _Slotted(self, torch.tensor(slots, dtype=torch.long, device=self.buffers[0].device))


class _Slotted:
    """`BatchKVCache.update` with each row's slot given (`BatchKVCache.slotted`)."""

    def __init__(self, cache: BatchKVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, span: int):
        return self.cache.update(layer, k, v, positions, span, self.slots)


class TorchBatchDecoder:
    """`umakit.backends.base.BatchDecoder` for `TorchEngine`."""

    def __init__(self, engine, kv_bits: int | None = None, lookup: Lookup | None = None, mixed: bool = False):
        self.mixes = mixed  # a step's prompt slice rides in the rows' pass (`Transformer.mixed`)
        self._lookup = lookup
        self._lookups: list[RowLookup | None] = []  # a greedy row's proposals, where the decoder speculates
        self._engine = engine
        self._device = engine.torch_device
        self._kv_bits = kv_bits
        a = engine.args
        self._cache = kv_cache(a.kv_shapes, lambda layers, heads, size: BatchKVCache(
            layers, heads, size, a.max_position_embeddings, engine.cache_dtype, self._device, kv_bits))
        self._ids: list[int] = []  # row i lives in cache slot i
        self._rows: list[TokenSampler] = []
        self._lengths: list[int] = []  # positions each row has in the cache
        self._next: list[int] = []  # the token each row feeds to the next step
        self._logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}  # those of the last step's tokens

    @property
    def size(self) -> int:
        return len(self._ids)

    def add(self, rows: Sequence[BatchRow]) -> None:
        common.check_rows(rows, (StaticKVCache if self._kv_bits is None else QuantizedKVCache, RaggedKVCache),
                          self._kv_bits)
        used = max(self._lengths, default=0)
        longest = max([used] + [len(r.prompt) for r in rows])
        self._cache.reserve(len(self._ids) + len(rows), longest, used)  # one reallocation at most
        for row in rows:
            single = row.cache if row.cache is not None else self._engine.make_cache(self._kv_bits)
            # All but the last token, as generate_tokens does; a given cache holds a prefix already.
            self._engine.prefill(row.prompt[single.offset:-1], single)
            with torch.inference_mode():
                self._cache.put(len(self._ids), single)
            self._ids.append(row.id)
            sampler = TokenSampler(self._engine._ops, row.sampling, row.seed, recent_tokens(row.sampling, row.prompt),
                                   row.logprobs, row.constraint)
            self._rows.append(sampler)
            speculates = self._lookup is not None and sampler.plain and row.constraint is None and row.logprobs is None
            self._lookups.append(RowLookup(row.prompt, self._lookup.ngram, self._lookup.tokens,
                                           self._lookup.draft and self._lookup.draft()) if speculates else None)
            self._lengths.append(single.offset)
            self._next.append(row.prompt[-1])

    def step(self, prefill: tuple[Sequence[int], StaticKVCache | QuantizedKVCache] | None = None
             ) -> list[tuple[int, int]]:
        self._logprobs = {}
        plans = self._proposals() if self._lookup is not None and self._ids else []
        if prefill is not None and not (self.mixes and self._ids and not any(plans)
                                        and len(prefill[0]) <= PREFILL_CHUNK):
            common.prefill_apart(self._engine, prefill)
            prefill = None
        if not self._ids:
            return []
        if any(plans):
            return self._speculate(plans)
        span = max(self._lengths) + 1
        self._cache.reserve(len(self._ids), span, span - 1)
        with torch.inference_mode():
            tokens = torch.tensor(self._next, dtype=torch.long, device=self._device)[:, None]  # (B, 1)
            if prefill is not None:
                logits = self._engine._mixed_rows(tokens, self._lengths, self._cache, span, *prefill)
            else:
                logits = self._engine._decode_rows(tokens, self._lengths, self._cache, span)  # (B, V)
            picked, figures = common.sample_rows(self._engine._ops, self._rows, logits)
            picked = picked.tolist()  # the one wait for the device; the figures are ready after it
            for row, token in zip(self._rows, picked):
                row.accept(token)
            self._logprobs = {rid: common.read_figures(f) for rid, f in zip(self._ids, figures) if f is not None}
        self._lengths = [n + 1 for n in self._lengths]
        self._next = picked
        if self._lookup is not None:
            for lookup, token in zip(self._lookups, picked):
                if lookup is not None:  # its text grows without proposals too: what it may copy next
                    lookup.commit([token], [])
        return list(zip(self._ids, picked))

    def _proposals(self) -> list[list[int]]:
        """Each row's proposals this step, within LOOKUP_ROWS fed tokens and the model's context."""
        spare = LOOKUP_ROWS - len(self._ids)
        plans = []
        for lookup, n in zip(self._lookups, self._lengths):
            plan = lookup.propose(min(spare, self._cache.max_tokens - n - 1)) if lookup is not None and spare > 0 \
                else []
            spare -= len(plan)
            plans.append(plan)
        return plans

    def _speculate(self, plans: list[list[int]]) -> list[tuple[int, int]]:
        """One step over every row's token and its proposals; a row keeps the proposals its own argmax confirms,
        then its pick after them. On a CPU each position's logits are those of its own decode step (the fused
        step's rows, or the eager layers' under `crossover.rows_alone`); on CUDA a row's positions are rows of one
        forward pass, as a batch's rows are, so their last bits may differ from a lone step's."""
        feed, positions, slots, first = [], [], [], []
        for i, plan in enumerate(plans):
            first.append(len(feed))
            feed += [self._next[i], *plan]
            positions += range(self._lengths[i], self._lengths[i] + 1 + len(plan))
            slots += [i] * (1 + len(plan))
        self._cache.reserve(len(self._ids), max(positions) + 1, max(self._lengths))
        with torch.inference_mode():
            tokens = torch.tensor(feed, dtype=torch.long, device=self._device)[:, None]
            logits = self._engine._decode_rows(tokens, positions, self._cache, max(positions) + 1, slots)  # (fed, V)
            picked, figures = common.sample_rows(self._engine._ops, self._rows, logits[first])
            picked, best = picked.tolist(), self._engine._ops.argmax(logits).tolist()
            self._logprobs = {rid: common.read_figures(f) for rid, f in zip(self._ids, figures) if f is not None}
        out = []
        for i, plan in enumerate(plans):
            emitted = [picked[i]]
            for j, proposed in enumerate(plan):
                if emitted[-1] != proposed:
                    break
                emitted.append(best[first[i] + j + 1])
            for token in emitted:
                self._rows[i].accept(token)
                out.append((self._ids[i], token))
            if self._lookups[i] is not None:
                self._lookups[i].commit(emitted, plan)
            self._lengths[i] += len(emitted)
            self._next[i] = emitted[-1]
        return out

    def logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        return dict(self._logprobs)

    def export(self, row_id: int) -> StaticKVCache | QuantizedKVCache:
        # This decoder has not fed the latest token it returned: the copy holds prompt +
        # returned tokens but the last (all but the prompt's last before the row's first step).
        i = common.position(self._ids, row_id)
        single = self._engine.make_cache(self._kv_bits)
        with torch.inference_mode():
            self._cache.get(i, self._lengths[i], single)
        return single

    def remove(self, ids: Iterable[int]) -> None:
        keep = common.kept(self._ids, ids)
        if keep is None:
            return
        keep = common.compacted(keep)  # a finished row costs one row's copy, not the batch's
        if keep and keep != list(range(len(keep))):
            with torch.inference_mode():
                self._cache.keep(keep, max(self._lengths[i] for i in keep))
        self._ids, self._rows, self._lengths, self._next, self._lookups = common.take(
            keep, self._ids, self._rows, self._lengths, self._next, self._lookups)

    def kv_budget_bytes(self) -> int:
        if self._engine.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            return int(free * 0.9)  # the weights are already resident
        return cpu_kv_budget()

    def context_tokens(self) -> int:
        return max(self._lengths, default=0)

