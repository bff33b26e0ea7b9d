"""MLX backend: Metal on Apple Silicon, CPU elsewhere."""

from .engine import MLXEngine

__all__ = ["MLXEngine"]
