// umakit's own CPU kernel for affine-quantized layers of any width (2-8 bits), with float32 activations:
// affine_mm.cpp, and fused_decode.cpp's layers that torch's int4 kernels cannot take.
//
// Its packing ("planes"), per row, 32 weights at a time, exactly `bits` bits a weight: for 4-7 bits a
// 16-byte nibble plane (byte i holds weight i's low four bits in its low nibble and weight i + 16's in its
// high one), then one 32-bit mask per bit above the fourth (bit j of mask k is bit 4 + k of weight j); for
// 2-3 bits the masks alone (mask k: bit k); for 8 bits the 32 codes as bytes. Scales and biases are float16,
// (rows, 2, groups): w = scale * code + bias in each group of 32, 64 or 128 weights along the input; or the
// scales alone, (rows, 1, groups), for a symmetric layer whose every bias is -2^(bits-1) * scale.
#pragma once

#include <ATen/ATen.h>

namespace umakit {

// (M, K) float32 times the concatenated parts (each (N_p, K) in planes) -> (M, sum N_p) float32. Below
// `dense_rows` rows every output row is a dot product of its own, so each row of x gets the bits it gets
// alone; from `dense_rows` rows on, blocks of weights are dequantized once for a float32 GEMM. `inputs`: the
// form x is multiplied in below that: 0, float32, as it is; 1, rounded to bfloat16 (as torch's int4 kernel
// rounds it; parts of at most 6 bits, by AVX512-BF16's vdpbf16ps); 2, int8 in blocks of 32 with a float scale
// each (llama.cpp's Q8_0; by AVX512-VNNI's vpdpbusd). A form the library is not built for is float32.
at::Tensor affine_mm(const at::Tensor& x, at::TensorList codes, at::TensorList sb, at::IntArrayRef bits,
                     at::IntArrayRef groups, int64_t dense_rows, int64_t inputs);

// Bit 0: the AVX-512 loops are built; bit 1: the AVX512-BF16 ones; bit 2: the AVX512-VNNI ones.
int64_t affine_features();

}  // namespace umakit
