// umakit's CPU kernel for affine-quantized layers of 2 to 8 bits (see affine.h for the packing): the layers
// torch's int4 kernels cannot hold without reading more bytes than the checkpoint has (3, 5, 6 and 8 bits,
// and 4-bit parts beside them in one projection).
//
// A row's dot product with x is, per group g of its weights, scale_g * sum_j code_j x_j + bias_g * sum_j x_j:
// the codes are widened to float32 and multiplied by x exactly as a dequantize-then-matmul would, with one
// scale multiply per group, and the biases meet precomputed group sums of x. The only rounding apart from
// float32's own is the float16 of scales and biases. With AVX-512 the codes of 16 weights become floats in a
// few instructions (a nibble plane widened, each further bit set under a mask); elsewhere a scalar loop.
#include "affine.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define UMAKIT_AVX512 1
#if defined(__AVX512BF16__)
#define UMAKIT_BF16 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define UMAKIT_VNNI 1
#endif
#endif

namespace {

using at::Half;
using at::Tensor;

constexpr int64_t BLOCK = 32;  // weights a block of the planes holds
constexpr int64_t TILE = 4;    // rows of x that share one decoding of a weight block
#ifdef UMAKIT_AVX512
constexpr bool kAVX512 = true;
#else
constexpr bool kAVX512 = false;
#endif
#ifdef UMAKIT_BF16
constexpr bool kBF16 = true;
#else
constexpr bool kBF16 = false;
#endif
#ifdef UMAKIT_VNNI
constexpr bool kVNNI = true;
#else
constexpr bool kVNNI = false;
#endif
constexpr int64_t FLOAT32 = 0, BFLOAT16 = 1, INT8 = 2;  // the forms x is multiplied in (affine.h)

// x as the parts multiply it: as is; rounded to bfloat16; or in int8 blocks of 32, block b of row m being
// dx[m * K / 32 + b] * xq[m * K + 32 b ...].
struct Inputs {
  const float* x;
  const uint16_t* xb;
  const int8_t* xq;
  const float* dx;
};

inline uint32_t load32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The 32 codes of one block of planes.
inline void codes_of(const uint8_t* p, int bits, int32_t* out) {
  if (bits == 8) {
    for (int j = 0; j < 32; ++j) out[j] = p[j];
    return;
  }
  int first = 0;
  const uint8_t* masks = p;
  if (bits >= 4) {
    for (int j = 0; j < 16; ++j) {
      out[j] = p[j] & 15;
      out[j + 16] = p[j] >> 4;
    }
    first = 4;
    masks = p + 16;
  } else {
    std::fill(out, out + 32, 0);
  }
  for (int k = 0; k < bits - first; ++k) {
    const uint32_t w = load32(masks + 4 * k);
    for (int j = 0; j < 32; ++j) out[j] |= static_cast<int32_t>((w >> j) & 1) << (first + k);
  }
}

void to_floats(const Half* h, float* f, int64_t n);

// One part of a layer: (rows, K) weights in planes, their float16 (rows, 2, groups) scales and biases, or
// (rows, 1, groups) scales alone where every bias is -2^(bits-1) times its scale (a symmetric layer: a GGUF's
// Q4_0, Q5_0, Q8_0), which the kernel recomputes exactly instead of reading.
struct Part {
  const uint8_t* codes;
  const Half* sb;
  int64_t rows, bits, group, groups, row_bytes, col, planes;  // col: where its outputs start in y; planes: 1 or 2
};

// A row's scales and biases as float32, into sb (2 * groups): scales, then biases.
void row_scales(const Part& p, int64_t n, float* sb) {
  to_floats(p.sb + n * p.planes * p.groups, sb, p.planes * p.groups);
  if (p.planes == 1) {
    const float offset = -static_cast<float>(int64_t{1} << (p.bits - 1));
    for (int64_t g = 0; g < p.groups; ++g) sb[p.groups + g] = offset * sb[g];
  }
}

void to_floats(const Half* h, float* f, int64_t n) {
#ifdef UMAKIT_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(f + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h + i)));
  }
#else
  for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(h[i]);
#endif
}

#ifdef UMAKIT_AVX512
// sum_g a[g] * b[g] over n groups, in 16 lanes (the same order whatever the row).
inline float group_dot(const float* a, const float* b, int64_t n) {
  __m512 t = _mm512_setzero_ps();
  for (int64_t g = 0; g < n; g += 16) {
    const __mmask16 mk = n - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - g)) - 1);
    t = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, a + g), _mm512_maskz_loadu_ps(mk, b + g), t);
  }
  return _mm512_reduce_add_ps(t);
}

