"""MLX backend: Metal on Apple Silicon, CPU elsewhere.

Importing this package imports no mlx: the registry reads `SPEC` here and
imports `engine` only when the engine is chosen.
"""

from umakit.backends.base import BATCH, CONSTRAIN, EXPORT, LOOKUP, QUANTIZE, QUANTIZED_KV, EngineSpec
from umakit.backends.mlx.architectures import mlx_lm_runs

SPEC = EngineSpec(name="mlx", module="umakit.backends.mlx.engine", cls="MLXEngine", dependency="mlx",
                  extra="umakit", devices=("metal", "cpu"), features=frozenset({QUANTIZED_KV, BATCH, QUANTIZE, EXPORT, CONSTRAIN, LOOKUP}),
                  finds_architecture=mlx_lm_runs, architectures_source="architecture mlx-lm has a model file for")


def __getattr__(name):
    if name == "MLXEngine":
        from umakit.backends.mlx.engine import MLXEngine

        return MLXEngine
    raise AttributeError(name)
