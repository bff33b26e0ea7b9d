"""Pipeline parallel on MLX: contiguous layers per rank, the hidden state passed on with send/recv.

mlx-lm's own ``pipeline(group)`` is used where the architecture has it (its
PipelineMixin); for the plain decoder stacks listed in `OWN_PIPELINE`, the
model's inner module is replaced by a `Stage` that runs this rank's layers the
same way. As in mlx-lm, the last rank runs the first layers and rank 0 the
last; the final hidden state is gathered to every rank, which computes the
head, so the token broadcast works as in tensor parallel. The layers of other
ranks are cut off before any weight is read: each rank reads only its own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from umakit.backends.mlx.mlx_lm_import import import_mlx_lm

# Decoder stacks whose inner module is embed -> one causal mask -> layers -> norm, every layer full attention.
OWN_PIPELINE = ("llama", "mistral", "qwen2", "qwen3")


def stage_split(layers: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s layers: an even split, the low ranks taking the extra ones, rank 0 the last."""
    base, extra = divmod(layers, size)
    split = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(split[rank + 1:])
    return start, start + split[rank]


def own_pipeline(model_type: str, model) -> bool:
    inner = getattr(model, "model", None)
    sliding = any(getattr(layer, "use_sliding", False) for layer in getattr(inner, "layers", ()))
    return model_type in OWN_PIPELINE and inner is not None and not sliding


class Stage(nn.Module):
    """The inner module of a decoder stack over layers [start, end) of it, passing on what it computes."""

    def __init__(self, inner: nn.Module, group, start: int, end: int):
        super().__init__()
        self.embed_tokens, self.norm = inner.embed_tokens, inner.norm
        self.layers = inner.layers[start:end]
        self.sliding_window = getattr(inner, "sliding_window", None)  # read by mlx-lm's make_cache
        self._group, self._rank, self._size = group, group.rank(), group.size()
        self._mask = import_mlx_lm("models.base").create_attention_mask

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)  # (B, T, H)
        cache = cache if cache is not None else [None] * len(self.layers)
        if self._rank < self._size - 1:
            h = mx.distributed.recv_like(h, self._rank + 1, group=self._group)  # the earlier layers' output
        mask = self._mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        if self._rank != 0:
            h = mx.distributed.send(h, self._rank - 1, group=self._group)
            if cache[-1] is not None:
                # A prefill evaluates only the cache: tie the send to it, or the next stage would wait forever.
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        # Rank 0 ran the last layers: its rows, first in the gather, are the model's output on every rank.
        h = mx.distributed.all_gather(h, group=self._group)[: h.shape[0]]
        return self.norm(h)


def pipeline(model, model_type: str, group) -> None:
    """Keep only this rank's layers of ``model`` (weights bound lazily, none read yet)."""
    inner = model.model
    if callable(getattr(inner, "pipeline", None)):  # mlx-lm's PipelineMixin
        inner.pipeline(group)
        return
    start, end = stage_split(len(inner.layers), group.size(), group.rank())
    model.model = Stage(inner, group, start, end)