template <int BITS>
inline void decode(const uint8_t* p, __m512& f0, __m512& f1) {
  __m512i v0, v1;
  if constexpr (BITS == 8) {
    v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else {
    constexpr int FIRST = BITS >= 4 ? 4 : 0;
    if constexpr (BITS >= 4) {
      const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      v0 = _mm512_and_si512(n, _mm512_set1_epi32(15));
      v1 = _mm512_srli_epi32(n, 4);
    } else {
      v0 = v1 = _mm512_setzero_si512();
    }
    const uint8_t* masks = p + (BITS >= 4 ? 16 : 0);
    for (int k = 0; k < BITS - FIRST; ++k) {
      const uint32_t w = load32(masks + 4 * k);
      const __m512i bit = _mm512_set1_epi32(1 << (FIRST + k));
      v0 = _mm512_mask_or_epi32(v0, static_cast<__mmask16>(w), v0, bit);
      v1 = _mm512_mask_or_epi32(v1, static_cast<__mmask16>(w >> 16), v1, bit);
    }
  }
  f0 = _mm512_cvtepi32_ps(v0);
  f1 = _mm512_cvtepi32_ps(v1);
}

// Outputs of one weight row for TM rows of x; each x row's arithmetic is the same whatever TM is. Each row
// keeps CHAINS accumulators, group g adding to chain g % CHAINS, so consecutive groups' scale multiplies do not
// wait on each other (one chain held a row to a group per FMA latency).
constexpr int CHAINS = 4;

template <int BITS, int TM>
void dot_rows(const Part& p, const uint8_t* codes, const float* scale, const float* bias, const float* x,
              const float* xsum, int64_t K, float* y, int64_t ldy) {
  __m512 acc[TM][CHAINS];
  for (int m = 0; m < TM; ++m)
    for (int c = 0; c < CHAINS; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t blocks = p.group / BLOCK;
  const uint8_t* c = codes;
  for (int64_t g = 0, k = 0; g < p.groups; ++g) {
    __m512 d[TM];
    for (int m = 0; m < TM; ++m) d[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, k += BLOCK, c += 4 * BITS) {
      __m512 q0, q1;
      decode<BITS>(c, q0, q1);
      for (int m = 0; m < TM; ++m) {
        d[m] = _mm512_fmadd_ps(q0, _mm512_loadu_ps(x + m * K + k), d[m]);
        d[m] = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + m * K + k + 16), d[m]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale[g]);
    for (int m = 0; m < TM; ++m) acc[m][g % CHAINS] = _mm512_fmadd_ps(d[m], s, acc[m][g % CHAINS]);
  }
  for (int m = 0; m < TM; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    y[m * ldy] = _mm512_reduce_add_ps(sum) + group_dot(bias, xsum + m * p.groups, p.groups);
  }
}

#endif

#ifdef UMAKIT_BF16
// 32 codes (at most 6 bits) as the bfloat16 values 128 + code: 0x4300 is 128's bits, and a code below 128 is
// exactly its mantissa, so no conversion instruction is needed; the 128s come off with the biases.
template <int BITS>
inline __m512bh decode_bf16(const uint8_t* p) {
  const __m256i magic = _mm256_set1_epi16(0x4300);
  __m512i w;
  if constexpr (BITS >= 4) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(15)), magic);
    const __m256i hi = _mm256_or_si256(_mm256_srli_epi16(v, 4), magic);
    w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    w = _mm512_set1_epi16(0x4300);
  }
  constexpr int FIRST = BITS >= 4 ? 4 : 0;
  const uint8_t* masks = p + (BITS >= 4 ? 16 : 0);
  for (int k = 0; k < BITS - FIRST; ++k)  // the bit is clear before: adding sets it
    w = _mm512_mask_add_epi16(w, static_cast<__mmask32>(load32(masks + 4 * k)), w,
                              _mm512_set1_epi16(static_cast<int16_t>(1 << (FIRST + k))));
  return reinterpret_cast<__m512bh>(w);
}

