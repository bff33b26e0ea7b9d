"""gpt-oss's routed experts as transformers saves a float gpt-oss (bfloat16 conversions on the Hub are such), in
the layout mlx-lm's gpt_oss model loads.

transformers holds them fused and transposed: ``experts.gate_up_proj`` (experts, hidden, 2 x intermediate), gate
and up interleaved along the last axis, and ``experts.down_proj`` (experts, intermediate, hidden), each with a
``_bias``. mlx-lm's ``sanitize`` reads OpenAI's MXFP4 layout, out-features first, and so mis-names these
(``experts.gate_proj``, no ``.weight``) and splits them along the wrong axis. Turned here into mlx-lm's own
names and shapes (``gate_proj.weight`` (experts, intermediate, hidden), ...), which its ``sanitize`` passes as
they are.
"""

from __future__ import annotations

import mlx.core as mx


def unfused(weights: dict, config: dict) -> dict:
    """``weights`` with a float gpt-oss's transformers-layout experts in mlx-lm's layout; others as they are."""
    inner = config.get("intermediate_size")
    fused = [k for k, v in weights.items()
             if k.endswith(".experts.gate_up_proj") and v.ndim == 3 and v.shape[-1] == 2 * (inner or 0)]
    if config.get("model_type") != "gpt_oss" or not fused:
        return weights
    out = dict(weights)
    for key in fused:
        base = key.removesuffix("gate_up_proj")
        gate_up = out.pop(key).swapaxes(1, 2)  # (experts, 2 x intermediate, hidden)
        out[base + "gate_proj.weight"] = mx.contiguous(gate_up[:, 0::2])
        out[base + "up_proj.weight"] = mx.contiguous(gate_up[:, 1::2])
        if (bias := out.pop(base + "gate_up_proj_bias", None)) is not None:
            out[base + "gate_proj.bias"] = mx.contiguous(bias[:, 0::2])
            out[base + "up_proj.bias"] = mx.contiguous(bias[:, 1::2])
        if (down := out.pop(base + "down_proj", None)) is not None:
            out[base + "down_proj.weight"] = mx.contiguous(down.swapaxes(1, 2))  # (experts, hidden, intermediate)
        if (bias := out.pop(base + "down_proj_bias", None)) is not None:
            out[base + "down_proj.bias"] = bias
    return out
