"""MLX batched decoder: many sequences advanced by one forward pass per step.

The rows share mlx-lm's batch caches (`BatchKVCache`, `BatchRotatingKVCache`
for sliding-window layers, `ArraysCache` for a hybrid model's recurrent and
convolution states): keys and values are left-padded to a common length and
each row keeps its own offset, so RoPE positions and the attention mask are
per row; a state has no positions, so a hybrid model's rows are prefilled one
by one and merged, never through padding. New rows are prefilled together in a cache of their own and
only then appended, so a prefill never writes into a running row's cache.
A row that brings its own cache (a stored prefix, or a prompt the caller
prefilled in chunks) is prefilled alone past it and merged in the same way;
`export` copies a row's positions back out into a single-sequence cache.
Each row samples with its own settings and its own random key chain, the
same chain `MLXEngine.generate_tokens` uses, so a seeded row reproduces a
seeded single-sequence run.

With prompt lookup (`Lookup`), each step is read on the host before the next: a greedy row feeds its token and
the proposals its own text gives (`RowLookup`), right-padded to the longest row's, and keeps those its argmax
confirms; what a row did not keep is rolled to the front of its keys and values as left padding, as mlx-lm
finishes a right-padded prefill (`BatchKVCache.finalize`). Unlike the torch engine's fused step, a row's
positions are computed together here, so its logits may differ in the last bits from one-token steps (a greedy
near-tie may break the other way), as in mlx-lm's own speculative decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import mlx.core as mx

from umakit.backends import common
from umakit.backends.base import PREFILL_CHUNK, BatchRow, Lookup
from umakit.backends.common import TokenSampler
from umakit.backends.mlx.cache import MLXCache
from umakit.backends.mlx.mlx_lm_import import import_mlx_lm
from umakit.backends.mlx.sampler import MLXOps
from umakit.errors import InvalidArgumentError, UnsupportedModelError
from umakit.generate.lookup import RowLookup
from umakit.generate.sampling import recent_tokens
from umakit.hardware import cpu_kv_budget, metal_working_set

_cache = import_mlx_lm("models.cache")
BatchKVCache, BatchRotatingKVCache = _cache.BatchKVCache, _cache.BatchRotatingKVCache
KVCache, RotatingKVCache, make_prompt_cache = _cache.KVCache, _cache.RotatingKVCache, _cache.make_prompt_cache
ArraysCache = _cache.ArraysCache  # a hybrid model's recurrent and convolution states: one batch array each

PAD_WASTE = 1.5  # prefill rows together while padded tokens stay under this factor of real ones
# Of the working set the weights leave free: the rest is for activations, logits and other
# apps (a KV cache grown to the whole working set under a wired limit panics, mlx-lm #883).
METAL_KV_FRACTION = 0.7
LOOKUP_POSITIONS = 32  # with prompt lookup, a step computes at most this many positions (rows x the widest feed)


def _batch_kind(layer, model_type: str) -> type:
    """The batch cache class standing in for one layer's single-sequence cache."""
    if type(layer) is KVCache:
        return BatchKVCache
    if type(layer) is RotatingKVCache and layer.keep == 0:
        return BatchRotatingKVCache
    if type(layer) is ArraysCache:  # its own batch form: arrays with a batch axis
        return ArraysCache
    raise UnsupportedModelError(
        f"batched decoding does not support {type(layer).__name__} cache layers (model_type {model_type}) yet"
    )


def _batch_layer(layer, left_padding: list[int], model_type: str):
    """An empty batch cache standing in for one layer's single-sequence cache."""
    kind = _batch_kind(layer, model_type)
    if kind is ArraysCache:
        return ArraysCache(len(layer.cache), left_padding)
    return kind(left_padding) if kind is BatchKVCache else kind(layer.max_size, left_padding)


def _prefill_groups(rows: Sequence[BatchRow]) -> list[list[BatchRow]]:
    """Rows sorted by length and cut where padding them together would waste compute."""
    groups: list[list[BatchRow]] = []
    for row in sorted(rows, key=lambda r: len(r.prompt)):
        group = groups[-1] if groups else None
        if group is not None:
            real = sum(len(r.prompt) for r in group) + len(row.prompt)
            if len(row.prompt) * (len(group) + 1) <= PAD_WASTE * real + len(group) + 1:
                group.append(row)
                continue
        groups.append([row])
    return groups