// dot_rows with x rounded to bfloat16 (xb) and the products summed by vdpbf16ps, pairs of weights at a time;
// xsum holds the sums of the rounded x. y = sum_g s_g * sum_j (128 + q_j) x_j + (b_g - 128 s_g) * xsum_g.
template <int BITS, int TM>
void dot_rows_bf16(const Part& p, const uint8_t* codes, const float* scale, const float* bias, const uint16_t* xb,
                   const float* xsum, int64_t K, float* y, int64_t ldy) {
  __m512 acc[TM][CHAINS];
  for (int m = 0; m < TM; ++m)
    for (int c = 0; c < CHAINS; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t blocks = p.group / BLOCK;
  const uint8_t* c = codes;
  for (int64_t g = 0, k = 0; g < p.groups; ++g) {
    __m512 d[TM];
    for (int m = 0; m < TM; ++m) d[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, k += BLOCK, c += 4 * BITS) {
      const __m512bh w = decode_bf16<BITS>(c);
      for (int m = 0; m < TM; ++m)
        d[m] = _mm512_dpbf16_ps(d[m], w, reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + m * K + k)));
    }
    const __m512 s = _mm512_set1_ps(scale[g]);
    for (int m = 0; m < TM; ++m) acc[m][g % CHAINS] = _mm512_fmadd_ps(d[m], s, acc[m][g % CHAINS]);
  }
  for (int m = 0; m < TM; ++m) {
    const float* xs = xsum + m * p.groups;
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    y[m * ldy] = _mm512_reduce_add_ps(sum) + group_dot(bias, xs, p.groups) - 128.0f * group_dot(scale, xs, p.groups);
  }
}

#endif

#ifdef UMAKIT_VNNI
// The 32 codes of a block as unsigned bytes, in order.
template <int BITS>
inline __m256i codes_u8(const uint8_t* p) {
  if constexpr (BITS == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i v = _mm256_setzero_si256();
  if constexpr (BITS >= 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(15);
    v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
  }
  constexpr int FIRST = BITS >= 4 ? 4 : 0;
  const uint8_t* masks = p + (BITS >= 4 ? 16 : 0);
  for (int k = 0; k < BITS - FIRST; ++k)  // the bit is clear before: adding sets it
    v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(load32(masks + 4 * k)), v,
                             _mm256_set1_epi8(static_cast<char>(1 << (FIRST + k))));
  return v;
}

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// dot_rows with x in int8 blocks (Inputs): each block's 32 products summed in int32 by vpdpbusd (unsigned codes
// times signed inputs), then scaled by the block's scale times the weights' group scale; the biases meet the
// float32 sums of x. The error is that of the codes centred, (code - c) * (rounded x - x) with c = 2^(bits-1),
// as llama.cpp's symmetric blocks have it, not code * (rounded x - x), twice as large: xdiff holds each group's
// sum of x minus the sum of its rounded values, and c * scale * xdiff goes back in.
template <int BITS, int TM>
void dot_rows_i8(const Part& p, const uint8_t* codes, const float* scale, const float* bias, const int8_t* xq,
                 const float* dx, const float* xsum, const float* xdiff, int64_t K, float* y, int64_t ldy) {
  __m256 acc[TM][CHAINS];
  for (int m = 0; m < TM; ++m)
    for (int c = 0; c < CHAINS; ++c) acc[m][c] = _mm256_setzero_ps();
  const int64_t blocks = K / BLOCK, per = p.group / BLOCK;
  const uint8_t* c = codes;
  for (int64_t b = 0; b < blocks; ++b, c += 4 * BITS) {
    const __m256i q = codes_u8<BITS>(c);
    const float s = scale[b / per];
    for (int m = 0; m < TM; ++m) {
      const __m256i x8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * BLOCK));
      const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x8);
      acc[m][b % CHAINS] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s * dx[m * blocks + b]),
                                           acc[m][b % CHAINS]);
    }
  }
  const float centre = static_cast<float>(1 << (BITS - 1));
  for (int m = 0; m < TM; ++m) {
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
    y[m * ldy] = hsum(sum) + group_dot(bias, xsum + m * p.groups, p.groups) +
                 centre * group_dot(scale, xdiff + m * p.groups, p.groups);
  }
}

#endif

