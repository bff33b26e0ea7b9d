"""The CUDA decode's fused dequantize-matvec, in Triton, for the layers torch's int4 kernels do not take: every
width MLX stores (2, 3, 4, 5, 6, 8 bits), read in MLX's own packing.

Nothing here touches CUDA or imports Triton at import time, so the module
imports on any machine. Its logic is tested without a GPU: `affine_matvec`
with a fixed block config launches the raw jitted kernel, which Triton's
interpreter runs on CPU tensors (``TRITON_INTERPRET=1`` in the environment
before triton is first imported: triton jits its own library then).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from umakit.errors import BackendUnavailableError
from umakit.backends.torch.quant.layout import QuantizedLinear, dequantize

# (BLOCK_N, BLOCK_K, num_warps) the autotuner chooses from on CUDA
TUNING_CONFIGS = ((4, 256, 4), (8, 256, 4), (16, 128, 4), (8, 512, 8), (16, 256, 8), (32, 128, 8))
FIXED_BLOCKS = (16, 128)  # (BLOCK_N, BLOCK_K) off CUDA, where only the interpreter runs the kernel


def triton_kernel():
    """The jitted, autotuned kernel, or None where Triton is not installed."""
    kernels = _kernels()
    return None if kernels is None else kernels[1]


@functools.cache
def _kernels():
    """(raw jitted kernel, autotuned wrapper of it), or None without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return _build_kernels()


def _build_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def matvec(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, WORDS, GROUPS,
               BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[n] = sum_k x[k] * (s[n, k // GROUP] * q[n, k] + b[n, k // GROUP]), accumulated in float32.
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
            ok = row_ok[:, None] & (cols < K)[None, :]
            if 32 % BITS == 0:  # 2, 4, 8 bits: a code never straddles two words
                # Each packed word is loaded 32 // BITS times; the repeats hit L1.
                words = tl.load(w_ptr + rows[:, None] * WORDS + (cols // (32 // BITS))[None, :], mask=ok, other=0)
                q = (words >> ((cols % (32 // BITS)) * BITS)[None, :]) & ((1 << BITS) - 1)  # mask drops sign bits
            else:  # 3, 5, 6 bits: a code may straddle two words, read as one 64-bit little-endian pair
                at = cols * BITS
                word = rows[:, None] * WORDS + (at // 32)[None, :]
                lo = tl.load(w_ptr + word, mask=ok, other=0).to(tl.int64) & 0xFFFFFFFF
                more = ok & ((at // 32 + 1) < WORDS)[None, :]
                hi = tl.load(w_ptr + word + 1, mask=more, other=0).to(tl.int64) & 0xFFFFFFFF
                q = (((hi << 32) | lo) >> (at % 32)[None, :]) & ((1 << BITS) - 1)
            g = rows[:, None] * GROUPS + (cols // GROUP)[None, :]
            s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + g, mask=ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            acc += tl.sum((q.to(tl.float32) * s + b) * x[None, :], axis=1)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)

    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in TUNING_CONFIGS],
        key=["N", "K", "BITS", "GROUP"],
    )(matvec)
    return matvec, tuned


def affine_matvec(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                  group: int, block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """y (N,) = dequantize(w, scales, biases) @ x for one input row ``x`` (K,), in one fused kernel.

    ``w`` is the packed weight (N, K*bits/32) viewed as int32, ``scales`` and
    ``biases`` (N, K/group), all contiguous. With ``block_n`` and ``block_k``
    the raw kernel runs with that config (also under Triton's interpreter, on
    CPU tensors); without them the autotuned kernel picks one (CUDA only).
    """
    kernels = _kernels()
    if kernels is None:
        raise BackendUnavailableError("the fused dequantize-matvec needs Triton: pip install triton")
    raw, tuned = kernels
    (N, words), (K,) = w.shape, x.shape
    y = torch.empty(N, dtype=x.dtype, device=x.device)
    args = (x, w, scales, biases, y, N, K, words, scales.shape[1])
    if block_n is None:
        tuned[lambda meta: (triton_cdiv(N, meta["BLOCK_N"]),)](*args, BITS=bits, GROUP=group)
    else:
        raw[(triton_cdiv(N, block_n),)](*args, BITS=bits, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


class TritonAffineLinear(nn.Module):
    """MLX affine weights read as stored: a fused Triton matvec for one token, cuBLAS after dequantizing for more."""

    def __init__(self, m: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = m.in_features, m.out_features
        self.bits, self.group_size = m.bits, m.group_size
        self.register_buffer("weight", m.weight.view(torch.int32).contiguous())
        self.register_buffer("scales", m.scales.to(dtype).contiguous())
        self.register_buffer("biases", m.biases.to(dtype).contiguous())
        self.register_buffer("bias", None if m.bias is None else m.bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()  # (M, K)
        if x.shape[0] == 1:
            # the autotuner times configs on the GPU; elsewhere the kernel runs interpreted, at a fixed config
            blocks = (None, None) if x.is_cuda else FIXED_BLOCKS
            y = affine_matvec(x[0], self.weight, self.scales, self.biases, self.bits, self.group_size, *blocks)[None]
        else:
            w = dequantize(self.weight, self.scales, self.biases, self.bits, self.group_size, x.dtype)
            y = F.linear(x, w)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape, self.out_features)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
