"""Where the CPU paths cross over, measured, in one place: the int4 layers, the engine and the fused step read
these.

A CPU int4 layer (quant/kernels.py `Int4PackLinear`) runs torch's kernel, which dequantizes each weight once
per input row: its time is linear in rows from about 4 on. From `DENSE_ROWS` rows on (a prefill) the layer
dequantizes its weight once per call instead, in blocks of `DENSE_BLOCK` output rows, for one float32 GEMM:
1.5-2x faster at 512 rows (benchmarks/cpu_engines.py), slower below. Fewer rows than that (a decode step,
a speculative verification) take the fused decode step where it applies (cpu/fused.py), each row exactly
its own one-token step.
"""

DENSE_ROWS = 32  # input rows from which a CPU int4 layer dequantizes and runs one GEMM
DENSE_BLOCK = 4096  # output rows dequantized at a time: a float32 block of a 49152-row head stays ~20 MB