class MLXBatchDecoder:
    """`umakit.backends.base.BatchDecoder` for `MLXEngine`."""

    def __init__(self, engine, lookup: Lookup | None = None):
        self._engine = engine
        self._lookup = lookup
        self._model = engine.model
        self._model_type = engine.config.get("model_type", "?")
        self._device = mx.gpu if engine.device == "metal" else mx.cpu
        layers = make_prompt_cache(self._model)
        for layer in layers:  # refuse unsupported layers up front
            _batch_layer(layer, [0], self._model_type)
        # A recurrent state would take a left-padded prompt's padding in: such rows are prefilled one by one, each
        # in a cache of its own, and merged (as rows that bring their own cache are).
        self._alone = any(type(layer) is ArraysCache for layer in layers)
        kept = {type(layer).__name__ for layer in layers if type(layer) is not KVCache}
        if lookup is not None and kept:
            raise InvalidArgumentError(f"{lookup.flag} in a batch takes back a row's rejected positions, which this "
                                       f"model's {', '.join(sorted(kept))} layers cannot (model_type "
                                       f"{self._model_type}); leave out {lookup.flag}")
        self._logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}  # those of the last step's tokens
        self._reset()

    def _reset(self) -> None:
        self._cache: list | None = None  # one batch cache per layer; rows in self._ids order
        self._ids: list[int] = []
        self._rows: list[TokenSampler] = []
        self._next: mx.array | None = None  # (B,) the tokens the next forward pass reads
        self._ready: list[bool] = []  # whether _next[i] is a sampled token (not a prompt's last)
        self._figures: list[tuple | None] = []  # lazy log-probabilities of _next[i], for rows that asked
        self._lookups: list[RowLookup | None] = []  # a greedy row's proposals, where the decoder speculates

    @property
    def size(self) -> int:
        return len(self._ids)

    def add(self, rows: Sequence[BatchRow]) -> None:
        common.check_rows(rows, MLXCache)
        if self._alone:
            rows = [r if r.cache is not None else dataclasses.replace(r, cache=self._engine.make_cache()) for r in rows]
        fresh = [r for r in rows if r.cache is None]
        resumed = [r for r in rows if r.cache is not None]
        with mx.stream(self._device):
            for group in _prefill_groups(fresh):
                self._append(group, self._prefill(group))
            if resumed:
                self._append(resumed, self._resume(resumed))

    def _prefill(self, group: list[BatchRow]) -> list:
        """A fresh batch cache holding each row's prompt but its last token."""
        heads = [list(r.prompt[:-1]) for r in group]
        length = max(len(h) for h in heads)
        pads = [length - len(h) for h in heads]
        cache = [_batch_layer(c, pads, self._model_type) for c in make_prompt_cache(self._model)]
        if length:
            tokens = mx.array([[0] * p + h for p, h in zip(pads, heads)], dtype=mx.uint32)  # (b, L) left-padded
            chunk = max(PREFILL_CHUNK // len(group), 16)  # bounds attention memory per chunk
            for start in range(0, length, chunk):
                self._model(tokens[:, start:start + chunk], cache=cache)
                mx.eval([c.state for c in cache])
        return cache

    def _resume(self, rows: list[BatchRow]) -> list:
        """A batch cache of rows that bring their own: each prefilled alone past its prefix, then merged."""
        for r in rows:
            self._engine.prefill(r.prompt[r.cache.offset:-1], r.cache)
        per_layer = zip(*(r.cache.layers for r in rows))  # each: that layer's single caches, one per row
        cache = [_batch_kind(layers[0], self._model_type).merge(list(layers)) for layers in per_layer]
        mx.eval([c.state for c in cache])
        return cache

    def _append(self, group: list[BatchRow], cache: list) -> None:
        if self._cache is None:
            self._cache = cache
        else:
            for running, new in zip(self._cache, cache):
                running.extend(new)  # pads both sides to a common length; copies, never writes in place
        last = mx.array([r.prompt[-1] for r in group], dtype=mx.uint32)
        self._next = last if self._next is None else mx.concatenate([self._next, last])
        self._ids += [r.id for r in group]
        self._rows += [TokenSampler(MLXOps, r.sampling, r.seed, recent_tokens(r.sampling, r.prompt), r.logprobs,
                                    r.constraint) for r in group]
        self._ready += [False] * len(group)
        self._figures += [None] * len(group)
        self._lookups += [RowLookup(r.prompt, self._lookup.ngram, self._lookup.tokens,
                                    self._lookup.draft and self._lookup.draft())
                          if self._lookup is not None and s.plain and s.constraint is None and s.logprobs is None
                          else None for r, s in zip(group, self._rows[-len(group):])]

    mixes = False  # mlx-lm's layers attend as one part: a prompt slice gets a pass of its own

    def step(self, prefill=None) -> list[tuple[int, int]]:
        common.prefill_apart(self._engine, prefill)
        self._logprobs = {}
        if not self._ids:
            return []
        if self._lookup is not None:
            return self._lookup_step()
        with mx.stream(self._device):
            inputs, figures = self._next, self._figures
            report = [i for i, ready in enumerate(self._ready) if ready]
            tokens = None
            if common.constrained(self._rows):
                # A constraint's next mask depends on the token before: read it now (no step ahead).
                tokens = inputs.tolist()
                for i in report:
                    self._rows[i].accept(tokens[i])
            logits = self._model(inputs[:, None], cache=self._cache)[:, -1, :]  # (B, V)
            self._next, self._figures = common.sample_rows(MLXOps, self._rows, logits)
            # Queue step n+1 before reading step n: the device computes while
            # the caller detokenizes and checks stops.
            mx.async_eval(self._next, [f for f in self._figures if f is not None])
            if tokens is None:
                tokens = inputs.tolist() if report else []
            # The figures travel with the sampled token and are read when it is returned.
            self._logprobs = {self._ids[i]: common.read_figures(figures[i]) for i in report if figures[i] is not None}
        self._ready = [True] * len(self._ids)
        return [(self._ids[i], tokens[i]) for i in report]

    def _lookup_step(self) -> list[tuple[int, int]]:
        """A step read on the host before the next: every row's token, the speculating rows' proposals after it;
        a speculating row returns what it kept at once, the others their token one step later, as without."""
        with mx.stream(self._device):
            tokens = self._next.tolist()
            report = [i for i, ready in enumerate(self._ready) if ready]
            out = [(self._ids[i], tokens[i]) for i in report]
            for i in report:
                self._rows[i].accept(tokens[i])
                if self._lookups[i] is not None:  # its text grows without proposals too: what it may copy next
                    self._lookups[i].commit([tokens[i]], [])
            self._logprobs = {self._ids[i]: common.read_figures(self._figures[i])
                              for i in report if self._figures[i] is not None}
            room = LOOKUP_POSITIONS // len(self._ids) - 1
            plans = [lookup.propose(room) if lookup is not None else [] for lookup in self._lookups]
            width = 1 + max(len(p) for p in plans)
            feed = mx.array([[t, *p] + [0] * (width - 1 - len(p)) for t, p in zip(tokens, plans)], dtype=mx.uint32)
            logits = self._model(feed, cache=self._cache)  # (B, width, V)
            picked, self._figures = common.sample_rows(MLXOps, self._rows, logits[:, 0, :])
            picked = picked.tolist()
            best = mx.argmax(logits, axis=-1).tolist() if width > 1 else None
            drop = []
            for i, plan in enumerate(plans):
                emitted = [picked[i]]
                if self._lookups[i] is not None:
                    for j, proposed in enumerate(plan):
                        if emitted[-1] != proposed:
                            break
                        emitted.append(best[i][j + 1])
                    for token in emitted:
                        self._rows[i].accept(token)
                        out.append((self._ids[i], token))
                    self._lookups[i].commit(emitted, plan)
                self._ready[i] = self._lookups[i] is None  # a speculating row's last token is returned already
                drop.append(width - len(emitted))  # positions fed but not kept: its proposals' tail, its padding
                picked[i] = emitted[-1]
            if max(drop):
                for layer in self._cache:
                    layer.prepare(right_padding=drop)
                    layer.finalize()  # each row's tail rolled to its front, as left padding
            self._next = mx.array(picked, dtype=mx.uint32)
            mx.eval([c.state for c in self._cache], self._next)
        return out

    def logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        return dict(self._logprobs)

    def export(self, row_id: int) -> MLXCache:
        # This decoder has fed every token it returned: the copy holds prompt + returned
        # tokens (all but the prompt's last before the row's first step); but a row that
        # speculates (lookup) returns its last token before feeding it: all but that one.
        i = common.position(self._ids, row_id)
        with mx.stream(self._device):
            layers = [c.extract(i) for c in self._cache]
            mx.eval([c.state for c in layers])
        return MLXCache(layers)

    def remove(self, ids: Iterable[int]) -> None:
        keep = common.kept(self._ids, ids)
        if keep is None:
            return
        if not keep:
            self._reset()
            return
        with mx.stream(self._device):
            for c in self._cache:
                c.filter(keep)
            self._next = self._next[mx.array(keep)]
        self._ids, self._rows, self._ready, self._figures, self._lookups = common.take(
            keep, self._ids, self._rows, self._ready, self._figures, self._lookups)

    def kv_budget_bytes(self) -> int:
        if self._engine.device == "metal":
            free = metal_working_set() - self._engine.weight_info().total_bytes
            return max(int(free * METAL_KV_FRACTION), 0)
        return cpu_kv_budget()  # the weights are already resident

    def context_tokens(self) -> int:
        return max((c.size() for c in self._cache), default=0) if self._cache else 0
