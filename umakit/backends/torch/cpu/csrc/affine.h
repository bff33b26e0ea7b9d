// umakit's own CPU kernel for affine-quantized layers of any width (2-8 bits): affine_mm.cpp, and
// fused_decode.cpp's layers that torch's int4 kernels cannot take.
//
// Its packing ("tiles"), exactly `bits` bits a weight: the rows in tiles of 8, each tile's weights in blocks of
// 32 along the input, so that one 256-bit register holds 4 consecutive weights of each of the tile's 8 rows
// (byte 4r + i: row r, weight 4c + i of the block, for the block's chunks c = 0..7). The outputs of 8 rows then
// accumulate in the lanes of one register, with no reduction across lanes. A tile-block (256 weights, 32 * bits
// bytes) holds its codes in planes, lowest bits first: for 8 bits, its 8 chunks as bytes; otherwise a 128-byte
// nibble plane for bits 0-3 where bits >= 4 (chunk c's in the low nibbles of the 32 bytes at 32 (c % 4), in the
// high nibbles for c >= 4), then a 64-byte crumb plane for the next 2 bits where 2 or more remain (byte l of its
// half h: chunk 4h + i's 2 bits of lane l at bits 2i, 2i + 1), then a 32-byte bit plane for a last single bit
// (byte l: chunk c's bit of lane l at bit c). So 6 = 4 + 2, 5 = 4 + 1, 3 = 2 + 1, 2 = 2; each plane decodes with a
// shift, a mask and an or per chunk. Codes are (rows, K * bits / 8) uint8, rows a multiple of 8, tile after tile.
// Scales and biases are float16, (rows / 8, groups, 2, 8): each tile's 8 scales, then its 8 biases, per group of
// 16, 32, 64 or 128 weights along the input (w = scale * code + bias); or the scales alone, (rows / 8, groups, 1,
// 8), for a symmetric layer whose every bias is -2^(bits-1) * scale. Or coded, as a GGUF's K-quants hold them
// (cpu/scale_codes.py): uint8 (rows / 8, super-blocks, planes * (16 + 8 * per)), per tile and super-block of `per`
// groups its planes' 8 float16 factors each, then per group its planes' 8 int8 codes each; a scale (bias) is
// factor * code, in float32.
#pragma once

#include <ATen/ATen.h>

namespace umakit {

// (M, K) float32 times the concatenated parts (each (N_p, K) in tiles) -> (M, sum N_p) float32. Below
// `dense_rows` rows every output is a dot product of its own, so each row of x gets the bits it gets alone;
// from `dense_rows` rows on, slabs of weights are dequantized once for GEMMs. `inputs`: the form x is
// multiplied in below that: 0, float32, as it is; 2, int8 in blocks of 32 with a float scale each (llama.cpp's
// Q8_0; by AVX512-VNNI's vpdpbusd, else AVX2's vpmaddubsw, an 8-bit part then in float32); 3, that plus the
// remainder of its rounding in int8 blocks again, a second pass (15 bits of each block's largest value). A form
// the library is not built for is float32. Or'ed into it, for the GEMMs: 16, in bfloat16 (x and the weights
// rounded, float32 sums, each output rounded once); 32, float32 ones on oneDNN (`gemm_f32`); 64, with 16, the
// bfloat16 GEMMs on AMX tiles where `amx_ready` (float32 outputs, not rounded).
at::Tensor affine_mm(const at::Tensor& x, at::TensorList codes, at::TensorList sb, at::IntArrayRef bits,
                     at::IntArrayRef groups, int64_t dense_rows, int64_t inputs);

// Row i of x (P, K) times part i alone (P parts of one width n) -> (P, n) float32, each row as affine_mm gives it
// alone below `dense_rows`: a decode step's experts, whose inputs differ, in one call.
at::Tensor affine_mm_each(const at::Tensor& x, at::TensorList codes, at::TensorList sb, at::IntArrayRef bits,
                          at::IntArrayRef groups, int64_t inputs);

// One tile-block's codes in the planes above, from its lanes: lane[c][l] is chunk c's lane l (row l / 4's code
// 4c + l % 4 of the block); 32 * bits bytes into `o` (affine_planes', and gguf_blocks.cpp's from a GGUF's blocks).
void tile_lanes(const uint8_t lane[8][32], int64_t bits, uint8_t* o);

// Bit 0: the AVX-512 loops are built; bit 1: the vector loops (AVX2, FMA, F16C), without which it is a scalar
// loop; bit 2: AVX512-VNNI's dot products; bit 3: int8 inputs (forms 2 and 3); bit 4: AMX tiles (amx.cpp), built
// and granted by Linux.
int64_t affine_features();

// The bfloat16 GEMMs on AMX tiles (amx.cpp). `amx_ready`: built with AMX and the tiles' state granted (asked
// once). `amx_inputs`: x (M, K) bfloat16 laid out as the tiles' right operand, `amx_inputs_size(M, K)` values
// (M padded to 16 rows with zeros). `amx_gemm`: y[m, j] = sum_k x[m, k] w[j, k] as float32 for j < n, into y's
// rows `ldy` apart, from w's bfloat16 rows (K a multiple of 32; w readable to a multiple of 32 rows).
bool amx_ready();
int64_t amx_inputs_size(int64_t M, int64_t K);
void amx_inputs(const uint16_t* x, int64_t M, int64_t K, uint16_t* xv);
void amx_gemm(const uint16_t* xv, int64_t M, const uint16_t* w, int64_t n, int64_t K, float* y, int64_t ldy);

// (M, K) times (N, K) transposed, float32 in and out: with `onednn`, oneDNN's GEMM where torch exports it and the
// CPU passes its checks (faster than torch's BLAS on AMD's AVX-512 CPUs), else at::mm (gemm.cpp).
at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& w, bool onednn);

// Whether `gemm_f32` runs on oneDNN here (with torch's oneDNN enabled, `torch.backends.mkldnn.enabled`).
bool gemm_onednn();

}  // namespace umakit
