"""MXFP4 (gpt-oss's routed experts, as OpenAI ships them) read as MLX's affine layout at 5 bits, exactly.

An MXFP4 weight is an E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4 or 6, or its negative) times 2^(e - 127), e one byte per
32 weights, the codes two a byte, the low nibble first. Twice the value is an integer of -12..12, so a weight is
exactly (code - 16) * 2^(e - 128) with a 5-bit code of 4..28: the affine form at 5 bits, groups of 32, a scale of
2^(e - 128) and a bias of -16 scales. Pure functions, shared by the torch engine's loader (load/openai_experts.py)
and the transformers engine's (backends/transformers/mxfp4.py).
"""

from __future__ import annotations

import torch

from umakit.backends.torch.quant.layout import pack

BITS, GROUP, OFFSET = 5, 32, 16
# twice each E2M1 code's value (codes 8-15 the negatives of 0-7), and each byte's two (low nibble, high nibble)
DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int16)
PAIRS = torch.stack((DOUBLED.repeat(16), DOUBLED.repeat_interleave(16)), dim=-1)
PACK_ROWS = 256  # `pack` widens codes to int64, 8 bytes a weight: a slice of rows at a time


def doubled(blocks: torch.Tensor) -> torch.Tensor:
    """Twice each weight's E2M1 value, int16 (..., cols / 32, 32), from ``blocks`` (..., cols / 32, 16) on their
    device: each byte's two values looked up at once."""
    return PAIRS.to(blocks.device)[blocks.to(torch.int64)].reshape(*blocks.shape[:-1], GROUP)


def exponents(scales: torch.Tensor) -> torch.Tensor:
    """Each group's step as a power of two, int32: the E8M0 byte less 127, less one more for the doubled codes."""
    return scales.to(torch.int32) - 128


def steps(scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Each group's step 2^(e - 128) in ``dtype`` (exact in float32 and bfloat16 for every byte; 255, NaN in the
    MX format, reads as 2^127)."""
    e = exponents(scales)
    return torch.ldexp(torch.ones(e.shape, device=scales.device), e).to(dtype)


def packed_codes(blocks: torch.Tensor) -> torch.Tensor:
    """The 5-bit codes of ``blocks`` (..., rows, cols / 32, 16) packed as MLX's uint32 (..., rows, cols * 5 / 32)."""
    *lead, rows, groups, _ = blocks.shape
    flat = blocks.reshape(-1, groups, 16)
    out = [pack((doubled(flat[i:i + PACK_ROWS]).reshape(-1, groups * GROUP) + OFFSET).to(torch.uint8), BITS)
           for i in range(0, flat.shape[0], PACK_ROWS)]
    return torch.cat(out).view(*lead, rows, groups * GROUP * BITS // 32)


def dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weights (..., rows, cols) of ``blocks`` and ``scales``."""
    w = doubled(blocks).float() * torch.exp2(exponents(scales).float())[..., None]
    return w.reshape(*blocks.shape[:-2], -1).to(dtype)
