"""Batched generation: many prompts decoded together, one forward pass per step.

Continuous batching: up to ``batch_size`` prompts run at once; when one
finishes (EOS, a stop string or its max_tokens) its slot goes to the next
waiting prompt. The engine's `BatchDecoder` holds the caches and samples;
each row's text, stops, clocks and finish reason are a
`umakit.generate.stream.DecodeRow`, exactly as in the single-sequence loop; this
module owns the queue, the memory plan and the run's statistics.

    results = generate_batch(model, ["Hi", [{"role": "user", "content": "Yo"}],
                                     {"prompt": "Count", "max_tokens": 20, "temperature": 0}])
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

from umakit.backends.base import BatchRow, Lookup, refuse_options
from umakit.core import validate
from umakit.errors import InvalidArgumentError, UmakitError
from umakit.generate.constrain import Constraint, from_options
from umakit.generate.options import CONSTRAINTS, DEFAULT_BATCH_SIZE, LIMITS, MANY, SAMPLING, GenerationOptions, takes
from umakit.generate.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from umakit.generate.speculative import batch_lookup
from umakit.generate.stream import DecodeRow, GenerationResult

KV_BLOCK = 256  # batch caches grow in blocks of this many positions
SAMPLING_FIELDS = tuple(SamplingParams.__dataclass_fields__)
# what a batch item may set for itself: its prompt, and the options `check_item` takes but `sampling` (the object)
ITEM_KEYS = frozenset({"prompt", "messages", "system", *LIMITS, *SAMPLING_FIELDS, *CONSTRAINTS})


@dataclass(frozen=True)
class BatchRequest:
    """One prompt, encoded, with its own settings."""

    prompt: tuple[int, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # what the reply must match: each row gets its own matcher


@dataclass
class BatchStats:
    """The whole run's numbers; per-prompt numbers are in each result's stats."""

    items: int = 0
    batch_size: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # forward passes over the batch
    prefill_s: float = 0.0
    decode_s: float = 0.0
    elapsed_s: float = 0.0
    bytes_read: float = 0.0  # weights plus KV cache (padding included) read by the decode steps

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second of decoding, all rows together."""
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole run, prefills included."""
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def achieved_gbps(self) -> float:
        return self.bytes_read / self.decode_s / 1e9 if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "decode_tps": self.decode_tps, "tokens_per_s": self.tokens_per_s,
                "achieved_gbps": self.achieved_gbps}


@takes(*LIMITS, "system", *SAMPLING, *CONSTRAINTS)
def check_item(item, *, options: GenerationOptions) -> dict:
    """Check one prompt without a model: its shape and every setting, the options as defaults.

    Returns the resolved fields (prompt or messages, system, max_tokens, seed,
    stop, sampling, constraint); an item's own schema, regex, choices or grammar replaces
    the options' one. A bad item raises `InvalidArgumentError` before any model
    work, so the CLI can set it aside before loading.
    """
    if isinstance(item, str):
        fields = {"prompt": item}
    elif isinstance(item, (list, tuple)):
        fields = {"messages": list(item)}
    elif isinstance(item, dict):
        fields = dict(item)
    else:
        raise InvalidArgumentError(f"a prompt must be a string, a message list or a dict, got {type(item).__name__}")
    unknown = set(fields) - ITEM_KEYS
    if unknown:
        raise InvalidArgumentError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(ITEM_KEYS))}")
    if ("prompt" in fields) == ("messages" in fields):
        raise InvalidArgumentError("give exactly one of 'prompt' or 'messages'")
    o = options
    system = fields.get("system", o.system)
    max_tokens = fields.get("max_tokens", o.max_tokens)
    stop = validate.request(fields.get("prompt"), fields.get("messages"), system, max_tokens, fields.get("stop", o.stop))
    overrides = {k: validate.sampling_field(k, fields[k]) for k in SAMPLING_FIELDS if k in fields}
    own = {k: fields[k] for k in CONSTRAINTS if fields.get(k) is not None}
    constraint = from_options(**(own or options.pick(CONSTRAINTS)))
    return {
        "prompt": fields.get("prompt"), "messages": fields.get("messages"), "system": system,
        "max_tokens": max_tokens, "seed": validate.seed(fields.get("seed", o.seed)), "stop": stop,
        "sampling": o.sampling_params().with_overrides(**overrides), "constraint": constraint,
    }


@takes(*LIMITS, "system", "raw", *SAMPLING, *CONSTRAINTS)
def make_request(model, item, *, options: GenerationOptions) -> BatchRequest:
    """Encode one prompt: a string, a message list, or a dict with ``prompt`` or
    ``messages`` and optional per-item settings that override the options (`check_item`)."""
    if isinstance(item, BatchRequest):
        return item
    c = check_item(item, **options.pick((*LIMITS, "system", *SAMPLING, *CONSTRAINTS)))
    ids = model.encode(c["prompt"], c["messages"], c["system"], options.raw)
    if not ids:
        raise InvalidArgumentError("the prompt is empty: there is nothing to continue from")
    max_tokens = c["max_tokens"]
    limit = model.info.context_length
    if limit and len(ids) + max_tokens > limit:
        max_tokens = limit - len(ids)
        if max_tokens < 1:
            raise InvalidArgumentError(f"the prompt ({len(ids)} tokens) fills the model's context of {limit} tokens")
    return BatchRequest(tuple(ids), max_tokens, c["sampling"], c["seed"], c["stop"], c["constraint"])


def plan_batch_size(requests: Sequence[BatchRequest], requested: int, kv_bytes_per_token: float,
                    budget_bytes: int) -> tuple[int, str | None]:
    """The batch size the KV-cache budget allows, and a one-line note if it is below the request.

    A row of a padded batch cache is as long as the longest row, so each row
    is budgeted for the longest prompt plus its max_tokens.
    """
    if requested < 1:
        raise InvalidArgumentError(f"batch_size must be at least 1, got {requested}")
    size = max(min(requested, len(requests)), 1)
    if not requests or kv_bytes_per_token <= 0:
        return size, None
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    row_tokens = -(-longest // KV_BLOCK) * KV_BLOCK
    row_bytes = row_tokens * kv_bytes_per_token
    fits = int(max(budget_bytes, 0) // row_bytes)
    if fits >= size:
        return size, None
    need = f"each sequence may hold {row_tokens} tokens ({row_bytes / 2**20:.0f} MiB of KV cache)"
    have = f"{max(budget_bytes, 0) / 2**20:.0f} MiB is available for the cache"
    if fits < 1:
        raise InvalidArgumentError(f"not even one sequence fits: {need} and {have}; lower max_tokens or shorten the prompts")
    return fits, f"batch size lowered from {size} to {fits}: {need} and {have}"


class BatchStream:
    """Iterate to run the batch: ``(index, GenerationResult)`` pairs in the order they finish.

    ``index`` is the caller's index of the prompt (``indices[i]`` for
    ``requests[i]``; by default its position). ``batch_size`` and ``note``
    (set when the memory plan lowered the batch size) are known before
    iterating; ``stats`` fills in as it runs.
    """

    def __init__(self, model, requests: Sequence[BatchRequest], batch_size: int = DEFAULT_BATCH_SIZE,
                 indices: Sequence[int] | None = None, kv_bits: int | None = None, lookup: Lookup | None = None):
        self._model = model
        self.requests = list(requests)
        self.indices = list(range(len(self.requests))) if indices is None else list(indices)
        if len(self.indices) != len(self.requests):
            raise InvalidArgumentError(f"{len(self.indices)} indices for {len(self.requests)} requests")
        if any(r.constraint is not None for r in self.requests):
            refuse_options(model.engine.spec, constrain=True)
        self._decoder = model.engine.batch_decoder(kv_bits, lookup) if self.requests else None
        budget = self._decoder.kv_budget_bytes() if self._decoder else 0
        self._kv_per_token = model.engine.kv_bytes_per_token(kv_bits)  # of the cache the rows hold
        self.batch_size, self.note = plan_batch_size(self.requests, batch_size, self._kv_per_token, budget)
        self.stats = BatchStats(items=len(self.requests), batch_size=self.batch_size,
                                prompt_tokens=sum(len(r.prompt) for r in self.requests))
        self._started = False

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[tuple[int, GenerationResult]]:
        if self._started:
            raise InvalidArgumentError("a batch stream runs once; call stream_batch again")
        self._started = True
        return self._run()

    def _admit(self, rows: dict[int, DecodeRow], waiting: deque) -> None:
        """Fill the free slots from the queue; each row's clock starts before its prefill."""
        t = time.perf_counter()
        new = [waiting.popleft() for _ in range(min(self.batch_size - len(rows), len(waiting)))]
        r, tokenizer = self.requests, self._model.tokenizer
        rows.update((i, DecodeRow(tokenizer, r[i].max_tokens, r[i].stop, prompt_tokens=len(r[i].prompt), t_start=t))
                    for i in new)
        self._decoder.add([BatchRow(i, r[i].prompt, r[i].sampling, r[i].seed, constraint=None if r[i].constraint is None
                                    else r[i].constraint.matcher(tokenizer)) for i in new])
        self.stats.prefill_s += time.perf_counter() - t

    def _run(self) -> Iterator[tuple[int, GenerationResult]]:
        with self._model.engine.wired():  # held while the caller reads, as stream_tokens does
            yield from self._steps()

    def _steps(self) -> Iterator[tuple[int, GenerationResult]]:
        engine, stats, w = self._model.engine, self.stats, self._model.info.weights
        waiting = deque(range(len(self.requests)))
        rows: dict[int, DecodeRow] = {}
        engine.reset_peak_memory()
        t0 = time.perf_counter()
        try:
            while waiting or rows:
                if waiting and len(rows) < self.batch_size:
                    self._admit(rows, waiting)
                t = time.perf_counter()
                out = self._decoder.step()
                now = time.perf_counter()
                stats.decode_s += now - t
                stats.steps += 1
                stats.bytes_read += w.bytes_per_token + self._decoder.size * self._decoder.context_tokens() * self._kv_per_token
                finished = []
                for i, token in out:  # a speculating row's several, in order
                    if rows[i].finished:
                        continue
                    rows[i].feed(token, now)
                    if rows[i].finished:
                        finished.append(i)
                if finished:
                    self._decoder.remove(finished)
                for i in finished:
                    row = rows.pop(i)
                    row.close()
                    result = row.result(engine.peak_memory())
                    stats.generated_tokens += result.stats.generated_tokens
                    stats.elapsed_s = time.perf_counter() - t0
                    yield self.indices[i], result
        finally:
            if rows:  # stopped early (an error, or the caller closed the stream)
                self._decoder.remove(list(rows))
            stats.elapsed_s = time.perf_counter() - t0


