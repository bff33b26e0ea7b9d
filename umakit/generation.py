"""The decode loop's upper layers: text streaming with stops and statistics.

Layering (as in mlx-lm): a backend's ``generate_tokens`` yields token ids;
`stream_generate` here turns them into text chunks, handles EOS, stop strings
and max tokens, and measures the run; `Model.generate` collects one result.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

from .backends.base import Engine, KVCache
from .sampling import SamplingParams
from .tokenizer import StreamingDetokenizer, Tokenizer

FINISH_STOP = "stop"  # an end-of-sequence token
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_STOP_STRING = "stop_string"  # a caller's stop string appeared (not emitted)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens prefilled by this call
    cached_tokens: int = 0  # tokens already in the cache and reused
    generated_tokens: int = 0
    ttft_s: float = 0.0  # time to first token: prefill plus one sample
    prefill_tps: float = 0.0
    decode_s: float = 0.0
    decode_tps: float = 0.0  # tokens after the first, per second
    peak_memory_bytes: int = 0
    # Roofline: what one decode step reads, against the device's peak bandwidth.
    bytes_per_token: float = 0.0
    ceiling_tps: float = 0.0
    achieved_gbps: float = 0.0
    peak_gbps: float = 0.0
    mbu: float = 0.0  # model bandwidth utilisation: achieved / peak
    device_name: str = ""
    bandwidth_source: str = ""
    # Offload (layers streamed from host memory each step); all zero when everything is resident.
    pcie_bytes_per_token: float = 0.0  # weight bytes copied host -> device per decode step
    pcie_gbps: float = 0.0  # achieved: those bytes x decode tok/s
    pcie_peak_gbps: float = 0.0  # the measured pinned host-to-device copy rate
    offload_ceiling_tps: float = 0.0  # 1 / (resident bytes / memory bw + streamed bytes / PCIe bw)
    overlap_efficiency: float = 0.0  # decode tok/s / offload ceiling: how well copies hide behind compute

    def to_dict(self) -> dict:
        return asdict(self)


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


class StopStringFilter:
    """Holds back text that could still become a stop string, so none is ever emitted."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


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
    roofline=None,
) -> Iterator[Chunk]:
    """Generate after ``prompt`` (appended to what ``cache`` holds), yielding text chunks.

    ``roofline(stats, context_tokens)`` fills the bandwidth fields of the stats.
    """
    stats = GenerationStats(prompt_tokens=len(prompt), cached_tokens=cache.offset)
    detok = StreamingDetokenizer(tokenizer)
    stops = StopStringFilter(stop)
    engine.reset_peak_memory()
    finish = FINISH_LENGTH
    t0 = time.perf_counter()
    t_first = t_last = t0
    tokens = engine.generate_tokens(prompt, cache, sampling, seed=seed, history=history)
    try:
        for n in range(max_tokens):
            token = next(tokens)
            t_last = time.perf_counter()
            if n == 0:
                t_first = t_last
            if token in tokenizer.eos_ids:
                finish = FINISH_STOP
                break
            stats.generated_tokens += 1
            text, hit = stops.feed(detok.add(token))
            if hit:
                finish = FINISH_STOP_STRING
                yield Chunk(text, token)
                break
            yield Chunk(text, token)
        if finish != FINISH_STOP_STRING:
            tail, hit = stops.feed(detok.flush())
            tail += "" if hit else stops.flush()
            finish = FINISH_STOP_STRING if hit else finish
            if tail:
                yield Chunk(tail, None)
    finally:
        tokens.close()
    stats.ttft_s = t_first - t0
    stats.prefill_tps = len(prompt) / stats.ttft_s if stats.ttft_s > 0 else 0.0
    stats.decode_s = t_last - t_first
    # Tokens timed after the first; an EOS that ended the run was decoded too.
    steps = stats.generated_tokens if finish == FINISH_STOP else max(stats.generated_tokens - 1, 0)
    stats.decode_tps = steps / stats.decode_s if stats.decode_s > 0 and steps else 0.0
    stats.peak_memory_bytes = engine.peak_memory()
    if roofline is not None and stats.decode_tps:
        roofline(stats, stats.cached_tokens + len(prompt) + stats.generated_tokens // 2)
    yield Chunk("", None, finish_reason=finish, stats=stats)


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
