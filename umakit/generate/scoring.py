"""Each token of a text scored as the model predicted it: its log-probability and the most likely alternatives."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def token_scores(logits: np.ndarray, targets: Sequence[int], top: int = 0
                 ) -> list[tuple[float, list[tuple[int, float]]]]:
    """``logits`` (T, V), row j the model's prediction of ``targets[j]`` -> for each target, its log-probability
    and the ``top`` most likely tokens with theirs, descending (OpenAI's ``logprobs`` and ``top_logprobs``)."""
    x = np.asarray(logits[:len(targets)], dtype=np.float64)
    peak = x.max(axis=1, keepdims=True)
    lp = x - (peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))
    chosen = lp[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]
    if not top:
        return [(float(c), []) for c in chosen]
    top = min(top, lp.shape[1])
    best = np.argpartition(-lp, top - 1, axis=1)[:, :top]
    out = []
    for c, row, ids in zip(chosen, lp, best):
        ids = ids[np.argsort(-row[ids], kind="stable")]
        out.append((float(c), [(int(i), float(row[i])) for i in ids]))
    return out