@dataclass
class BatchRun:
    """What `generate_batch` returns: one result per prompt, in order, plus the run's numbers."""

    results: list[GenerationResult]
    batch_size: int
    note: str | None
    stats: BatchStats

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterator[GenerationResult]:
        return iter(self.results)

    def __getitem__(self, i):
        return self.results[i]


@takes(*MANY, "on_error")
def stream_batch(model, prompts: Sequence, *, options: GenerationOptions) -> BatchStream:
    """Prepare a batched run of ``prompts``; iterate it for ``(index, result)`` as each finishes.

    Each prompt is a string, a message list, a dict (``prompt`` or ``messages``
    plus any of max_tokens, stop, seed, system, the sampling fields and one of schema, regex,
    choices and grammar) or a
    `BatchRequest`; the options here are the defaults a dict's own settings
    override. Every prompt is encoded and checked before anything runs.
    A ``seed`` makes each row reproduce ``model.generate(..., seed=seed)``.
    """
    requests, indices = [], []
    for i, item in enumerate(prompts):
        try:
            requests.append(make_request(model, item, **options.pick((*LIMITS, "system", "raw", *SAMPLING,
                                                                      *CONSTRAINTS))))
        except UmakitError as e:
            if options.on_error is not None:
                options.on_error(i, e)
                continue
            if isinstance(e, InvalidArgumentError):
                raise InvalidArgumentError(f"prompt {i}: {e}") from e
            raise
        indices.append(i)
    lookup = batch_lookup(options.prompt_lookup, options.draft_tokens, options.ngram, options.draft, model)
    return BatchStream(model, requests, options.batch_size, indices, options.kv_bits, lookup)


@takes(*MANY)
def generate_batch(model, prompts: Sequence, *, options: GenerationOptions) -> BatchRun:
    """Generate a reply to every prompt; one `GenerationResult` per prompt, in order (a bad prompt raises).

    Prompts as `stream_batch` takes them. ``note`` on the result is set when
    the batch size had to be lowered to fit the KV cache in memory.
    """
    stream = stream_batch(model, prompts, **options.pick(MANY))
    results: list[GenerationResult | None] = [None] * len(stream)
    for i, result in stream:
        results[i] = result
    return BatchRun(results, stream.batch_size, stream.note, stream.stats)
