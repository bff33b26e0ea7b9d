"""Perplexity: how well a model predicts a text, the measure of quantization's cost.

Written against the engine interface only (``engine.logits`` and the KV
cache), so every backend is measured by the same code.

A model whose tokenizer adds a BOS expects one at the start of every sequence:
without it, a window that starts mid-text scores about twice its perplexity
(Gemma 3). `perplexity` therefore starts every window with the BOS when the
tokenizer adds one (``bos_per_window``), and says so in its result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from umakit.errors import InvalidArgumentError

DEFAULT_WINDOW = 512  # stride defaults to the window: non-overlapping windows
DEFAULT_CHUNK = 256  # tokens fed to the cache per step by kv_perplexity


@dataclass
class PerplexityResult:
    tokens: int  # tokens scored
    nll: float  # mean negative log-likelihood per scored token, in nats
    window: int
    stride: int
    seconds: float
    bos_per_window: bool = False  # every window began with the tokenizer's BOS (not only the first)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class CachePerplexityResult(PerplexityResult):
    """Perplexity with every token read back from the (possibly quantized) KV cache."""

    kv_bits: int | None = None  # None: the unquantized cache, in the compute dtype
    cache_bytes: int = 0  # what the cache held after the last token (includes allocation slack)
    cache_tokens: int = 0

    @property
    def cache_bytes_per_token(self) -> float:
        return self.cache_bytes / self.cache_tokens if self.cache_tokens else 0.0


def _tokens(model, text: str | Sequence[int], max_tokens: int | None, special: bool = True) -> list[int]:
    ids = model.tokenizer.encode(text, add_special_tokens=special) if isinstance(text, str) else text
    ids = [int(t) for t in ids]  # engines take plain ints (numpy ints are refused by mx.array)
    if max_tokens is not None:
        if max_tokens < 2:
            raise InvalidArgumentError(f"max_tokens must be at least 2, got {max_tokens}")
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InvalidArgumentError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    return ids


def nll_sum(logits: np.ndarray, targets: Sequence[int]) -> float:
    """Sum of ``-log softmax(logits[i])[targets[i]]`` over the rows, in float64."""
    rows = np.asarray(logits, dtype=np.float32)  # (n, V)
    top = rows.max(axis=1, keepdims=True)  # (n, 1): shift before exp so nothing overflows
    lse = np.log(np.exp(rows - top).sum(axis=1, dtype=np.float64)) + top[:, 0]  # (n,)
    picked = rows[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]  # (n,)
    return float((lse - picked).sum())


def windows(n: int, window: int, stride: int, prefix: int = 0) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each sliding window over ``n`` tokens.

    As in Hugging Face's perplexity guide: windows start every ``stride``
    tokens; a window scores only the tokens no earlier window scored, so with
    ``stride < window`` each scored token sees at least ``window - stride``
    tokens of context. A window's first token has no context inside it and is
    never scored, unless ``prefix`` tokens (a BOS) precede it: the window then
    spans ``window - prefix`` of the text's tokens and scores its first one too.
    """
    span = window - prefix
    if span < (1 if prefix else 2):
        raise InvalidArgumentError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= span:
        raise InvalidArgumentError(f"stride must be between 1 and the window ({span}"
                                   f"{' after the BOS' if prefix else ''}), got {stride}")
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + span, n)
        first = max(prev_end, begin + (0 if prefix else 1))
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return out


def perplexity(
    model,
    text: str | Sequence[int],
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    max_tokens: int | None = None,
    bos_per_window: bool | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` (a `umakit.Model`) on ``text`` (a string or token ids).

    Each window is a fresh forward pass of at most ``window`` tokens; see
    `windows` for which tokens are scored; ``stride`` defaults to the window.
    ``max_tokens`` truncates the text (the BOS not counted). ``bos_per_window``
    (default: whether the tokenizer adds a BOS) starts every window with the BOS;
    False puts it only before the first one, as the text is encoded.
    """
    bos = bos_token(model) if bos_per_window is not False else None
    if bos_per_window and bos is None:
        raise InvalidArgumentError("the tokenizer has no BOS token to start each window with")
    ids = _tokens(model, text, max_tokens, special=bos is None)
    if bos is not None and ids[0] == bos:
        ids = ids[1:]  # token ids encoded with their BOS: it goes before every window instead
    prefix = [] if bos is None else [bos]
    stride = window - len(prefix) if stride is None else stride
    limit = model.info.context_length
    if limit and window > limit:
        raise InvalidArgumentError(f"window {window} exceeds the model's context of {limit} tokens")
    t0 = time.perf_counter()
    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), window, stride, len(prefix)):
        logits = model.engine.logits(prefix + ids[begin:end])  # (len(prefix) + end - begin, V)
        # Row j predicts window token j + 1, i.e. text token begin + j + 1 - len(prefix).
        lo = first - begin - 1 + len(prefix)
        total += nll_sum(logits[lo : lo + end - first], ids[first:end])
        count += end - first
    return PerplexityResult(count, total / count, window, stride, time.perf_counter() - t0, bos is not None)


def bos_token(model) -> int | None:
    """The BOS id a sequence starts with when the model's tokenizer adds one, else None."""
    tok = model.tokenizer
    return tok.bos_id if tok.add_bos and tok.bos_id is not None else None


def kv_perplexity(
    model,
    text: str | Sequence[int],
    kv_bits: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    max_tokens: int | None = None,
    cache=None,
) -> CachePerplexityResult:
    """Perplexity with the whole text fed through one KV cache, ``chunk`` tokens a step.

    Every token attends to all earlier ones as stored in the cache, so a
    quantized cache (``kv_bits`` 8 or 4) changes the scores as it does in a
    long generation. The text must fit the model's context. Pass an empty
    ``cache`` (from ``model.make_cache(kv_bits)``) to keep it filled afterwards,
    e.g. to time decoding at that context.
    """
    ids = _tokens(model, text, max_tokens)
    limit = model.info.context_length
    if limit and len(ids) > limit:
        raise InvalidArgumentError(f"{len(ids)} tokens exceed the model's context of {limit}; pass max_tokens")
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be at least 1 token, got {chunk}")
    if cache is None:
        cache = model.make_cache(kv_bits)
    elif cache.offset:
        raise InvalidArgumentError(f"the cache already holds {cache.offset} tokens; pass an empty one")
    t0 = time.perf_counter()
    total, count = 0.0, 0
    for begin in range(0, len(ids), chunk):
        end = min(begin + chunk, len(ids))
        logits = model.engine.logits(ids[begin:end], cache)  # (end - begin, V), row j predicts begin + j + 1
        targets = ids[begin + 1 : end + 1]
        total += nll_sum(logits[: len(targets)], targets)
        count += len(targets)
    seconds = time.perf_counter() - t0
    return CachePerplexityResult(  # the "window" is the whole text, fed ``chunk`` tokens at a time
        count, total / count, window=len(ids), stride=chunk, seconds=seconds,
        kv_bits=kv_bits, cache_bytes=cache.nbytes, cache_tokens=cache.offset,
    )
