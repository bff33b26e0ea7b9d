"""What --deterministic promises, checked on an engine: a prompt split anywhere gives one pass's bits, a prefill
writes what decode steps write, and a batch's rows are their lone runs."""

from __future__ import annotations

import itertools

import numpy as np

from umakit.backends.base import BatchRow
from umakit.generate.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def greedy(engine, ids: list[int], split: int = 0, n: int = 12, kv_bits: int | None = None) -> list[int]:
    cache = engine.make_cache(kv_bits)
    if split:
        engine.prefill(ids[:split], cache)
    return list(itertools.islice(engine.generate_tokens(ids[split:], cache, GREEDY), n))


def assert_exact(engine, ids: list[int], kv_bits: int | None = None, splits=(1, 3, 4, 9, 16)) -> None:
    """``ids`` (20 tokens or more) through ``engine``, made deterministic, every way: the next logits after the
    prompt split at each of ``splits`` are one pass's, bit for bit; logits of 12 tokens in one call are those of
    12 one-token calls; 7 batch rows (past the GEMM crossover where a test lowers it) are their lone runs."""
    def after(split: int) -> np.ndarray:
        cache = engine.make_cache(kv_bits)
        if split:
            engine.prefill(ids[:split], cache)
        engine.prefill(ids[split:-1], cache)
        return engine.logits(ids[-1:], cache)

    want = after(0)
    for split in splits:
        assert np.array_equal(after(split), want), f"split at {split}"
    stepped, together = engine.make_cache(kv_bits), engine.make_cache(kv_bits)
    steps = np.concatenate([engine.logits([t], stepped) for t in ids[:12]])
    assert np.array_equal(engine.logits(ids[:12], together), steps)
    prompts = [ids[:5 + 2 * i] for i in range(7)]
    decoder = engine.batch_decoder(kv_bits=kv_bits)
    assert not decoder.mixes
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    decoder.add([BatchRow(i, p, GREEDY) for i, p in enumerate(prompts[:4])])
    for step in range(10):
        if step == 3:  # rows that join mid-run
            decoder.add([BatchRow(i, p, GREEDY) for i, p in enumerate(prompts) if i >= 4])
        for rid, token in decoder.step():
            got[rid].append(token)
    for i, p in enumerate(prompts):
        assert got[i] == greedy(engine, p, 0, len(got[i]), kv_bits), f"row {i}"
