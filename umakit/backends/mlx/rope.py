"""Corrections to mlx-lm's RoPE where its code reads less of a checkpoint's ``rope_scaling`` than the checkpoint
sets, so the model runs as trained rather than close to it.

yarn's ``truncate``: mlx-lm's ``YarnRoPE`` always rounds the range of dimensions its ramp blends over (floor and
ceiling of the correction dimensions), which is yarn's default. gpt-oss sets ``"truncate": false``: the ramp
runs between the unrounded dimensions (transformers' ``_compute_yarn_parameters`` reads the flag). Run rounded,
a tiny gpt-oss's logits moved by 1.7e-3 of their largest, and the argmax at 1 of 40 positions.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from umakit.backends.mlx.mlx_lm_import import import_mlx_lm


def correct(model: nn.Module, scaling: dict | None, base: float) -> int:
    """Set each of ``model``'s yarn RoPEs to what ``scaling`` asks where mlx-lm's would differ; how many."""
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "yarn" \
            or scaling.get("truncate", True):
        return 0
    yarn = import_mlx_lm("models.rope_utils").YarnRoPE
    done = 0
    for module in model.modules():
        if isinstance(module, yarn):
            module._freqs = untruncated_yarn_periods(module.dims, base, scaling)
            done += 1
    return done


def untruncated_yarn_periods(dims: int, base: float, scaling: dict) -> mx.array:
    """yarn's per-pair periods (mlx-lm's ``_freqs``, the inverse of the frequencies) with the blend's range left
    unrounded: extrapolated below the fast correction dimension, interpolated by ``factor`` above the slow one,
    linearly between."""
    factor = float(scaling.get("factor", 1.0))
    original = float(scaling.get("original_max_position_embeddings", 4096))

    def dim_of(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(dim_of(float(scaling.get("beta_fast", 32))), 0.0)
    high = min(dim_of(float(scaling.get("beta_slow", 1))), dims - 1.0)
    if low == high:
        high += 0.001  # as yarn's ramp does
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inter = factor * extra
    keep = 1.0 - ramp  # the share of each pair left extrapolated
    return (inter * extra) / (inter * keep + extra * (1 - keep))
