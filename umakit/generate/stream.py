"""The decode loop's upper layers: text streaming with stops and statistics.

Layering (as in mlx-lm): a backend's ``generate_tokens`` yields token ids;
`DecodeRow` turns one sequence's ids into text (EOS, stop strings, max tokens,
clocks, finish reason, stats); `stream_generate` drives one row from the
engine's token stream and `umakit.generate.batch` drives many from a batched decoder;
`Model.generate` collects one result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from umakit.backends.base import BatchRow, Engine, KVCache
from umakit.errors import InvalidArgumentError
from umakit.plan.placement import ROUTED_EXPERTS
from umakit.plan.roofline import OffloadStats, RooflineStats
from umakit.generate.sampling import SamplingParams
from umakit.checkpoint.tokenizer import StreamingDetokenizer, Tokenizer

if TYPE_CHECKING:
    from umakit.generate.speculative import SpeculativeStats

FINISH_STOP = "stop"  # an end-of-sequence token
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_STOP_STRING = "stop_string"  # a caller's stop string appeared (not emitted)


def _figure(value) -> float:
    """A measured figure, 0.0 where there is none (the flat JSON never holds null)."""
    return 0.0 if value is None else value


# The keys of `GenerationStats.to_dict`, in order.
STATS_KEYS = (
    "prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s", "prefill_tps", "decode_s", "decode_tps",
    "peak_memory_bytes", "bytes_per_token", "ceiling_tps", "achieved_gbps", "peak_gbps", "mbu", "device_name",
    "bandwidth_source", "pcie_bytes_per_token", "pcie_gbps", "pcie_peak_gbps", "offload_ceiling_tps",
    "overlap_efficiency",
)


@dataclass
class GenerationStats:
    """One generation's counts and clocks, with the bandwidth figures of its decode steps.

    ``roofline`` and ``offload`` are the run's `umakit.plan.roofline.measure_decode`
    (None when the run was not measured, or, for ``offload``, when every layer
    is resident); the flat read-only names below read them, 0.0 or "" where absent.
    """

    prompt_tokens: int = 0  # tokens prefilled by this call
    cached_tokens: int = 0  # tokens already in the cache and reused
    generated_tokens: int = 0
    ttft_s: float = 0.0  # time to first token: prefill plus one sample
    prefill_tps: float = 0.0
    decode_s: float = 0.0
    decode_tps: float = 0.0  # tokens after the first, per second
    peak_memory_bytes: int = 0
    roofline: RooflineStats | None = None  # what one decode step reads, against the device's peak bandwidth
    offload: OffloadStats | None = None  # layers streamed from host memory each step
    speculative: SpeculativeStats | None = None  # how speculation went, when the run speculated

    def fill(self, roofline: RooflineStats, offload: OffloadStats | None = None) -> None:
        """Attach the run's roofline and, when layers stream, its offload figures."""
        self.roofline, self.offload = roofline, offload

    # -- roofline figures ---------------------------------------------------------
    @property
    def bytes_per_token(self) -> float:
        """Bytes one decode step reads: the weights plus the KV cache at this context."""
        return self.roofline.bytes_per_token if self.roofline else 0.0

    @property
    def ceiling_tps(self) -> float:
        """Peak bandwidth / bytes per token."""
        return self.roofline.ceiling_tps if self.roofline else 0.0

    @property
    def achieved_gbps(self) -> float:
        """Bytes per token x decode tok/s."""
        return _figure(self.roofline.achieved_gbps) if self.roofline else 0.0

    @property
    def peak_gbps(self) -> float:
        return self.roofline.peak_gbps if self.roofline else 0.0

    @property
    def mbu(self) -> float:
        """Model bandwidth utilisation: achieved / peak."""
        return _figure(self.roofline.mbu) if self.roofline else 0.0

    @property
    def device_name(self) -> str:
        return self.roofline.device_name if self.roofline else ""

    @property
    def comm_s_per_token(self) -> float:
        """A sharded run: seconds each decode step waits on the link between ranks."""
        return self.roofline.comm_s_per_token if self.roofline else 0.0

    @property
    def comm_share(self) -> float:
        """A sharded run: the share of a decode step spent on the link."""
        return self.roofline.comm_share if self.roofline else 0.0

    @property
    def bandwidth_source(self) -> str:
        """Where the peak came from: "published", "measured" or "user"."""
        return self.roofline.bandwidth_source if self.roofline else ""

    # -- offload figures (all zero when everything is resident) -----------------------
    @property
    def pcie_bytes_per_token(self) -> float:
        """Weight bytes copied host -> device per decode step."""
        return self.offload.streamed_bytes if self.offload else 0.0

    @property
    def pcie_gbps(self) -> float:
        """Achieved: those bytes x decode tok/s."""
        return _figure(self.offload.achieved_pcie_gbps) if self.offload else 0.0

    @property
    def pcie_peak_gbps(self) -> float:
        """The measured pinned host-to-device copy rate."""
        return self.offload.pcie_gbps if self.offload else 0.0

    @property
    def offload_ceiling_tps(self) -> float:
        """1 / (resident bytes / memory bw + streamed bytes / PCIe bw)."""
        return self.offload.ceiling_tps if self.offload else 0.0

    @property
    def overlap_efficiency(self) -> float:
        """Decode tok/s / offload ceiling: how well copies hide behind compute."""
        return _figure(self.offload.efficiency) if self.offload else 0.0

    @property
    def expert_hit_rate(self) -> float:
        """Routed experts streamed: the share of those asked for that the device cache held (0.0: none kept)."""
        return _figure(self.offload.hit_rate) if self.offload else 0.0

    @property
    def over_roofline(self) -> float:
        """Decode tok/s as a multiple of the one-token roofline ceiling (above 1 only by speculating)."""
        return self.decode_tps / self.ceiling_tps if self.ceiling_tps else 0.0

    def to_dict(self) -> dict:
        """The flat JSON form: counts, clocks, then every roofline and offload figure
        (and, for a speculative run, its figures under "speculative")."""
        out = {name: getattr(self, name) for name in STATS_KEYS}
        if self.offload is not None and self.offload.placement == ROUTED_EXPERTS:
            out["expert_offload"] = {"streamed_bytes_per_token": self.pcie_bytes_per_token,
                                     "cache_hit_rate": self.offload.hit_rate}
        if self.comm_s_per_token:
            out["link"] = {"comm_s_per_token": self.comm_s_per_token, "share_of_step": self.comm_share}
        if self.speculative is not None:
            out["speculative"] = {**self.speculative.to_dict(), "over_one_token_roofline": self.over_roofline}
        return out


