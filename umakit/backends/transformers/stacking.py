"""Rows' transformers caches stacked into one batch cache (left-padded) and taken apart again, so a batch step is
one forward pass of all its rows (batch_decoder.py).

Row i of ``n`` real tokens in a batch of ``L`` sits at the right of the batch's positions: its first ``L - n`` are
padding, zero keys and values that the attention mask hides. An attention layer's keys and values (a sliding
window's last ones too) are left-padded to the batch's longest; a linear-attention layer's convolution and
recurrent states have no positions and are stacked as they are (a row with none yet gets zeros, a fresh state).
Only the layer kinds named here are stacked; a cache holding any other (an indexed or quantized layer, a hybrid
layer class) is not `stackable`, and its rows step one by one.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

KINDS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)
STATES = ("conv_states", "recurrent_states")
INITIALIZED = ("is_conv_states_initialized", "is_recurrent_states_initialized")  # one flag a state, as STATES
FLAGS = (*INITIALIZED, "has_previous_state", "conv_kernel_size")  # a linear-attention layer's per-state dicts


def stackable(cache) -> bool:
    """Whether every layer of the transformers cache ``cache`` is of a kind `stack` knows."""
    return type(cache) is DynamicCache and all(type(layer) in KINDS for layer in cache.layers) and not any(
        getattr(layer, "record_past", False) for layer in cache.layers)


def stack(caches: list, lengths: list[int]):
    """One cache of the rows ``caches`` (each holding ``lengths[i]`` tokens), the shorter ones left-padded."""
    out = copy.copy(caches[0])
    out.layers = [_stack_layer([c.layers[i] for c in caches], max(lengths)) for i in range(len(caches[0].layers))]
    return out


def _stack_layer(rows: list, longest: int):
    layer = copy.copy(rows[0])
    if isinstance(layer, LinearAttentionLayer):
        for name in STATES:
            setattr(layer, name, dict(getattr(layer, name)))
        for flag in FLAGS:
            setattr(layer, flag, dict(getattr(layer, flag)))
        for idx in range(layer.number_of_states):
            for name, flag in zip(STATES, INITIALIZED):
                got = [getattr(r, name)[idx] if getattr(r, flag)[idx] else None for r in rows]
                like = next((t for t in got if t is not None), None)
                if like is None:
                    continue
                getattr(layer, name)[idx] = torch.cat([t if t is not None else torch.zeros_like(like) for t in got])
                getattr(layer, flag)[idx] = True
                if layer.device is None:
                    layer.dtype, layer.device = like.dtype, like.device
            layer.has_previous_state[idx] = any(r.has_previous_state[idx] for r in rows)
            sizes = [r.conv_kernel_size[idx] for r in rows if r.conv_kernel_size[idx] is not None]
            layer.conv_kernel_size[idx] = sizes[0] if sizes else None
        layer.cumulative_length_linear = torch.tensor(longest, dtype=torch.long,
                                                      device=rows[0].cumulative_length_linear.device)
        return layer
    got = [(r.keys, r.values) if r.is_initialized else None for r in rows]
    like = next((kv for kv in got if kv is not None), None)
    if like is None:
        return layer  # no row has run this layer yet
    width = max(kv[0].shape[-2] for kv in got if kv is not None)

    def padded(t: torch.Tensor | None, like_t: torch.Tensor) -> torch.Tensor:
        if t is None:
            return like_t.new_zeros(1, like_t.shape[1], width, like_t.shape[-1])
        return F.pad(t, (0, 0, width - t.shape[-2], 0))

    layer.keys = torch.cat([padded(kv[0] if kv else None, like[0]) for kv in got])
    layer.values = torch.cat([padded(kv[1] if kv else None, like[1]) for kv in got])
    layer.is_initialized, layer.dtype, layer.device = True, like[0].dtype, like[0].device
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = longest
    return layer


def row(cache, i: int, n: int):
    """Row ``i``'s own cache, of ``n`` real tokens, copied out of the batch cache ``cache``."""
    out = copy.copy(cache)
    out.layers = [_row_layer(layer, i, n) for layer in cache.layers]
    return out


def _row_layer(layer, i: int, n: int):
    one = copy.copy(layer)
    if isinstance(layer, LinearAttentionLayer):
        for name in STATES:
            setattr(one, name, {k: (v[i:i + 1].clone() if v is not None else None)
                                for k, v in getattr(layer, name).items()})
        for flag in FLAGS:
            setattr(one, flag, dict(getattr(layer, flag)))
        one.cumulative_length_linear = torch.tensor(n, dtype=torch.long, device=layer.cumulative_length_linear.device)
        return one
    if not layer.is_initialized:
        return one
    width = layer.keys.shape[-2]
    real = min(n, width)
    one.keys = layer.keys[i:i + 1, :, width - real:, :].clone()
    one.values = layer.values[i:i + 1, :, width - real:, :].clone()
    if isinstance(layer, DynamicSlidingWindowLayer):
        one.cumulative_length = n
    return one


def select(cache, keep: list[int]) -> None:
    """Keep rows ``keep`` of the batch cache ``cache``, in that order, in place."""
    index = torch.tensor(keep, dtype=torch.long)
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            for name in STATES:
                states = getattr(layer, name)
                for k, v in states.items():
                    if v is not None:
                        states[k] = v.index_select(0, index.to(v.device))
        elif layer.is_initialized:
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            layer.values = layer.values.index_select(0, index.to(layer.values.device))


def mask(lengths: list[int], longest: int, device) -> torch.Tensor:
    """(B, longest + 1) attention mask of a step: each row's padding hidden, its tokens and the new one seen."""
    pos = torch.arange(longest + 1, device=device)
    starts = torch.tensor([longest - n for n in lengths], device=device)
    return (pos[None, :] >= starts[:, None]).long()
