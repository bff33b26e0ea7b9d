"""The declared interface every engine implements, and nothing more.

umakit's decode loop, chat sessions, batching, measurements, quantization
pipeline and benchmarks are written once against these protocols: callers use
only what is declared here (no ``getattr``/``hasattr`` on an engine or cache,
no branching on an engine's name). A new engine (a sharded one, a speculative
decoder's) is one more implementation; `tests/test_engine_conformance.py` runs
the whole protocol on every registered engine and device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Mapping, Protocol, Sequence,
                    runtime_checkable)

from umakit.plan.placement import OffloadPlan
from umakit.generate.sampling import SamplingParams
from umakit.plan.shapes import PREFILL_CHUNK  # tokens per prefill chunk, every engine and plan: bounds attention memory

if TYPE_CHECKING:
    import numpy as np

__all__ = ["PREFILL_CHUNK", "MAX_LOGPROBS", "QUANTIZED_KV", "BATCH", "BATCH_KV_BITS", "CONSTRAIN", "QUANTIZE",
           "OFFLOAD", "EXPORT", "LOOKUP", "MIXED", "DETERMINISTIC", "FEATURES", "FEATURE_NAMES", "EngineSpec",
           "KVCache", "WeightInfo", "TokenConstraint", "BatchRow", "Lookup", "BatchDecoder", "Engine", "refuse_options"]

# Optional features an engine declares (its spec's ``features``):
QUANTIZED_KV = "kv_bits"  # a quantized KV cache (make_cache(kv_bits=4|8))
BATCH = "batch"  # batched decoding (batch_decoder())
BATCH_KV_BITS = "batch_kv_bits"  # batches of quantized caches (batch_decoder(kv_bits=4|8))
CONSTRAIN = "constrain"  # batch rows with a token mask (BatchRow.constraint: a schema, regex, grammar, tool call)
QUANTIZE = "quantize"  # quantize a float checkpoint on load (from_checkpoint(quantize=...))
OFFLOAD = "offload"  # stream layers from host memory (from_checkpoint(gpu_layers=..., vram_budget=...))
EXPORT = "export"  # hand its loaded weights back in checkpoint layout (export_weights())
LOOKUP = "batch_lookup"  # batch rows that speculate by prompt lookup (batch_decoder(lookup=Lookup(...)))
MIXED = "mixed_steps"  # a prompt slice in the rows' own forward pass (batch_decoder(mixed=True))
DETERMINISTIC = "deterministic"  # every token on its own decode step's arithmetic (make_deterministic())
FEATURES = (QUANTIZED_KV, BATCH, BATCH_KV_BITS, CONSTRAIN, QUANTIZE, OFFLOAD, EXPORT, LOOKUP, MIXED, DETERMINISTIC)
# How an error names a feature to the user: the flag or option that asks for it.
FEATURE_NAMES = {QUANTIZED_KV: "--kv-bits", BATCH: "batched decoding", BATCH_KV_BITS: "--kv-bits in a batch",
                 CONSTRAIN: "constrained decoding (a schema, regex, grammar or forced tool call)",
                 QUANTIZE: "--quantize", OFFLOAD: "--gpu-layers and --vram-budget", EXPORT: "exporting its weights",
                 LOOKUP: "--prompt-lookup or --draft in batch and serve", MIXED: "--mixed-steps",
                 DETERMINISTIC: "--deterministic"}

MAX_LOGPROBS = 20  # most alternatives a batch row may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class EngineSpec:
    """What the registry knows about an engine without importing it (importing torch costs seconds)."""

    name: str  # "mlx" | "torch"
    module: str  # where the engine class lives
    cls: str
    dependency: str  # the package it needs, e.g. "torch"
    extra: str  # the pip extra that installs it
    devices: tuple[str, ...]  # preferred first
    features: frozenset[str]
    # The model types (the language model's, `umakit.checkpoint.config.architecture`) it runs: a fixed list,
    # or, where empty, whatever ``finds_architecture`` finds without importing the engine.
    architectures: tuple[str, ...] = ()
    finds_architecture: Callable[[str], bool] | None = None
    architectures_source: str = ""  # for messages: what finds them ("mlx-lm has a model file for")
    # The RoPE scaling kinds (config.json's rope_type) it applies; empty: whatever the model's own code applies.
    rope_kinds: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()  # packages it needs beside ``dependency`` (the transformers engine: torch)
    # Whether a load on (device, dtype) reads a GGUF's Q6_K layers exactly, in groups of 16, and not their 8-bit
    # copies for MLX's groups: a first run's import then leaves those copies out (`Checkpoint.complete`)
    exact_groups: Callable[[str, str], bool] | None = None

    def runs(self, model_type: str | None) -> bool:
        """Whether the engine has code for ``model_type`` (None, not known yet: assume so)."""
        if model_type is None or model_type in self.architectures:
            return True
        return self.finds_architecture is not None and self.finds_architecture(model_type)

    def applies(self, rope_kind: str | None) -> bool:
        """Whether the engine applies RoPE scaling of ``rope_kind`` (None or "default": none to apply)."""
        return rope_kind in (None, "default") or not self.rope_kinds or rope_kind in self.rope_kinds

    def named_architectures(self) -> str:
        """The architectures it runs, for a message."""
        return ", ".join(self.architectures) if self.architectures else f"any {self.architectures_source}"


@runtime_checkable
class KVCache(Protocol):
    """Per-sequence key/value cache of every layer."""

    @property
    def offset(self) -> int:
        """Tokens held (positions already processed)."""

    @property
    def nbytes(self) -> int:
        """Bytes the cache occupies now."""

    @property
    def kv_bits(self) -> int | None:
        """Bits of a quantized cache; None when it holds the compute dtype."""

    @property
    def trimmable(self) -> bool:
        """Whether `trim` can always rewind it (False: e.g. sliding-window layers that overwrite old positions)."""

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens; returns how many were dropped."""

    def copy(self, n: int) -> "KVCache":
        """A new cache holding this one's first ``n`` tokens (a trimmable cache's; a shared prefix handed to
        another request while this one is kept)."""

    def mark(self) -> object:
        """What `rewind` needs to bring the cache back to its length now: the length alone where it is trimmable;
        else also the state trimming cannot give back (a recurrent layer's, a sliding window's), kept aside."""

    def rewind(self, mark: object) -> int:
        """Back to ``mark``, taken of this cache at this length or a shorter one of the same tokens; returns the
        tokens dropped."""


