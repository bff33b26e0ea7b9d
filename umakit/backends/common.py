"""What every engine does the same way, written once: about its weights, and about the sequences it samples.

Weights: pure functions over tensor names and shapes (no framework), so the
MLX and torch engines report the same categories, the same message for the
same broken checkpoint, and the same bytes per decode step (of a
mixture-of-experts model: its dense weights and the share of the routed
experts a token is sent to).

Sequences: a sequence's sampling state (`TokenSampler`: its sampler, random
source and recent tokens, for `Engine.generate_tokens` and each batch row), a
batch step's sampling and log-probabilities (`sample_rows`), and a batch
decoder's row bookkeeping (`check_rows`, `position`, `kept`), over each
engine's arrays (`EngineOps`: backends/torch/sampler.py, backends/mlx/sampler.py).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from umakit.core import affine
from umakit.errors import CheckpointError, InvalidArgumentError
from umakit.backends.base import BatchRow, TokenConstraint, WeightInfo
from umakit.generate.sampling import ArrayOps, SamplingParams, bias_row, make_sampler, penalize, penalize_counts


def category(name: str) -> str:
    """Which part of the model a tensor belongs to: embedding, head, norms, attention, mlp or other."""
    if "embed" in name or "wte" in name:
        return "embedding"
    if name.startswith("lm_head") or ".lm_head" in name or name.startswith("output."):
        return "head"
    if "norm" in name or name.endswith("ln_f.weight"):
        return "norms"
    if "attn" in name or "attention" in name:
        return "attention"
    if "mlp" in name or "feed_forward" in name or "experts" in name:
        return "mlp"
    return "other"


ROUTED_EXPERTS = ".switch_mlp."  # in a tensor's name: mlx-lm's (and the torch engine's) stacked routed experts


def is_routed_expert(name: str) -> bool:
    """Whether a tensor belongs to the routed experts (a shared expert or a dense MLP does not)."""
    return ROUTED_EXPERTS in name


def routed_share(config: dict) -> float:
    """Share of the routed experts' bytes one token reads: experts per token / experts (1.0: no experts)."""
    cfg = {**config, **(config.get("text_config") or {})}
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    per_token = int(cfg.get("num_experts_per_tok") or 0)
    return min(per_token / experts, 1.0) if experts > 1 and per_token else 1.0


def check_weights(expected: Mapping[str, Sequence[int]], given: Mapping[str, Sequence[int]],
                  source: Mapping[str, str] | None = None) -> None:
    """Name the first missing, unexpected or mis-shaped tensor before any data is read.

    ``expected`` and ``given`` map the model's tensor names to shapes;
    ``source`` maps a model name to the checkpoint's own name, for messages.
    """
    source = source or {}
    missing = [k for k in expected if k not in given]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    unexpected = [k for k in given if k not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {source.get(unexpected[0], unexpected[0])}{more} "
                              "for this model_type")
    for name, shape in given.items():
        if tuple(shape) != tuple(expected[name]):
            raise CheckpointError(f"tensor {source.get(name, name)} has shape {list(shape)} "
                                  f"but the config implies {list(expected[name])}")


def weight_info(by_category: dict[str, int], params: int, vocab_size: int, kv_bytes_per_token: float,
                quantization: dict | None, execution: str = "", streamed_bytes_per_token: int = 0,
                routed_bytes: int = 0, routed_read_share: float = 1.0) -> WeightInfo:
    """A `WeightInfo` from bytes by category; ``execution`` says how quantized layers run, if it matters.

    ``routed_bytes`` are the routed experts' (all of them, within ``by_category``); a decode token
    reads ``routed_read_share`` of them (`routed_share`), so ``bytes_per_token`` counts that much.
    """
    total = sum(by_category.values())
    embed = by_category.get("embedding", 0)
    tied = "head" not in by_category
    # A decode step reads one embedding row, but a tied head reads the whole table.
    per_token = total if tied else total - embed + embed // max(vocab_size, 1)
    per_token -= routed_bytes - round(routed_bytes * routed_read_share)
    described = affine.describe(quantization)
    if quantization and execution:
        described += f" ({execution})"
    return WeightInfo(
        total_bytes=total,
        by_category=by_category,
        params=params,
        bytes_per_token=per_token,
        kv_bytes_per_token=kv_bytes_per_token,
        quantization=described,
        streamed_bytes_per_token=streamed_bytes_per_token,
    )


def logical_params(shapes: Mapping[str, Sequence[int]], quantization: dict | None) -> int:
    """Weights a model has: a packed uint32 word holds 32/bits of them; scales and biases are not counted."""
    q = quantization or {}
    n = 0
    for name, shape in shapes.items():
        if name.endswith((".scales", ".biases")) or "rotary_emb" in name:
            continue
        count = 1
        for d in shape:
            count *= int(d)
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{module}.scales" in shapes:
            count = count * 32 // bits_of(module, q)
        n += count
    return n


