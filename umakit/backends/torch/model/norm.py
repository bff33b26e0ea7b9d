"""The compact model's RMSNorms: transformers' formula, in float32 inside, with weight w (`RMSNorm`), 1 + w
(`GemmaRMSNorm`, gemma3's) or none (`ScalelessNorm`, gemma4's values).

On a CPU where the decode step runs eagerly (no fused step, cpu/fused.py `native_norms`) each norm is one call of
the library's (csrc/norm.cpp), the same formula with the mean summed in double, as the fused step sums it: the
seven dispatches of the formula took about 22 us a norm, and a gemma4 layer has eleven.
"""

from __future__ import annotations

import torch
from torch import nn


class Norm(nn.Module):
    native = False  # one call of csrc/norm.cpp for float32 inputs (set by cpu/fused.py `native_norms`)
    plus_one = False  # the scale is 1 + weight

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.get("weight")
        if self.native and x.dtype == torch.float32:
            return torch.ops.umakit.rms_norm(x, weight, self.eps, self.plus_one)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        if weight is None:
            return normed.to(x.dtype)
        if self.plus_one:  # the product in float32
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight * normed.to(x.dtype)


class RMSNorm(Norm):
    def __init__(self, dim: int, eps: float):
        super().__init__(eps)
        self.weight = nn.Parameter(torch.ones(dim))


class GemmaRMSNorm(Norm):
    """RMSNorm with weight (1 + w), the product taken in float32 (transformers' Gemma3RMSNorm)."""

    plus_one = True

    def __init__(self, dim: int, eps: float):
        super().__init__(eps)
        self.weight = nn.Parameter(torch.zeros(dim))


class ScalelessNorm(Norm):
    """RMSNorm without a weight (gemma4's values), in float32 as transformers computes it."""
