"""MLX affine quantization, read as is: pure (de)quantize functions and the layers that use them.

Layout (mlx-lm's): ``X.weight`` uint32 (out, in*bits/32) is a little-endian bit
stream along the input dimension (element j of a row at bits [j*bits, (j+1)*bits)),
``X.scales`` and ``X.biases`` are (out, in/group), and w = scales * q + biases.

Two layers of code: the pure functions `unpack`, `pack`, `dequantize`,
`quantize`; then the modules. `QuantizedLinear`/`QuantizedEmbedding` hold the
checkpoint's tensors; the execution forms (`Int4PackLinear`, `Fp16Linear`, `dense`) are what a loaded `QuantizedLinear` into
what runs fastest on the device (convert.py chooses which) without leaving
float tolerance of dequantize-then-matmul in the compute dtype.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from umakit.affine import BITS


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
    return out[:, :-1].to(torch.uint8).contiguous().view(torch.int32).view(torch.uint32)


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

    def dequantized(self, dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scales, self.biases, self.bits, self.group_size, dtype)

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
        for name in ("weight", "scales", "biases", "bias"):
            if getattr(first, name) is not None:
                setattr(fused, name, torch.cat([getattr(m, name) for m in layers]))
        return fused
    return Concat(layers)  # mixed formats (per-layer quantization overrides): run each


class Concat(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.parts = nn.ModuleList(layers)

    def forward(self, x):
        return torch.cat([m(x) for m in self.parts], dim=-1)


# -- execution formats -------------------------------------------------------------
class Int4PackLinear(nn.Module):
    """torch's int4 "tinygemm" kernels, fed an exact repack of MLX's 4-bit groups.

    torch dequantizes (q - 8) * scale + zero, so zero = bias + 8 * scale. An
    8-bit layer is split into two nibble planes along the input dimension,
    w = 16 s * hi + s * lo + b, and the input is repeated to match. The kernels
    run in bfloat16 (its CPU kernel rounds inputs and outputs to bfloat16).

    On CPU the kernel dequantizes each weight once per input row, so from
    `DENSE_ROWS` rows on (prefill) the weight is dequantized once per call,
    in blocks of output rows, for oneDNN's bfloat16 GEMM: 1.5-2x faster at
    512 rows, with the weights rounded to bfloat16 (8 significant bits).
    """

    def __init__(self, m: QuantizedLinear, device: torch.device, prepacked=None):
        """``prepacked``: (packed, scales_and_zeros) an earlier CPU load made of ``m`` (packed_cache.py)."""
        super().__init__()
        self.in_features, self.out_features, self.group_size = m.in_features, m.out_features, m.group_size
        self.split = m.bits == 8
        if prepacked is not None and device.type == "cpu" and self._fits(*prepacked):
            packed, sz = prepacked
        else:
            packed, sz = self._repack(m, device)
        self.register_buffer("scales_and_zeros", sz)
        ops = torch.ops.aten
        self.op = ops._weight_int4pack_mm if device.type == "cuda" else ops._weight_int4pack_mm_for_cpu
        self.dense_prefill = device.type == "cpu" and self.out_features % 64 == 0 and _cpu_layout_known()
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if m.bias is None else m.bias.float())  # cast to the input dtype on use

    def _repack(self, m: QuantizedLinear, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        q = unpack(m.weight, m.bits, m.in_features).to(torch.int32)  # (N, K)
        s, b = m.scales.float(), m.biases.float()  # (N, G)
        if self.split:
            q = torch.cat([q >> 4, q & 15], dim=1)  # (N, 2K)
            s, b = torch.cat([16 * s, s], dim=1), torch.cat([b + 128 * s, 8 * s], dim=1)
        else:
            b = b + 8 * s
        sz = torch.stack([s, b], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # (G, N, 2)
        if device.type == "cuda":
            tiles = next(t for t in (8, 4, 2) if q.shape[1] % (t * 16) == 0)
            return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles), sz
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz

    def _fits(self, packed: torch.Tensor, sz: torch.Tensor) -> bool:
        """Whether a stored packing has the shapes and dtypes `_repack` makes of this layer on CPU."""
        k = self.in_features * (2 if self.split else 1)
        return (packed.dtype == torch.uint8 and tuple(packed.shape) == (self.out_features, k // 2)
                and sz.dtype == torch.bfloat16 and tuple(sz.shape) == (k // self.group_size, self.out_features, 2))

    @staticmethod
    def supports(m: QuantizedLinear, device: torch.device) -> bool:
        if m.bits not in (4, 8) or m.out_features % 16:
            return False
        k = m.in_features * (2 if m.bits == 8 else 1)
        return device.type != "cuda" or (m.out_features % 8 == 0 and k % 32 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, self.in_features)  # (M, K)
        if dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if self.dense_prefill and x.shape[0] >= DENSE_ROWS:
            y = torch.cat([F.linear(x, self.dequantized(r, r + DENSE_BLOCK))
                           for r in range(0, self.out_features, DENSE_BLOCK)], dim=-1)
        else:
            if self.split:
                x = torch.cat([x, x], dim=-1)  # (M, 2K): one input per nibble plane
            y = self.op(x, self.packed, self.group_size, self.scales_and_zeros)
        if dtype != torch.bfloat16:
            y = y.to(dtype)  # float32 activations (CPU): only the kernel's inputs and outputs are rounded
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.view(*shape, self.out_features)

    def dequantized(self, start: int, stop: int) -> torch.Tensor:
        """Output rows [start, stop) of the weight, (rows, in_features) bfloat16, from the CPU packing."""
        q = unpack_cpu_int4pack(self.packed[start:stop])  # (rows, K or 2K)
        sz = self.scales_and_zeros[:, start:stop].float()  # (G, rows, 2)
        rows, groups = q.shape[0], sz.shape[0]
        w = q.view(rows, groups, self.group_size).float().sub_(8)
        w = w.mul_(sz[..., 0].T[..., None]).add_(sz[..., 1].T[..., None]).view(rows, -1)
        if self.split:
            w = w[:, :self.in_features] + w[:, self.in_features:]  # the two nibble planes of one input
        return w.to(torch.bfloat16)


DENSE_ROWS = 32  # input rows from which a CPU int4 layer runs as dequantize + one GEMM (the kernel's time is
#                  linear in rows from 4 on; dequantize + GEMM wins at 512 rows by 1.5-2x)
DENSE_BLOCK = 4096  # output rows dequantized at a time: a float32 block of a 49152-row head stays ~20 MB


def unpack_cpu_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) uint8 of torch's CPU int4 packing (N, K/2), N a multiple of 64.

    In each block of 64 rows, byte k*32 + n holds row n's code k (low nibble)
    and row n + 32's (high nibble); `_cpu_layout_known` checks this once.
    """
    n, half = packed.shape
    b = packed.reshape(n // 64, half * 2, 32)  # (blocks, K, 32)
    return torch.stack([b & 15, b >> 4], dim=1).transpose(2, 3).reshape(n, half * 2)


@functools.cache
def _cpu_layout_known() -> bool:
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed.shape == (128, 32) and torch.equal(unpack_cpu_int4pack(packed).to(torch.int32), q)


def dense(m: QuantizedLinear, dtype: torch.dtype) -> nn.Linear:
    """Dequantize once, at load: exact in the compute dtype, but reads 32/bits times the bytes."""
    out = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    out.weight = nn.Parameter(m.dequantized(dtype), requires_grad=False)
    if m.bias is not None:
        out.bias = nn.Parameter(m.bias.to(dtype), requires_grad=False)
    return out


class Fp16Linear(nn.Module):
    """Float16 weights, float32 inputs and accumulation (FBGEMM, x86 CPUs): half the bytes of float32.

    The only rounding is of the weights to float16 (2^-11 relative); products
    and sums stay in float32. FBGEMM's packing is slow (~10 ns a weight, over
    a second for a 135M model), so it runs on a thread pool in the background:
    loading returns at once and a layer's first call waits for its own packing
    only, and the packing of later layers overlaps the work before that call.
    """

    def __init__(self, source: nn.Module):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        has_bias = source.bias is not None
        self.packed_nbytes = 2 * self.in_features * self.out_features + (4 * self.out_features if has_bias else 0)
        self._packed = None
        self._pending = _packer().submit(_pack_fp16, source)

    @staticmethod
    def available() -> bool:
        return "fbgemm" in torch.backends.quantized.supported_engines

    @property
    def packed(self):
        if self._pending is not None:
            self._packed, self._pending = self._pending.result(), None  # re-raises a packing error
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


_PACKER = None


def _packer():
    global _PACKER
    if _PACKER is None:
        _PACKER = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="umakit-pack")
    return _PACKER


def _pack_fp16(source: nn.Module):
    """FBGEMM's packed float16 form of a `QuantizedLinear` or `nn.Linear` (run on the packing pool)."""
    with torch.inference_mode():
        if isinstance(source, QuantizedLinear):
            weight = source.dequantized(torch.float32)
        else:
            weight = source.weight.float()
        bias = None if source.bias is None else source.bias.float()
        return torch.ops.quantized.linear_prepack_fp16(weight, bias)
