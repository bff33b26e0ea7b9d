"""Where the torch engine's CPU paths cross over, measured, in one place: the int4 layers and the engine read these
(at call time, so benchmarks/prefill_rows.py can move them to measure each side).

A CPU int4 layer (quant/kernels.py `Int4PackLinear`) runs torch's kernel, which dequantizes each weight once
per input row, so its time grows with the rows; from `DENSE_ROWS` rows on (a long prefill) the layer
dequantizes its weight once per call instead, in blocks of `DENSE_BLOCK` output rows, for one bfloat16 GEMM.
Measured with benchmarks/prefill_rows.py (2026-12-02, 2 threads, AVX-512): the kernel is faster up to 128 rows
on the built-in 135M model and up to 192 on Qwen2.5-0.5B's shapes, the GEMM from 256 on both (1.4-1.6x at 512).

umakit's affine kernel (cpu/affine_kernel.py) decodes each block of weights once for up to four input rows.
With int8 inputs in one pass it never takes a GEMM: its int8 dot products have four times float32 FMAs'
throughput, and measured with benchmarks/prefill_rows.py on Qwen2.5-0.5B's shapes at Q4_K_M (2026-12-02, 2
threads) the kernel took 138, 352, 1919, 3952 and 9930 ms at 32, 96, 512, 1024 and 2048 tokens, dequantizing for
float32 GEMMs 688, 594, 2622, 5368 and 12095 ms. In two passes (the default; with AVX2 only, the same
thresholds, measured with VNNI) it takes the GEMM
from `AFFINE_INT8X2_DENSE_ROWS` rows: the same file, the same day, best of 2, 170, 499, 941, 1125, 1752 and
4121 ms at 32, 64, 128, 192, 256 and 512 tokens against 284, 649, 1211, 1006, 1311 and 3257. With float32 inputs it
dequantizes blocks of rows for a GEMM from `AFFINE_DENSE_ROWS` rows on (measured on its earlier layout, one
row a lane: 339, 561 and 1037 ms at 32, 64 and 128 tokens against 755, 824 and 785 ms).

Those GEMMs run on oneDNN where torch carries it and the CPU passes its checks (csrc/gemm.cpp; AVX-512): twice
torch's BLAS in float32 on an AMD EPYC, and in bfloat16 (the default where the CPU multiplies it natively:
cpu/affine_kernel.py `prefill_gemm`) faster again. The layer runs in slabs of output rows (512K weights each),
each dequantized and multiplied by one thread while its weights are in that core's cache, so the two-pass form
takes the GEMMs sooner: from `AFFINE_INT8X2_BF16_DENSE_ROWS` in bfloat16, `AFFINE_INT8X2_ONEDNN_DENSE_ROWS` in
float32. Measured (2026-12-06, 2 threads, AMD EPYC with AVX512-BF16, Qwen2.5-1.5B's shapes at Q4_K_M, best of 3,
the engine's forward forced each way in one process, slabs of 32 tiles then), kernel / bfloat16 GEMMs: 324/308,
478/356, 630/437 and 5213/2372 ms at 32, 48, 64 and 512 tokens; with `UMAKIT_PREFILL_GEMM=float32`, kernel /
float32 GEMMs: 322/422, 473/498, 625/599 and 5278/3594 ms. Before the slabs and oneDNN (torch's BLAS, whole
blocks of rows): 7027-7130 ms at 512.

Once the slabs' dequantization ran in vector loops (csrc/affine_mm.cpp `dequantize_tiles_simd`: 0.81 s of fixed
cost a forward pass became 0.31 s on Qwen2.5-1.5B's shapes at Q4_K_M), the GEMMs won sooner. Measured 2026-12-06
on an Intel Xeon with AMX (2 threads, best of 2, kernel / GEMMs, the engine's prefill forced each way in one
process): bfloat16, at 8, 12, 16, 24 and 32 tokens, Q4_K_M 185/324, -, 344/372, 714/532, 1017/432 ms (1.5B
shapes); Q6_K 306/428, 484/444, 572/461, 1076/570, 1532/620; Q8_0 341/518, 472/515, 595/579, 852/677, 861/662;
Q5_K_M 205/393, 290/451, 372/368, 826/559, 692/613; 0.5B Q4_K_M 102/122, 137/133, 161/159, 251/154, 310/165: from
16 rows (`AFFINE_INT8X2_BF16_DENSE_ROWS`). float32 on oneDNN, at 16, 24, 32 and 48: Q4_K_M 557/689, 843/951,
1064/880, 1299/1130; Q6_K 714/719, 1083/914, 1409/916, 2094/1126: from 32. float32 on torch's BLAS
(`ATEN_CPU_CAPABILITY=avx2`, which turns oneDNN's GEMMs off here), at 16, 24, 32 and 64: Q4_K_M 851/826,
1099/892, 1173/813, 2268/1543; Q6_K 816/647, 1260/776, 1974/1151, 3515/1362: from 32 (it was 192). A 512-token
prefill took 3.2-3.6 s on the 1.5B files (bfloat16 GEMMs), 4.1-4.6 s before.

Logits of fewer than `FUSED_ROWS` tokens (a decode step, or a speculative verification of up to 17) come from
the fused decode step where it applies (cpu/fused.py), each row exactly its own one-token step, so a
verification accepts what plain decoding would pick.
"""

from __future__ import annotations

import contextlib
import threading

import torch


DENSE_ROWS = 192  # input rows from which a CPU int4 layer dequantizes and runs one GEMM
DENSE_BLOCK = 4096  # output rows dequantized at a time: a float32 block of a 49152-row head stays ~20 MB
FUSED_ROWS = 32  # logits of fewer tokens than this come from the fused step, row by row
AFFINE_DENSE_ROWS = 96  # input rows from which the affine kernel on float32 inputs takes float32 GEMMs
AFFINE_INT8_DENSE_ROWS = 1 << 62  # on int8 inputs in one pass: never (faster at every length measured, to 2048)
AFFINE_INT8X2_DENSE_ROWS = 32  # on int8 inputs in two passes (the VNNI default), the GEMMs torch's BLAS
AFFINE_INT8X2_ONEDNN_DENSE_ROWS = 32  # the same, the GEMMs on oneDNN in float32
AFFINE_INT8X2_BF16_DENSE_ROWS = 16  # in bfloat16

ALONE = 1 << 62  # as a layer's dense rows: never, each row its own dot products
_rows = threading.local()


@contextlib.contextmanager
def rows_alone():
    """Within it (on this thread), every quantized CPU layer gives each input row the bits it gives that row alone,
    however many rows come, skipping the crossovers above: a batch's rows on the eager layers, each a sequence's
    own decode step, and --deterministic's prompt tokens (from a crossover on, a GEMM's rows take bits that depend
    on their neighbours')."""
    before = alone()
    _rows.alone = True
    try:
        yield
    finally:
        _rows.alone = before


def alone() -> bool:
    """Whether this thread is within `rows_alone`."""
    return getattr(_rows, "alone", False)


def each_row(fn, x):
    """``fn(x)``, an elementwise op over rows along x's first dimension; within `rows_alone`, a row at a time where
    a row is not a whole number of vector loops (32 floats): torch's loops compute what is left past their last
    whole pair of vectors with the op's scalar form, whose transcendental functions round otherwise, and rows
    side by side move that boundary. For rows that are tokens (an MLP's, gemma4's per-layer inputs), not the
    experts' rows, which a lone step computes a token's top k of together."""
    if not alone() or x.shape[-1] % 32 == 0 or x.shape[0] == 1:
        return fn(x)
    return torch.cat([fn(row) for row in x.split(1)])
