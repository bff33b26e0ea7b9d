"""The Apple GPU's facts as MLX reports them: one call, for every caller (the chip's facts, the
MLX engine's wiring and its batch KV budget).

MLX is imported here only when asked: this package is read on machines without it.
"""

from __future__ import annotations

WORKING_SET_KEY = "max_recommended_working_set_size"


def metal_device_info() -> dict:
    """MLX's facts about the GPU (``max_recommended_working_set_size``, ``memory_size``, ...).

    `mx.device_info` where this MLX has it; before it, the `mx.metal.device_info` that
    MLX 0.30.4 deprecated (and that warns on every call where both exist).
    """
    import mlx.core as mx

    if hasattr(mx, "device_info"):
        return dict(mx.device_info(mx.gpu))
    return dict(mx.metal.device_info())


def metal_working_set() -> int:
    """Bytes the GPU should keep in use at most (Metal's recommended working set)."""
    return int(metal_device_info()[WORKING_SET_KEY])