@dataclass
class WeightInfo:
    """Where the model's bytes are, as loaded on the device."""

    total_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)  # embedding, attention, mlp, head, norms, other
    params: int = 0
    # weight bytes one decode step reads: one embedding row, not the table; of MoE's routed experts, top-k's share
    bytes_per_token: int = 0
    kv_bytes_per_token: float = 0.0  # cache bytes per cached token, all layers, K and V
    quantization: str = "none"  # e.g. "4-bit g32 (embeddings 8-bit)"
    streamed_bytes_per_token: int = 0  # of bytes_per_token, those copied host -> device per step (offload)
    comm_s_per_token: float = 0.0  # a sharded run: seconds a decode step waits on collectives, measured at load

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.params if self.params else 0.0


@runtime_checkable
class TokenConstraint(Protocol):
    """What a batch row's next token may be (`umakit.generate.constrain.Matcher` is the one umakit makes)."""

    def allowed(self) -> np.ndarray | None:
        """A boolean mask over token ids, True where the token may come next (it may be shorter or longer than
        the logits: ids past it are not allowed, mask entries past the logits are ignored); None: any token."""

    def accept(self, token: int) -> None:
        """The token the row returned (drawn from the last mask); raises if it breaks the constraint."""


@dataclass(frozen=True)
class BatchRow:
    """One sequence to decode: a caller-chosen id, its prompt ids and its sampling.

    ``cache``: a single-sequence cache from the same engine's ``make_cache()``
    (with the decoder's ``kv_bits``) that already holds the first ``cache.offset`` tokens of
    ``prompt``, 0 <= offset < len(prompt): a stored cache of an earlier request
    sharing a prefix, or one the caller prefilled chunk by chunk. The decoder
    takes it over (the caller must not use it again) and prefills only the rest.

    ``logprobs``: None asks for none; 0 for the chosen token's log-probability;
    n (<= `MAX_LOGPROBS`) also for the n most likely tokens (`BatchDecoder.logprobs`).

    ``constraint`` (feature ``constrain``): every token the row samples is drawn from the tokens it allows
    (-inf on the others, before the repetition penalty and temperature; the log-probabilities see the mask),
    and it is told each token the row returns, before the row's next token is drawn.
    """

    id: int
    prompt: Sequence[int]
    sampling: SamplingParams
    seed: int | None = None
    cache: KVCache | None = None
    logprobs: int | None = None
    constraint: TokenConstraint | None = None

    def __post_init__(self):
        from umakit.errors import InvalidArgumentError

        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgumentError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.cache is not None:
            if not 0 <= self.cache.offset < len(self.prompt):
                raise InvalidArgumentError(
                    f"a batch row's cache holds {self.cache.offset} tokens; it must hold fewer than its prompt's "
                    f"{len(self.prompt)}"
                )


