"""A layer's scales as the K-quants hold them: an int8 code per group times a float16 factor per super-block.

A GGUF's Q4_K and Q5_K give each group of 32 weights a scale d * sc and a bias -dmin * m, with 6-bit codes sc and m
and float16 d and dmin shared by the 256 weights of a super-block; Q6_K a scale d * sc per 16 weights, sc in int8.
The import keeps those scales as float32 products (exact), which the kernel would read as a float16 scale and
bias per group (1 bit a weight at groups of 32). Where a layer's scales are such products, `coded` finds the
factors and codes back, exactly (each checked: factor * code in float32 equals the scale), and the kernel reads
1 byte a scale plus the factors: Q4_K 4.625 bits a weight instead of 5, Q6_K 6.5625 (its GGUF size). A layer
whose scales are not all such products (an MLX quantization) keeps its float16 form.
"""

from __future__ import annotations

import functools

import torch

SUPER = 256  # weights of a super-block along the input
ROWS = 8  # rows in a tile (csrc/affine.h)
# the codes a K-quant's largest scale takes, either sign: 63 (Q4_K/Q5_K's 6 bits), 127 and 128 (Q6_K's int8)
CANDIDATES = tuple(sign * n for n in (63, 127, 128, *(n for n in range(1, 129) if n not in (63, 127, 128)))
                   for sign in (1.0, -1.0))


def coded(planes: list[torch.Tensor], group: int, rows: int) -> torch.Tensor | None:
    """The kernel's coded scales (csrc/affine.h) for ``planes`` ([scales] or [scales, biases], each (out,
    groups)), padded to ``rows`` (a multiple of 8): uint8 (rows / 8, super-blocks, planes * (16 + 8 * per)) where
    per = 256 / group; None where any scale is not a float16 factor times an int8 code of its super-block."""
    out, groups = planes[0].shape
    if SUPER % group or group * 2 > SUPER or (groups * group) % SUPER:
        return None
    per = SUPER // group
    factors, codes = [], []
    for t in planes:
        found = _factor_codes(t.float().reshape(-1, per))
        if found is None:
            return None
        factors.append(found[0].view(out, -1))  # (out, supers) float16
        codes.append(found[1].view(out, -1, per))  # (out, supers, per) int8
    f = torch.stack(factors, dim=-1)  # (out, supers, planes)
    c = torch.stack(codes, dim=-1)  # (out, supers, per, planes)
    if rows > out:
        f = torch.cat([f, f.new_zeros(rows - out, *f.shape[1:])])
        c = torch.cat([c, c.new_zeros(rows - out, *c.shape[1:])])
    supers, n = f.shape[1], len(planes)
    f = f.view(rows // ROWS, ROWS, supers, n).permute(0, 2, 3, 1).contiguous()  # (tiles, supers, planes, 8)
    c = c.view(rows // ROWS, ROWS, supers, per, n).permute(0, 2, 3, 4, 1).contiguous()  # (tiles, supers, per, n, 8)
    return torch.cat([f.view(torch.uint8).view(rows // ROWS, supers, -1), c.view(torch.uint8).view(rows // ROWS,
                      supers, -1)], dim=-1).contiguous()


def _factor_codes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``v`` (super-blocks, per) float32 as float16 factors (super-blocks,) times int8 codes (super-blocks, per),
    exactly; None where some super-block has none (csrc/scale_codes.cpp: each block tries first the code the
    block before it took, then `CANDIDATES` in order)."""
    factors, codes = torch.ops.umakit.scale_codes(v.contiguous(), _candidates())
    return (factors, codes) if factors.numel() else None


@functools.cache
def _candidates() -> torch.Tensor:
    return torch.tensor(CANDIDATES, dtype=torch.float32)
