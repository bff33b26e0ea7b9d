"""What the HTTP layer and the scheduler exchange: requests in, events out.

The HTTP layer (app.py, generation.py) turns a request into a
`GenerationRequest` and hands it to the `Scheduler` (scheduler.py), which owns
the engine; the scheduler answers with `Event`s on the request's queue. Neither
side sees the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from umakit.backends.base import Lookup
from umakit.generate.sampling import SamplingParams


@dataclass
class GenerationRequest:
    """One completion to produce: prompt ids and settings, already validated."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the n most likely
    timeout_s: float | None = None  # the request fails with a timeout after this long in all
    id: str = ""  # for the log line
    constraint: object = None  # a `umakit.backends.base.TokenConstraint` every token is drawn under, or None
    cache_salt: str = ""  # requests reuse each other's KV caches only when their salts are equal
    prompt_logprobs: int | None = None  # score the prompt's tokens too: None no; else as ``logprobs`` (its top n)


@dataclass
class TokenEvent:
    """Text made safe to emit by one token (``text`` may be empty while a stop string could still form)."""

    text: str
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_s: float = 0.0
    decode_tps: float = 0.0  # this request's own tokens per second after the first
    achieved_gbps: float = 0.0  # bytes the engine read per second while this request decoded (all rows)
    peak_gbps: float = 0.0
    mbu: float = 0.0  # achieved / peak
    batch_rows: float = 0.0  # mean rows decoded together during this request


@dataclass
class FinalEvent:
    finish_reason: str  # "stop" | "length"
    usage: Usage
    text: str = ""  # any text held back until the end (emitted after the last TokenEvent)
    stop: str | None = None  # the stop string that ended it, if one did
    prompt_scores: list[TokenEvent] | None = None  # with prompt_logprobs: each prompt token after the first, scored


@dataclass
class ErrorEvent:
    message: str
    status: int = 500  # 500: the worker failed; 504: the request timed out
    code: str | None = None


Event = TokenEvent | FinalEvent | ErrorEvent


@dataclass
class SchedulerSettings:
    max_concurrency: int = 16  # rows decoded together at most
    max_queue: int = 64  # requests waiting beyond those; more get a 429
    prompt_cache_bytes: int = 512 << 20  # KV caches kept for reuse across requests
    prefill_chunk: int = 512  # prompt tokens prefilled in one go while no row is decoding
    # While rows decode, the prompt tokens prefilled between two of their steps: what bounds how long a running
    # row stalls behind arriving prompts (`umakit serve --step-tokens`). None: measured on the engine when the
    # worker starts (serve/budget.py says how).
    step_tokens: int | None = None
    request_timeout_s: float = 600.0
    kv_bits: int | None = None  # 4 or 8: every request's KV cache quantized (the engine's batch_kv_bits feature)
    lookup: Lookup | None = None  # greedy requests speculate by prompt lookup (the engine's batch_lookup feature)
    # A prompt slice in the decode step's own forward pass (the engine's mixed_steps feature): True, False, or None
    # for the engine's choice (`Engine.batch_decoder`; `umakit serve --mixed-steps/--separate-steps`).
    mixed_steps: bool | None = None
    extra: dict = field(default_factory=dict)