@dataclass(frozen=True)
class Lookup:
    """Speculation for a batch's rows (feature ``lookup``): each step, a row whose every token is its logits'
    argmax (temperature 0, no penalties, no constraint, no log-probabilities asked) may feed up to ``tokens``
    proposals beside its token, and keeps those its logits confirm, so its tokens are what plain decoding gives;
    the others decode one token a step. The proposals are copied from the row's own text (what followed the last
    earlier occurrence of its last ``ngram`` tokens), or, with ``draft``, made by a smaller model: ``draft()``
    gives a row its own proposer (`umakit.generate.speculative.DraftModel`, with its own cache)."""

    ngram: int = 3
    tokens: int = 8
    draft: Callable[[], Any] | None = None

    @property
    def flag(self) -> str:
        """The command-line flag that asked for it, for an engine's refusal."""
        return "--draft" if self.draft is not None else "--prompt-lookup"


@runtime_checkable
class BatchDecoder(Protocol):
    """Rows join with `add`, advance together with `step`, and leave with `remove`.

    umakit's scheduler (`umakit.generate.batch`) owns the queue, the slots, detokenizing,
    stop strings and statistics; a decoder only holds the rows' KV caches and
    advances all of them with one forward pass per step.
    """

    @property
    def size(self) -> int:
        """Rows currently held."""

    def add(self, rows: Sequence[BatchRow]) -> None:
        """Prefill ``rows`` (after what each row's ``cache`` holds) without disturbing the rows already running.

        Their first sampled tokens come out of later `step` calls.
        """

    @property
    def mixes(self) -> bool:
        """Whether `step` puts a prompt slice into the rows' own forward pass (``batch_decoder(mixed=...)``)."""

    def step(self, prefill: tuple[Sequence[int], KVCache] | None = None) -> list[tuple[int, int]]:
        """Advance every row by one forward pass; returns ``(row id, token)`` pairs, a row's in order (several
        where it speculates, `Lookup`).

        ``prefill``: a waiting prompt's next tokens and its own cache (one `Engine.make_cache` made), which
        they are appended to as `Engine.prefill` appends them. Where the decoder `mixes`, they ride in the
        rows' forward pass (the weights read once for both; the rows then take that pass's arithmetic, so
        their last bits may differ from a lone step's); elsewhere they get a pass of their own first.

        A decoder may run one step ahead of what it returns (so the device
        computes step n+1 while the caller handles step n): rows added since
        the previous call may have no token yet, and a row removed after this
        call may already have been advanced once more, which is discarded.
        """

    def logprobs(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """Log-probabilities of the tokens the last `step` returned, for the rows that asked.

        ``{row id: (logprob of the token, [(token, logprob)] of the n most likely, descending)}``.
        They are the log-softmax of the logits after the repetition penalty and
        before temperature, top-k, top-p and min-p: the model's distribution, as
        OpenAI reports it, whatever sampling then drew from it.
        """

    def export(self, row_id: int) -> KVCache:
        """A new single-sequence cache, as ``make_cache()`` makes, holding the row's positions now.

        They are the first ``cache.offset`` positions of the row's prompt followed
        by the tokens `step` has returned for it: ``len(prompt) + returned - 1``
        or ``len(prompt) + returned`` of them, depending on whether the decoder
        has fed its latest token yet. The copy shares nothing with the decoder;
        the caller may trim it (where ``cache.trimmable``: a sliding window past
        its size is not) and pass it back as a `BatchRow.cache`. Works on a row
        until it is removed.
        """

    def remove(self, ids: Iterable[int]) -> None:
        """Drop finished rows and free their cache."""

    def kv_budget_bytes(self) -> int:
        """Bytes the device can give the KV cache beside the weights."""

    def context_tokens(self) -> int:
        """Cache positions each row occupies now (padding included)."""


@runtime_checkable
class Engine(Protocol):
    """A loaded model on one device: its cache, its forward passes and its measurements."""

    spec: ClassVar[EngineSpec]
    name: ClassVar[str]  # spec.name
    features: ClassVar[frozenset[str]]  # spec.features
    device: str  # "metal" | "cuda" | "cpu"
    dtype: str  # compute dtype, e.g. "float32"
    config: dict  # the checkpoint's config.json (with its quantization block once quantized on load)
    quantization: dict | None  # the config.json quantization block of the weights as loaded
    offload: OffloadPlan | None  # the split when weights stream from host memory; its `counters` count the copies
    load_notes: tuple[str, ...]  # what a user should know about how the weights were loaded

    @classmethod
    def from_checkpoint(
        cls,
        ckpt,  # umakit.checkpoint.files.Checkpoint
        *,
        device: str,
        dtype: str = "auto",
        progress: Callable[[int, int], None] | None = None,
        quantize: int | dict | None = None,
        gpu_layers: int | None = None,
        vram_budget: int | str | None = None,
    ) -> Engine:
        """Load ``ckpt``; options of features the engine lacks raise `InvalidArgumentError`. What ``ckpt`` leaves
        to be made on first use (a GGUF import's 8-bit copies of its Q6_K layers) is not there until
        ``ckpt.complete()``, which an engine calls before it reads those tensors."""

    @classmethod
    def synthetic(
        cls,
        config: dict,
        *,
        device: str,
        dtype: str = "auto",
        bits: int | None = None,
        group_size: int = 64,
        gpu_layers: int | None = None,
        vram_budget: int | str | None = None,
    ) -> Engine:
        """Random weights in a real architecture's exact shapes (benchmarks, tests)."""

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

    def batch_decoder(self, kv_bits: int | None = None, lookup: Lookup | None = None,
                      mixed: bool | None = None) -> BatchDecoder:
        """A fresh batched decoder over this engine (feature ``batch``); its rows' caches quantized to ``kv_bits``
        (4 or 8; feature ``batch_kv_bits``) as ``make_cache(kv_bits)`` makes them; its greedy rows speculating
        by ``lookup`` (feature ``batch_lookup``; `InvalidArgumentError` where it cannot now); a step's prompt
        slice in the rows' pass with ``mixed`` True (feature ``mixed_steps``; `InvalidArgumentError` where the
        model cannot), never with False, and where the engine finds it pays with None."""

    def make_deterministic(self) -> None:
        """From now on (feature ``deterministic``) every token this engine computes gets the bits of its own
        one-token decode step, whatever pass it rides in: a prompt's tokens however it is split (a prompt
        cache's prefix, slices, chunks), a batch's rows whatever rows run beside them, a verification's. So a
        greedy reply, and a seeded one, is the same wherever a prompt came from. `InvalidArgumentError` where
        this model or device cannot; afterwards, for what would leave it (``batch_decoder(mixed=True)``)."""

    def weight_info(self) -> WeightInfo: ...

    def kv_bytes_per_token(self, kv_bits: int | None = None) -> int:
        """Cache bytes per token (all layers, K and V) at the given KV quantization."""

    def export_weights(self) -> Mapping[str, Any]:
        """The weights as loaded, named and laid out as in a checkpoint (feature ``export``)."""

    def wired(self) -> AbstractContextManager: ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory(self) -> int: ...


def refuse_options(spec: EngineSpec, **options) -> None:
    """Raise for options given to an engine whose spec lacks their feature (None and False ask for none)."""
    from umakit.errors import InvalidArgumentError

    needs = {"quantize": QUANTIZE, "gpu_layers": OFFLOAD, "vram_budget": OFFLOAD, "batch_kv_bits": BATCH_KV_BITS,
             "constrain": CONSTRAIN, "lookup": LOOKUP, "mixed": MIXED, "deterministic": DETERMINISTIC}
    for key, value in options.items():
        if value is not None and value is not False and needs[key] not in spec.features:
            name = FEATURE_NAMES[needs[key]] if needs[key] in (BATCH_KV_BITS, CONSTRAIN, LOOKUP, MIXED,
                                                                DETERMINISTIC) else \
                key.replace("_", "-")
            raise InvalidArgumentError(f"the {spec.name} backend does not support {name}")
