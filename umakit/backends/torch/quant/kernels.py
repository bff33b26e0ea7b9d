"""The execution forms of a quantized layer on torch's own kernels, within float tolerance of
dequantize-then-matmul in the compute dtype (forms.py chooses one per layer, device and dtype):

- `Int4PackLinear`: torch's int4 "tinygemm" kernels (CUDA and CPU), fed an exact repack of MLX's groups;
- `Fp16Linear`: FBGEMM's float16 weights with float32 math (x86 CPUs);
- `dense`: dequantized once at load.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from umakit.backends.torch import crossover
from umakit.backends.torch.quant.layout import QuantizedLinear, unpack


class Int4PackLinear(nn.Module):
    """torch's int4 "tinygemm" kernels, fed an exact repack of MLX's 4-bit groups.

    torch dequantizes (q - 8) * scale + zero, so zero = bias + 8 * scale. An
    8-bit layer is split into two nibble planes along the input dimension,
    w = 16 s * hi + s * lo + b, and the input is repeated to match. The kernels
    run in bfloat16 (its CPU kernel rounds inputs and outputs to bfloat16).

    On CPU the kernel dequantizes each weight once per input row, so from
    `crossover.DENSE_ROWS` rows on (a long prefill) the weight is dequantized
    once per call, in blocks of output rows, for oneDNN's bfloat16 GEMM:
    1.4-1.6x faster at 512 rows, with the weights rounded to bfloat16.
    """

    def __init__(self, m: QuantizedLinear, device: torch.device, prepacked: dict | None = None):
        """``prepacked``: the packing an earlier CPU load made of ``m`` (load/packed.py), by `packing`'s names."""
        super().__init__()
        self.in_features, self.out_features, self.group_size = m.in_features, m.out_features, m.group_size
        self.split = m.bits == 8
        stored = prepacked or {}
        packed, sz = stored.get("packed"), stored.get("scales_and_zeros")
        if packed is None or sz is None or device.type != "cpu" or not self._fits(packed, sz):
            packed, sz = self._repack(m, device)
        self.register_buffer("scales_and_zeros", sz)
        ops = torch.ops.aten
        self.op = ops._weight_int4pack_mm if device.type == "cuda" else ops._weight_int4pack_mm_for_cpu
        self.dense_prefill = device.type == "cpu" and self.out_features % 64 == 0 and cpu_layout_known()
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

    def packing(self) -> dict[str, torch.Tensor]:
        """What `load/packed.py` keeps of this layer, by name."""
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}

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
        if self.dense_prefill and x.shape[0] >= crossover.DENSE_ROWS and not crossover.alone():
            block = crossover.DENSE_BLOCK
            y = torch.cat([F.linear(x, self.dequantized(r, r + block)) for r in range(0, self.out_features, block)],
                          dim=-1)
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


def unpack_cpu_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) uint8 of torch's CPU int4 packing (N, K/2), N a multiple of 64.

    In each block of 64 rows, byte k*32 + n holds row n's code k (low nibble)
    and row n + 32's (high nibble); `cpu_layout_known` checks this once.
    """
    n, half = packed.shape
    b = packed.reshape(n // 64, half * 2, 32)  # (blocks, K, 32)
    return torch.stack([b & 15, b >> 4], dim=1).transpose(2, 3).reshape(n, half * 2)


@functools.cache
def cpu_layout_known() -> bool:
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
        if crossover.alone() and x.dim() > 1 and x.numel() > x.shape[-1]:  # each row as alone: one call a row
            lone = [1] * (x.dim() - 1)  # each row shaped as a lone step's input
            rows = x.reshape(-1, x.shape[-1])
            y = torch.cat([torch.ops.quantized.linear_dynamic_fp16(r.view(*lone, -1), self.packed) for r in rows])
            return y.view(*x.shape[:-1], -1)
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
