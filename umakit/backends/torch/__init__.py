"""PyTorch backend: CUDA on NVIDIA GPUs, CPU elsewhere.

Importing this package imports no torch: the registry reads `SPEC` here and
imports `engine` only when the engine is chosen.
"""

from ..base import BATCH, OFFLOAD, EngineSpec

SPEC = EngineSpec(name="torch", module="umakit.backends.torch.engine", cls="TorchEngine", dependency="torch",
                  extra="umakit[cuda]", devices=("cuda", "cpu"), features=frozenset({BATCH, OFFLOAD}))


def __getattr__(name):
    if name == "TorchEngine":
        from .engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)