def bits_of(module: str, quantization: dict) -> int:
    """Bits of a quantized module: its own override in the config block, else the block's."""
    override = quantization.get(module)
    return override["bits"] if isinstance(override, dict) else quantization.get("bits", 32)


def reset_process_peak_memory() -> None:
    """Reset the process's peak resident memory (Linux's VmHWM), where the system lets it; else nothing."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # some sandboxes forbid it
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


def process_peak_memory() -> int:
    """The process's peak resident memory, in bytes (a CPU engine's peak memory)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# -- sequences: sampling state and batch bookkeeping ------------------------------------------------
class EngineOps(ArrayOps, Protocol):
    """An engine's arrays as the sampler's rules (`ArrayOps`) and the code below use them."""

    def draw(self, logits, random): ...  # one categorical draw per row of filtered logits: rule 4
    def random(self, seed: int | None, greedy: bool) -> Callable[[], Any]: ...  # what each draw is given, next
    def ids(self, ids: Sequence[int]): ...  # (1, n) token ids
    def append(self, recent, token, window: int): ...  # (1, n) ids and a token (1,): the last ``window`` of both
    def tokens(self, x): ...  # sampled tokens in the engine's token dtype
    def concat(self, xs: list): ...  # along the first axis
    def log_softmax(self, x): ...
    def top(self, x, n: int): ...  # (ids, values) (1, n) of the n largest, descending
    def host(self, x: np.ndarray): ...  # a numpy array as the engine's array, on its device
    def zeros(self, shape: tuple[int, ...]): ...  # float32 zeros on the device


class TokenSampler:
    """One sequence's sampling state: its sampler, its random source and the recent tokens the repetition penalty
    reads. `Engine.generate_tokens` keeps one; a batch decoder keeps one a row, so a seeded row draws what a
    seeded single sequence draws."""

    def __init__(self, ops: EngineOps, sampling: SamplingParams, seed: int | None, recent: Sequence[int],
                 logprobs: int | None = None, constraint: TokenConstraint | None = None):
        """``recent``: `umakit.generate.sampling.recent_tokens` of the sequence; ``constraint``: a batch row's
        (`BatchRow.constraint`), which `sample_rows` applies and the decoder tells each token (`accept`)."""
        self.ops = ops
        self.constraint = constraint
        self.penalty, self.window = sampling.repetition_penalty, sampling.repetition_context
        self.sampling = sampling
        self.counts = None  # (1, V): how often each token was drawn, for the presence and frequency penalties
        self.plain = (sampling.greedy and self.penalty == 1.0 and not sampling.counts_tokens
                      and not sampling.logit_bias)  # a batched argmax serves it
        self.bias = None  # (1, V) on the device: `sampling.logit_bias`, made at the first draw
        self.logprobs = logprobs
        # The penalty is applied in `sample`, not in the sampler, so that log-probabilities see it.
        self._draw = make_sampler(ops, replace(sampling, repetition_penalty=1.0), ops.draw)
        self._random = ops.random(seed, sampling.greedy)
        self.recent = ops.ids(recent)  # `recent_tokens`: already the window, and empty without a penalty

    def sample(self, logits, agree: Callable = lambda token: token):
        """logits (1, V) -> (token (1,), the penalised logits it was drawn from (1, V)); ``agree`` turns the draw
        into the token fed next (a sharded engine's: rank 0's). Advances the random source and the window."""
        if self.sampling.logit_bias:
            if self.bias is None:
                self.bias = self.ops.host(bias_row(self.sampling, logits.shape[-1]))
            logits = self.ops.floating(logits) + self.bias
        logits = penalize(self.ops, logits, self.recent, self.penalty)
        if self.sampling.counts_tokens:
            if self.counts is None:
                self.counts = self.ops.zeros(tuple(logits.shape))
            logits = penalize_counts(self.ops, logits, self.counts, self.sampling)
        token = agree(self.ops.tokens(self._draw(logits, self.recent, self._random())))
        if self.penalty != 1.0:
            self.recent = self.ops.append(self.recent, token, self.window)
        if self.counts is not None:
            at = token[:, None]
            self.counts = self.ops.scatter(self.counts, at, self.ops.gather(self.counts, at) + 1)
        return token, logits

    def accept(self, token: int) -> None:
        """The token this row returned (its constraint, if any, moves past it)."""
        if self.constraint is not None:
            self.constraint.accept(token)


def constrained(rows: Sequence[TokenSampler]) -> bool:
    """Whether any row carries a constraint (a decoder then needs each token on the host before the next step)."""
    return any(r.constraint is not None for r in rows)


