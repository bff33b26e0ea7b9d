"""PyTorch backend: CUDA on NVIDIA GPUs, CPU elsewhere."""

from .engine import TorchEngine

__all__ = ["TorchEngine"]