// The same sums in plain C++, in the same order per x row (a different rounding from the AVX-512 lanes').
void dot_rows_scalar(const Part& p, const uint8_t* codes, const float* scale, const float* bias, const float* x,
                     const float* xsum, int64_t M, int64_t K, float* y, int64_t ldy) {
  const int64_t blocks = p.group / BLOCK;
  int32_t q[BLOCK];
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    const uint8_t* c = codes;
    float acc = 0, t = 0;
    for (int64_t g = 0, k = 0; g < p.groups; ++g) {
      float d = 0;
      for (int64_t b = 0; b < blocks; ++b, k += BLOCK, c += 4 * p.bits) {
        codes_of(c, static_cast<int>(p.bits), q);
        for (int j = 0; j < BLOCK; ++j) d += static_cast<float>(q[j]) * xm[k + j];
      }
      acc += d * scale[g];
      t += bias[g] * xsum[m * p.groups + g];
    }
    y[m * ldy] = acc + t;
  }
}

// f(std::integral_constant<int, B>) for the part's width B: each width's loops compiled apart.
template <typename F>
bool with_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

// f(std::integral_constant<int, TM>, m) over x's rows m in tiles of TILE, then the 1-3 left.
template <typename F>
void over_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + TILE <= M; m += TILE) f(std::integral_constant<int, TILE>{}, m);
  switch (M - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Rows [n0, n1) of a part, x multiplied in `form` (Inputs; xsum sums what is multiplied, except in int8, where
// it sums x itself and xdiff what rounding took off).
void part_rows(const Part& p, int64_t n0, int64_t n1, const Inputs& in, int64_t form, const float* xsum,
               const float* xdiff, int64_t M, int64_t K, float* y, int64_t ldy) {
  const float* x = in.x;
  const int64_t G = p.groups, blocks = K / BLOCK;
  std::vector<float> sb(2 * G);
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(p, n, sb.data());
    const float *scale = sb.data(), *bias = sb.data() + G;
    const uint8_t* codes = p.codes + n * p.row_bytes;
    float* out = y + p.col + n;
#ifdef UMAKIT_AVX512
    const bool done = with_bits(p.bits, [&](auto width) {
      constexpr int B = decltype(width)::value;
      over_tiles(M, [&](auto tile, int64_t m) {
        constexpr int TM = decltype(tile)::value;
#ifdef UMAKIT_VNNI
        if (form == INT8)
          return dot_rows_i8<B, TM>(p, codes, scale, bias, in.xq + m * K, in.dx + m * blocks, xsum + m * G,
                                    xdiff + m * G, K, out + m * ldy, ldy);
#endif
#ifdef UMAKIT_BF16
        if constexpr (B <= 6)
          if (form == BFLOAT16)
            return dot_rows_bf16<B, TM>(p, codes, scale, bias, in.xb + m * K, xsum + m * G, K, out + m * ldy, ldy);
#endif
        dot_rows<B, TM>(p, codes, scale, bias, x + m * K, xsum + m * G, K, out + m * ldy, ldy);
      });
    });
    if (done) continue;
#endif
    dot_rows_scalar(p, codes, scale, bias, x, xsum, M, K, out, ldy);
  }
}

// Weights [n0, n1) of a part as float32 (n1 - n0, K): scale * code + bias.
void dequantize_rows(const Part& p, int64_t n0, int64_t n1, int64_t K, float* w) {
  std::vector<float> sb(2 * p.groups);
  int32_t q[BLOCK];
  for (int64_t n = n0; n < n1; ++n) {
    row_scales(p, n, sb.data());
    const uint8_t* c = p.codes + n * p.row_bytes;
    float* row = w + (n - n0) * K;
    for (int64_t k = 0; k < K; k += BLOCK, c += 4 * p.bits) {
      const int64_t g = k / p.group;
      codes_of(c, static_cast<int>(p.bits), q);
      for (int j = 0; j < BLOCK; ++j) row[k + j] = static_cast<float>(q[j]) * sb[g] + sb[p.groups + g];
    }
  }
}

// Blocks of 32 floats as int8 and a scale each (max |x| / 127, rounded to nearest): llama.cpp's Q8_0.
void quantize_rows(const float* x, int64_t blocks, int8_t* q, float* d) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * BLOCK;
    float amax = 0;
    for (int j = 0; j < BLOCK; ++j) amax = std::max(amax, std::fabs(v[j]));
    d[b] = amax / 127.0f;
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    for (int j = 0; j < BLOCK; ++j) q[b * BLOCK + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
  }
}

