"""MLX affine quantization, read as is: pure (de)quantize functions and the modules holding a checkpoint's tensors.

Layout (mlx-lm's): ``X.weight`` uint32 (out, in*bits/32) is a little-endian bit
stream along the input dimension (element j of a row at bits [j*bits, (j+1)*bits)),
``X.scales`` and ``X.biases`` are (out, in/group), and w = scales * q + biases.

Two layers of code: the pure functions `unpack`, `pack`, `dequantize`,
`quantize`; then `QuantizedLinear`/`QuantizedEmbedding`, which hold the
checkpoint's tensors as they are. What they run as on a device is an
execution form (kernels.py; forms.py chooses which).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from umakit.core.affine import BITS


# -- pure functions -------------------------------------------------------------
def unpack(w: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Integer codes (rows, cols) uint8 from the packed uint32 ``w`` (rows, cols*bits/32)."""
    b = w.contiguous().view(torch.uint8)  # (rows, cols*bits/8), little-endian words
    if bits == 8:
        return b[:, :cols]
    if bits == 4:
        return torch.stack((b & 15, b >> 4), dim=-1).view(b.shape[0], -1)[:, :cols]  # (rows, cols)
    if bits == 2:
        return torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).view(b.shape[0], -1)[:, :cols]
    # 3, 5, 6 bits: a code may straddle two bytes
    b = F.pad(b.to(torch.int32), (0, 1))
    start = torch.arange(cols, device=w.device) * bits
    byte, shift = start // 8, start % 8
    return (((b[:, byte] | (b[:, byte + 1] << 8)) >> shift) & ((1 << bits) - 1)).to(torch.uint8)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack`: codes (rows, cols) -> uint32 (rows, cols*bits/32)."""
    rows, cols = q.shape
    assert (cols * bits) % 32 == 0, "a row must fill whole 32-bit words"
    q = q.to(torch.int64)
    start = torch.arange(cols, device=q.device) * bits
    out = torch.zeros(rows, cols * bits // 8 + 1, dtype=torch.int64, device=q.device)
    shifted = q << (start % 8)  # (rows, cols), at most 15 bits
    out.index_add_(1, start // 8, shifted & 255)
    out.index_add_(1, start // 8 + 1, shifted >> 8)  # codes never overlap, so adding is or-ing
    # copied into a fresh tensor: a one-row slice counts as contiguous with its row stride left one byte long
    packed = torch.empty(rows, cols * bits // 8, dtype=torch.uint8, device=q.device)
    return packed.copy_(out[:, :-1]).view(torch.int32).view(torch.uint32)


def dequantize(w, scales, biases, bits: int, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """Float weights (rows, cols): scales * q + biases, computed in float32."""
    rows, groups = scales.shape
    out = unpack(w, bits, groups * group_size).view(rows, groups, group_size).float()  # (rows, groups, group)
    out.mul_(scales.float()[..., None]).add_(biases.float()[..., None])
    return out.view(rows, -1).to(dtype)


def quantize(w: torch.Tensor, bits: int, group_size: int):
    """Min-max affine quantization of ``w`` (rows, cols) into MLX's layout: (weight, scales, biases)."""
    rows, cols = w.shape
    g = w.float().view(rows, cols // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 2**bits - 1).to(torch.uint8)
    return pack(q.view(rows, cols), bits), scales.to(w.dtype), lo.to(w.dtype)


# -- checkpoint-layout modules ----------------------------------------------------
class QuantizedLinear(nn.Module):
    """A linear layer in MLX's affine layout; its own forward is dequantize-then-matmul."""

    # Where a load left the layer's tensors unread (meta: a GGUF's blocks, load/gguf_layers.py), what makes them:
    # () -> (weight, scales, biases), called by the CPU kernel's packing, so memory holds one such layer at a time;
    # and `tiled`, () -> (its codes already in the kernel's tiles, scales, biases), which the packing takes first.
    source = tiled = None

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int,
                 dtype=torch.float16, device=None):
        super().__init__()
        if bits not in BITS or in_features % group_size or (in_features * bits) % 32:
            raise ValueError(f"cannot quantize {in_features} inputs with {bits} bits in groups of {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = in_features // group_size
        words = in_features * bits // 32
        self.register_buffer("weight", torch.empty(out_features, words, dtype=torch.uint32, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("biases", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight, scales, biases): the layer's own, or, where a load left them unread, what `source` makes."""
        if self.weight.is_meta and self.source is not None:
            return self.source()
        return self.weight, self.scales, self.biases

    def dequantized(self, dtype) -> torch.Tensor:
        return dequantize(*self.tensors(), self.bits, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)


class QuantizedEmbedding(QuantizedLinear):
    """An embedding table (num_embeddings, dim) in MLX's affine layout: looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, dim: int, bits: int, group_size: int, dtype=torch.float32, device=None):
        super().__init__(dim, num_embeddings, False, bits, group_size, device=device)
        self.out_dtype = dtype  # the compute dtype of the rows returned

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.weight[flat], self.scales[flat], self.biases[flat], self.bits, self.group_size,
                          self.out_dtype)
        return rows.view(*ids.shape, -1)  # (..., dim)

    def as_linear(self) -> QuantizedLinear:
        """The tied output head: the same tensors used as a linear layer."""
        head = QuantizedLinear(self.in_features, self.out_features, False, self.bits, self.group_size, device="meta")
        head.weight, head.scales, head.biases = self.weight, self.scales, self.biases
        head.source, head.tiled = self.source, self.tiled
        return head


def concat(layers: list[nn.Module]) -> nn.Module:
    """One layer computing ``torch.cat([l(x) for l in layers], -1)``, by stacking output rows."""
    first = layers[0]
    same = all(type(m) is type(first) and (m.bias is None) == (first.bias is None) for m in layers)
    if same and isinstance(first, nn.Linear):
        fused = nn.Linear(first.in_features, sum(m.out_features for m in layers), bias=first.bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight for m in layers]), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in layers]), requires_grad=False)
        return fused
    if same and isinstance(first, QuantizedLinear) and all(
        (m.bits, m.group_size, m.scales.dtype) == (first.bits, first.group_size, first.scales.dtype) for m in layers
    ):
        fused = QuantizedLinear(first.in_features, sum(m.out_features for m in layers), first.bias is not None,
                                first.bits, first.group_size, device="meta")
        if first.bias is not None:
            fused.bias = torch.cat([m.bias for m in layers])
        if any(m.weight.is_meta for m in layers):  # left unread: made together when the packing asks
            fused.source = lambda: tuple(torch.cat(parts) for parts in zip(*(m.tensors() for m in layers)))
            return fused
        for name in ("weight", "scales", "biases"):
            setattr(fused, name, torch.cat([getattr(m, name) for m in layers]))
        return fused
    return Concat(layers)  # mixed formats (per-layer quantization overrides): run each


class Concat(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.parts = nn.ModuleList(layers)

    def forward(self, x):
        return torch.cat([m(x) for m in self.parts], dim=-1)
