"""gemma4's experts as the torch model holds them (model/gemma4.py: stacked, mlx-lm's ``switch_mlp`` layout),
from the two layouts checkpoints use: transformers' (``experts.gate_up_proj`` (E, 2I, H), the gate's rows first,
and ``experts.down_proj`` (E, H, I)), split here as the checkpoint streams in; and mlx-lm's (``umakit quantize``'s
output: ``experts.switch_glu.{gate,up,down}_proj``, quantized or not), renamed by the loader (loader._sanitize).
"""

from __future__ import annotations

from typing import Iterator

import torch

from umakit.checkpoint.config import text_config
from umakit.core.gemma4_layers import GEMMA4

FUSED, DOWN = ".experts.gate_up_proj", ".experts.down_proj"


def _stacked(name: str, projection: str) -> str:
    return f"{name.rsplit('.', 1)[0]}.switch_mlp.{projection}.weight"


def layout(config: dict, shapes: dict) -> dict:
    """``shapes`` with a gemma4 checkpoint's fused experts named and shaped as the model's stacked projections."""
    if text_config(config).get("model_type") != GEMMA4:
        return shapes
    out = {}
    for name, shape in shapes.items():
        if name.endswith(FUSED):
            e, rows, cols = shape
            out[_stacked(name, "gate_proj")] = out[_stacked(name, "up_proj")] = (e, rows // 2, cols)
        elif name.endswith(DOWN):
            out[_stacked(name, "down_proj")] = tuple(shape)
        else:
            out[name] = tuple(shape)
    return out


def tensors(config: dict, source):
    """``source`` (``source(skip)`` yields (name, tensor) pairs) with a gemma4 checkpoint's fused experts split
    into the model's stacked projections."""
    if text_config(config).get("model_type") != GEMMA4:
        return source

    def stream(skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in source(skip):
            if name.endswith(FUSED):
                gate, up = t.chunk(2, dim=1)
                yield _stacked(name, "gate_proj"), gate.contiguous()
                yield _stacked(name, "up_proj"), up.contiguous()
            elif name.endswith(DOWN):
                yield _stacked(name, "down_proj"), t
            else:
                yield name, t

    return stream