std::vector<Part> parts_of(at::TensorList codes, at::TensorList sb, at::IntArrayRef bits, at::IntArrayRef groups,
                           int64_t K) {
  TORCH_CHECK(!codes.empty() && codes.size() == sb.size() && codes.size() == bits.size() &&
                  codes.size() == groups.size(), "one codes, sb, bits and group for each part");
  TORCH_CHECK(K % BLOCK == 0, "the input width must be a multiple of ", BLOCK);
  std::vector<Part> parts;
  int64_t col = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const int64_t b = bits[i], g = groups[i], rows = codes[i].size(0);
    TORCH_CHECK(b >= 2 && b <= 8 && b != 7, "bits must be 2, 3, 4, 5, 6 or 8, not ", b);
    TORCH_CHECK(g % BLOCK == 0 && K % g == 0, "group ", g, " must be a multiple of 32 dividing ", K);
    TORCH_CHECK(codes[i].scalar_type() == at::kByte && codes[i].is_contiguous() && codes[i].dim() == 2 &&
                    codes[i].size(1) == K * b / 8, "part ", i, ": codes must be contiguous uint8 (rows, K*bits/8)");
    const int64_t planes = sb[i].dim() == 3 ? sb[i].size(1) : 0;
    TORCH_CHECK(sb[i].scalar_type() == at::kHalf && sb[i].is_contiguous() && (planes == 1 || planes == 2) &&
                    sb[i].size(0) == rows && sb[i].size(2) == K / g,
                "part ", i, ": scales and biases must be contiguous float16 (rows, 2 or 1, K/group)");
    parts.push_back({codes[i].data_ptr<uint8_t>(), sb[i].data_ptr<Half>(), rows, b, g, K / g, K * b / 8, col, planes});
    col += rows;
  }
  return parts;
}

}  // namespace

namespace umakit {

Tensor affine_mm(const Tensor& x_in, at::TensorList codes, at::TensorList sb, at::IntArrayRef bits,
                 at::IntArrayRef groups, int64_t dense_rows, int64_t inputs) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "x must be float32 (rows, K)");
  const Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<Part> parts = parts_of(codes, sb, bits, groups, K);
  const int64_t N = parts.back().col + parts.back().rows;
  Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (M >= dense_rows) {  // a long prefill: dequantize blocks of rows once, then float32 GEMMs
    for (const Part& p : parts) {
      const int64_t block = std::max<int64_t>(64, (int64_t{8} << 20) / (4 * K));
      for (int64_t n0 = 0; n0 < p.rows; n0 += block) {
        const int64_t n1 = std::min(p.rows, n0 + block);
        Tensor w = at::empty({n1 - n0, K}, x.options());
        at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
          dequantize_rows(p, a, b, K, w.data_ptr<float>() + (a - n0) * K);
        });
        y.narrow(1, p.col + n0, n1 - n0).copy_(at::mm(x, w.t()));
      }
    }
    return y;
  }
  // the form each part multiplies x in: bfloat16 for at most 6 bits (128 + code must be exact), int8 for any
  const int64_t form = inputs == BFLOAT16 && kBF16 ? BFLOAT16 : inputs == INT8 && kVNNI ? INT8 : FLOAT32;
  std::vector<int64_t> forms;
  for (const Part& p : parts) forms.push_back(form == BFLOAT16 && p.bits > 6 ? FLOAT32 : form);
  const Tensor xr = form == BFLOAT16 ? x.to(at::kBFloat16) : Tensor();  // as torch rounds: to nearest, ties even
  const Tensor xs = form == BFLOAT16 ? xr.to(at::kFloat) : x;  // the values the bfloat16 products see
  std::vector<int8_t> xq(form == INT8 ? M * K : 0);
  std::vector<float> dx(form == INT8 ? M * K / BLOCK : 0);
  if (form == INT8) quantize_rows(x.data_ptr<float>(), M * K / BLOCK, xq.data(), dx.data());
  const Inputs in{x.data_ptr<float>(),
                  form == BFLOAT16 ? reinterpret_cast<const uint16_t*>(xr.data_ptr<at::BFloat16>()) : nullptr,
                  xq.data(), dx.data()};
  // the sums of what each part multiplies over its groups, (M, K / group); in int8, the sums of x less those of
  // its rounded values too
  std::vector<std::vector<float>> sums, diffs;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    const float* xp = (forms[i] == BFLOAT16 ? xs : x).data_ptr<float>();
    std::vector<float> s(M * p.groups, 0.0f), d(forms[i] == INT8 ? M * p.groups : 0, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < p.groups; ++g) {
        float t = 0, r = 0;
        for (int64_t j = 0; j < p.group; ++j) {
          const int64_t k = m * K + g * p.group + j;
          t += xp[k];
          if (forms[i] == INT8) r += xp[k] - dx[k / BLOCK] * xq[k];
        }
        s[m * p.groups + g] = t;
        if (forms[i] == INT8) d[m * p.groups + g] = r;
      }
    sums.push_back(std::move(s));
    diffs.push_back(std::move(d));
  }
  at::parallel_for(0, N, 8, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      const int64_t lo = std::max(a, p.col), hi = std::min(b, p.col + p.rows);
      if (lo < hi)
        part_rows(p, lo - p.col, hi - p.col, in, forms[i], sums[i].data(), diffs[i].data(), M, K,
                  y.data_ptr<float>(), N);
    }
  });
  return y;
}