def masked(ops: EngineOps, rows: Sequence[TokenSampler], logits):
    """``logits`` (B, V) with -inf on every token a row's constraint does not allow next.

    A mask shorter than the logits (a vocabulary padded in the weights) allows none of the extra ids;
    a row without a constraint, or whose constraint is off (not started, or finished), keeps all.
    """
    masks = [None if r.constraint is None else r.constraint.allowed() for r in rows]
    if all(m is None for m in masks):
        return logits
    width = logits.shape[-1]
    keep = np.ones((len(rows), width), dtype=bool)
    for i, m in enumerate(masks):
        if m is not None:
            n = min(len(m), width)
            keep[i, :n] = m[:n]
            keep[i, n:] = False
    return ops.where(ops.host(keep), logits, ops.neg_inf)


def sample_rows(ops: EngineOps, rows: Sequence[TokenSampler], logits) -> tuple[Any, list]:
    """A batch step's tokens (B,) from its logits (B, V), each row by its own sampler after its constraint's
    mask (`masked`), and each row's log-probability figures (`figures`; None for a row that asked for none)."""
    logits = masked(ops, rows, logits)
    greedy = ops.tokens(ops.argmax(logits)) if any(r.plain for r in rows) else None
    own = {i: r.sample(logits[i:i + 1]) for i, r in enumerate(rows) if not r.plain}  # (token, drawn from)
    tokens = ops.concat([own[i][0] if i in own else greedy[i:i + 1] for i in range(len(rows))]) if own else greedy
    return tokens, [None if r.logprobs is None
                    else figures(ops, *(own[i] if i in own else (greedy[i:i + 1], logits[i:i + 1])), r.logprobs)
                    for i, r in enumerate(rows)]


def figures(ops: EngineOps, token, logits, n: int) -> tuple:
    """token (1,) and the logits (1, V) it was drawn from -> its log-probability (1,) and the n most likely,
    as ids and log-probabilities (1, n), descending: the model's distribution, as OpenAI reports it."""
    lp = ops.log_softmax(ops.floating(logits))  # (1, V)
    ids, values = ops.top(lp, min(n, lp.shape[-1]))
    return ops.gather(lp, token[:, None])[:, 0], ids, values


def read_figures(f: tuple) -> tuple[float, list[tuple[int, float]]]:
    """`figures` on the host: (logprob of the token, [(token, logprob)] of the n most likely)."""
    chosen, ids, values = f
    return chosen.item(), list(zip(ids[0].tolist(), values[0].tolist()))


def prefill_apart(engine, prefill: tuple[Sequence[int], Any] | None) -> None:
    """`BatchDecoder.step`'s prompt slice, for a decoder that does not mix it into its rows' pass: a pass of its own,
    before theirs."""
    if prefill is not None:
        engine.prefill(*prefill)


def check_prompt(prompt: Sequence[int]) -> None:
    """Refuse an empty prompt: a sequence continues from its last token."""
    if not prompt:
        raise InvalidArgumentError("the prompt is empty: there is nothing to continue from")


def check_rows(rows: Sequence[BatchRow], cache_type: type, kv_bits: int | None = None) -> None:
    """Refuse rows a decoder cannot take: an empty prompt, or a cache from another engine or of other bits than
    the decoder's ``kv_bits`` (`BatchRow` checks the rest)."""
    for row in rows:
        if not row.prompt:
            raise InvalidArgumentError("a prompt is empty: there is nothing to continue from")
        if row.cache is not None and row.cache.kv_bits != kv_bits:
            held = "a float cache" if row.cache.kv_bits is None else f"a {row.cache.kv_bits}-bit cache"
            want = "float caches" if kv_bits is None else f"{kv_bits}-bit caches"
            raise InvalidArgumentError(f"a batch row brings {held}; this batch holds {want}")
        if row.cache is not None and not isinstance(row.cache, cache_type):
            raise InvalidArgumentError("a batch row's cache must come from this engine's make_cache()")


def position(ids: Sequence[int], row_id: int) -> int:
    """Where row ``row_id`` is among a decoder's rows."""
    if row_id not in ids:
        raise InvalidArgumentError(f"no row {row_id} in the batch")
    return list(ids).index(row_id)


def kept(ids: Sequence[int], drop: Iterable[int]) -> list[int] | None:
    """The positions of the rows that stay once ``drop`` leaves, in order; None when no row leaves."""
    drop = set(drop)
    keep = [i for i, rid in enumerate(ids) if rid not in drop]
    return None if len(keep) == len(ids) else keep


def compacted(keep: Sequence[int]) -> list[int]:
    """``keep`` (`kept`'s positions, in order) rearranged so that as few rows as possible move: each row that
    stays keeps its slot when that slot is within the new size, and the rows beyond it fill the holes left by
    those that went. Slot i of the result holds the row from old position ``result[i]``."""
    n = len(keep)
    staying = set(keep)
    order = list(range(n))
    movers = [i for i in keep if i >= n]
    for slot in range(n):
        if slot not in staying:
            order[slot] = movers.pop()
    return order


def take(keep: Sequence[int], *columns: list) -> tuple[list, ...]:
    """Each of a decoder's per-row lists, cut to the rows at positions ``keep`` (`kept`), in that order."""
    return tuple([column[i] for i in keep] for column in columns)