@dataclass
class Chunk:
    """One piece of streamed output; the last one carries the finish reason and stats."""

    text: str
    token: int | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH
    stats: GenerationStats = field(default_factory=GenerationStats)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def held_back(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers``: text to hold back, since the
    next piece may complete a marker there."""
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), hold, -1):
            if text.endswith(m[:k]):
                hold = k
                break
    return hold


class StopStringFilter:
    """Holds back text that could still become a stop string, so none is ever emitted."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string that was hit (the earliest in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(i, s) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            at, self.matched = min(hits, key=lambda h: h[0])
            return buf[:at], True
        hold = held_back(buf, self.stops)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class DecodeRow:
    """One sequence being decoded: sampled ids in, text out, until it finishes.

    `feed` takes each sampled token with the time it arrived and returns the
    text now safe to emit; `finished` turns true on EOS (not emitted), a stop
    string (not emitted) or ``max_tokens``. `close` flushes the text held back
    and settles the finish reason; `stats` gives the row's counts and clocks.
    The clock starts at ``t_start`` (before prefill), so the first token's
    time is the time to first token.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, stop: Sequence[str] = (), *,
                 prompt_tokens: int = 0, cached_tokens: int = 0, t_start: float | None = None):
        self.eos = tokenizer.eos_ids
        self.max_tokens = max_tokens
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        self.detok = StreamingDetokenizer(tokenizer)
        self.stops = StopStringFilter(stop)
        self.parts: list[str] = []
        self.tokens: list[int] = []  # generated, EOS excluded
        self.drawn = 0  # sampled, EOS included
        self.finish: str | None = None if max_tokens > 0 else FINISH_LENGTH
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.t_first = self.t_last = self.t_start

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def feed(self, token: int, now: float) -> str:
        """Take one sampled token; returns the text it makes safe to emit."""
        self.drawn += 1
        if self.drawn == 1:
            self.t_first = now
        self.t_last = now
        if token in self.eos:
            self.finish = FINISH_STOP
            return ""
        self.tokens.append(token)
        text, hit = self.stops.feed(self.detok.add(token))
        self.parts.append(text)
        if hit:
            self.finish = FINISH_STOP_STRING
        elif self.drawn >= self.max_tokens:
            self.finish = FINISH_LENGTH
        return text

    def close(self) -> str:
        """The text still held back (a stop string found in it is cut, and becomes the finish reason)."""
        if self.finish == FINISH_STOP_STRING:
            return ""
        tail, hit = self.stops.feed(self.detok.flush())
        if hit:
            self.finish = FINISH_STOP_STRING
        else:
            tail += self.stops.flush()
        self.finish = self.finish or FINISH_LENGTH  # closed early: cut at the length it had
        self.parts.append(tail)
        return tail

    def stats(self, peak_memory_bytes: int = 0) -> GenerationStats:
        """Counts and clocks; decode tok/s counts the tokens timed after the first."""
        s = GenerationStats(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                            generated_tokens=len(self.tokens), peak_memory_bytes=peak_memory_bytes)
        s.ttft_s = self.t_first - self.t_start
        s.prefill_tps = self.prompt_tokens / s.ttft_s if s.ttft_s > 0 else 0.0
        s.decode_s = self.t_last - self.t_first
        # An EOS that ended the run was decoded (and timed) too.
        steps = s.generated_tokens if self.finish == FINISH_STOP else max(s.generated_tokens - 1, 0)
        s.decode_tps = steps / s.decode_s if s.decode_s > 0 and steps else 0.0
        return s

    def result(self, peak_memory_bytes: int = 0) -> GenerationResult:
        """The finished row as one result (call after `close`)."""
        return GenerationResult(self.text, self.tokens, self.finish, self.stats(peak_memory_bytes))


def stream_generate(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    cache: KVCache,
    sampling: SamplingParams,
    max_tokens: int,
    stop: Sequence[str] = (),
    seed: int | None = None,
    history: Sequence[int] = (),
    measure=None,
    speculator=None,
    constraint=None,
) -> Iterator[Chunk]:
    """Generate after ``prompt`` (appended to what ``cache`` holds), yielding text chunks.

    ``measure(decode_tps, context_tokens, streamed)`` returns the run's (RooflineStats,
    OffloadStats or None), see `umakit.plan.roofline.measure_decode`; ``streamed`` is what the
    engine's copy counters (`OffloadPlan.counters`) saw over the decode, or None. With a
    ``speculator`` (`umakit.generate.speculative.SpeculativeDecoder`) its tokens replace
    the engine's, and its stats join the run's. With a ``constraint`` (`umakit.backends.base.TokenConstraint`;
    ``cache`` empty) the row decodes through the engine's batch decoder, which applies it.
    """
    engine.reset_peak_memory()
    row = DecodeRow(tokenizer, max_tokens, stop, prompt_tokens=len(prompt), cached_tokens=cache.offset)
    if constraint is not None:
        tokens = constrained_tokens(engine, prompt, cache, sampling, seed, constraint)
    else:
        source = speculator if speculator is not None else engine
        tokens = source.generate_tokens(prompt, cache, sampling, seed=seed, history=history)
    counters = engine.offload.counters if engine.offload is not None else None
    first = None  # the copy counters once the first token is out: the decode steps' copies come after
    try:
        while not row.finished:
            token = next(tokens)
            text = row.feed(token, time.perf_counter())
            if counters is not None and row.drawn == 1:
                first = counters.snapshot()
            if row.finish != FINISH_STOP:
                yield Chunk(text, token)
        tail = row.close()
        if tail:
            yield Chunk(tail, None)
    finally:
        tokens.close()
    stats = row.stats(engine.peak_memory())
    if measure is not None and stats.decode_tps:
        streamed = counters.since(first, row.drawn - 1) if first is not None and row.drawn > 1 else None
        stats.fill(*measure(stats.decode_tps, stats.cached_tokens + len(prompt) + stats.generated_tokens // 2,
                            streamed))
    if speculator is not None:
        stats.speculative = speculator.stats
        speculator.stats.target_bytes_per_step = stats.bytes_per_token
    yield Chunk("", None, finish_reason=row.finish, stats=stats)


def constrained_tokens(engine: Engine, prompt: Sequence[int], cache: KVCache, sampling: SamplingParams,
                       seed: int | None, constraint) -> Iterator[int]:
    """``engine.generate_tokens`` for one sequence under a constraint: a batch of one row, whose decoder applies the
    mask (`BatchRow.constraint`). ``cache`` must be empty: the decoder keeps the row's cache for itself."""
    if cache.offset:
        raise InvalidArgumentError("a constrained reply starts from an empty cache")
    decoder = engine.batch_decoder(cache.kv_bits)
    decoder.add([BatchRow(0, list(prompt), sampling, seed, constraint=constraint)])
    try:
        while True:
            for _, token in decoder.step():
                yield token
    finally:
        decoder.remove([0])


def collect(chunks: Iterator[Chunk]) -> GenerationResult:
    """Join a chunk stream into one result."""
    parts, tokens = [], []
    for chunk in chunks:
        parts.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.finish_reason is not None:
            return GenerationResult("".join(parts), tokens, chunk.finish_reason, chunk.stats)
    raise RuntimeError("stream ended without a final chunk")  # internal invariant