int64_t affine_features() { return (kAVX512 ? 1 : 0) | (kBF16 ? 2 : 0) | (kVNNI ? 4 : 0); }

// MLX's packing (rows, K*bits/32 uint32: code j at bits [j*bits, (j+1)*bits) of the row) -> planes.
Tensor affine_planes(const Tensor& weight, int64_t bits) {
  TORCH_CHECK(bits >= 2 && bits <= 8 && bits != 7, "bits must be 2, 3, 4, 5, 6 or 8, not ", bits);
  const Tensor w = weight.contiguous().view(at::kByte);
  const int64_t rows = w.size(0), row_bytes = w.size(1), K = row_bytes * 8 / bits;
  TORCH_CHECK(K % BLOCK == 0, "the input width must be a multiple of ", BLOCK);
  Tensor out = at::empty({rows, row_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t step = 4 * bits;  // bytes of 32 codes, in either packing
  at::parallel_for(0, rows, 64, [&](int64_t a, int64_t b) {
    uint8_t buf[40];
    int32_t c[BLOCK];
    for (int64_t r = a; r < b; ++r)
      for (int64_t k = 0; k < K; k += BLOCK) {
        const int64_t at_byte = r * row_bytes + k / BLOCK * step;
        std::memset(buf, 0, sizeof(buf));
        std::memcpy(buf, src + at_byte, step);
        for (int j = 0; j < BLOCK; ++j) {
          uint64_t word;
          std::memcpy(&word, buf + j * bits / 8, 8);
          c[j] = static_cast<int32_t>((word >> (j * bits % 8)) & ((1u << bits) - 1));
        }
        uint8_t* o = dst + at_byte;
        if (bits == 8) {
          for (int j = 0; j < BLOCK; ++j) o[j] = static_cast<uint8_t>(c[j]);
          continue;
        }
        const int first = bits >= 4 ? 4 : 0;
        if (bits >= 4) {
          for (int j = 0; j < 16; ++j) o[j] = static_cast<uint8_t>((c[j] & 15) | ((c[j + 16] & 15) << 4));
          o += 16;
        }
        for (int kk = 0; kk < bits - first; ++kk) {
          uint32_t mask = 0;
          for (int j = 0; j < BLOCK; ++j) mask |= static_cast<uint32_t>((c[j] >> (first + kk)) & 1) << j;
          std::memcpy(o + 4 * kk, &mask, 4);
        }
      }
  });
  return out;
}

Tensor affine_dequantize(const Tensor& codes, const Tensor& sb, int64_t bits, int64_t group) {
  const int64_t K = codes.size(1) * 8 / bits;
  const std::vector<Part> parts = parts_of({codes}, {sb}, {bits}, {group}, K);
  Tensor w = at::empty({codes.size(0), K}, codes.options().dtype(at::kFloat));
  at::parallel_for(0, codes.size(0), 16, [&](int64_t a, int64_t b) {
    dequantize_rows(parts[0], a, b, K, w.data_ptr<float>() + a * K);
  });
  return w;
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("affine_mm(Tensor x, Tensor[] codes, Tensor[] sb, int[] bits, int[] groups, int dense_rows, "
        "int inputs) -> Tensor");
  m.def("affine_features() -> int");
  m.def("affine_planes(Tensor weight, int bits) -> Tensor");
  m.def("affine_dequantize(Tensor codes, Tensor sb, int bits, int group) -> Tensor");
  m.impl("affine_mm", c10::DispatchKey::CPU, TORCH_FN(umakit::affine_mm));
  m.impl("affine_planes", c10::DispatchKey::CPU, TORCH_FN(umakit::affine_planes));
  m.impl("affine_features", c10::DispatchKey::CatchAll, TORCH_FN(umakit::affine_features));
  m.impl("affine_dequantize", c10::DispatchKey::CPU, TORCH_FN(umakit::affine_dequantize));
}
