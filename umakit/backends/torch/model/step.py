"""What every layer of a forward call needs to know about its tokens: `Step`, and `Mixed` for a pass that carries
a batch's rows and a prompt's slice together (`Transformer.mixed`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from umakit.backends.torch import crossover


def attention_mask(positions: torch.Tensor, key_len: int, window: int | None) -> torch.Tensor:
    """Boolean (T, key_len) mask: query at position p sees keys 0..p (and only the last ``window``)."""
    keys = torch.arange(key_len, device=positions.device)[None, :]
    mask = keys <= positions[:, None]
    if window:
        mask &= keys > positions[:, None] - window
    return mask


def each_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
             attend) -> torch.Tensor | None:
    """Under `crossover.rows_alone`, rows of one query each (B > 1; a batch's decode step, --deterministic's prompt
    rows): ``attend(q, k, v, mask)`` a row at a time, each over exactly its own keys with the mask its lone step
    has (none where it masks nothing), since a masked tail of keys can move a row's bits. None elsewhere."""
    if q.shape[0] == 1 or q.shape[2] != 1 or mask is None or not crossover.alone():
        return None
    rows = []
    for b, n in enumerate((positions + 1).tolist()):
        m = mask[b:b + 1, ..., :n]
        lone = None if bool(m.all() if m.dtype == torch.bool else (m == 0).all()) else m
        rows.append(attend(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], lone))
    return torch.cat(rows)


class Step(NamedTuple):
    """What every layer needs to know about the tokens of one forward call."""

    cos: torch.Tensor  # (T, hd), or (B, 1, 1, hd) when each row has its own position
    sin: torch.Tensor  # (T, hd), sign folded in (see rope_cos_sin)
    positions: torch.Tensor  # (T,) int64, or (B,) one per row (`Transformer.decode_rows`)
    mask: torch.Tensor | None  # (T, S) bool, None when every cached key is visible; (B, 1, 1, S) per row
    static: int  # 0: attend to the filled cache; else to its first `static` slots under the mask (CUDA graphs)
    local: tuple | None = None  # (cos, sin, mask) of sliding layers where they differ from the others (gemma3)


class Mixed(NamedTuple):
    """A pass's tokens in two parts, each attending over a cache of its own: the first ``split`` are a batch's rows,
    one token each (``rows``, as `Transformer.decode_rows` steps them), the rest a prompt's consecutive tokens
    (``prompt``, as `Transformer.forward` prefills them). Every other part of a layer takes them all as rows of
    one call."""

    rows: Step
    prompt: Step
    split: int


class MixedCache(NamedTuple):
    """The caches of a `Mixed` pass's two parts: the batch's, and the prompt's own."""

    rows: object
    prompt: object
