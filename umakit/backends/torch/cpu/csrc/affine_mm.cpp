// umakit's CPU kernel for affine-quantized layers of 2 to 8 bits (see affine.h for the packing): the layers
// torch's int4 kernels cannot hold without reading more bytes than the checkpoint has (3, 5, 6 and 8 bits,
// and 4-bit parts beside them in one projection).
//
// A row's dot product with x is, per group g of its weights, scale_g * sum_j code_j x_j + bias_g * sum_j x_j:
// the biases meet precomputed group sums of x, and one scale multiply serves a group. The rows are in tiles of
// 8 whose outputs accumulate in the 8 lanes of a register: a block of 32 weights of 8 rows is decoded into 8
// registers of bytes (its nibble, crumb and bit planes shifted into place), then met by x's 32 values 4 at a time,
// broadcast: on int8 inputs by vpdpbusd (AVX512-VNNI) or by vpmaddubsw and vpmaddwd (AVX2), else widened to
// float32 for FMAs. No lane is ever summed across, and every instruction does 8 rows' work. The loops need AVX2,
// FMA and F16C (256-bit registers throughout); VNNI adds its dot products. Elsewhere a scalar loop. Groups of 16
// (a GGUF's Q6_K) split a block's chunks in two halves, each with its own scale.
#include "affine.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define UMAKIT_SIMD 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define UMAKIT_AVX512 1
#if defined(__AVX512VNNI__)
#define UMAKIT_VNNI 1
#endif
#endif
#endif

// For the loops of a tile: GCC left some out of line (a call per block or group, with vzeroupper and the sums
// through memory around it), which cost a decode step of a Q4_K_M file a quarter of its time.
#define UMAKIT_INLINE __attribute__((always_inline)) inline

namespace {

using at::Half;
using at::Tensor;

constexpr int64_t BLOCK = 32;  // weights of a row in a block
constexpr int64_t ROWS = 8;    // rows in a tile
constexpr int64_t XTILE = 4;   // rows of x that share one decoding of a tile-block
// Bytes ahead of a tile-block that its loop asks the caches for (a prefetch never faults, past the end too). The
// hardware's own prefetching left a decode step waiting on memory: with it, 1.3-1.6x the tokens a second on
// K-quant and Q8_0 files (1,024 bytes gained less, 4,096 no more; docs/performance.md).
constexpr int64_t AHEAD = 2048;
#ifdef UMAKIT_SIMD
constexpr bool kSIMD = true;
#else
constexpr bool kSIMD = false;
#endif
#ifdef UMAKIT_AVX512
constexpr bool kAVX512 = true;
#else
constexpr bool kAVX512 = false;
#endif
#ifdef UMAKIT_VNNI
constexpr bool kVNNI = true;
#else
constexpr bool kVNNI = false;
#endif
constexpr int64_t FLOAT32 = 0, INT8 = 2, INT8X2 = 3;  // the forms x is multiplied in (affine.h)
// or'ed into them: the GEMMs in bfloat16, float32 ones on oneDNN (gemm.cpp), the bfloat16 ones on AMX tiles (amx.cpp)
constexpr int64_t DENSE_BF16 = 16, DENSE_ONEDNN = 32, DENSE_AMX = 64;

// x as the parts multiply it: as is, or in int8 blocks of 32, block b of row m being dx[m * K / 32 + b] *
// xq[m * K + 32 b ...], plus, in two passes, the remainder in int8 blocks again (xq2, dx2).
struct Inputs {
  const float* x;
  const int8_t *xq, *xq2;
  const float *dx, *dx2;
};

inline uint32_t load32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The code of weight j of row r in a tile-block: its planes (affine.h) from the lowest bits up.
inline int code_at(const uint8_t* tb, int bits, int r, int j) {
  const int c = j / 4, lane = 4 * r + j % 4;
  if (bits == 8) return tb[32 * c + lane];
  int v = 0, shift = 0;
  const uint8_t* plane = tb;
  if (bits >= 4) {
    const uint8_t b = tb[32 * (c % 4) + lane];
    v = c < 4 ? b & 15 : b >> 4;
    shift = 4;
    plane += 128;
  }
  if (bits - shift >= 2) {
    v |= ((plane[32 * (c / 4) + lane] >> (2 * (c % 4))) & 3) << shift;
    shift += 2;
    plane += 64;
  }
  if (bits - shift == 1) v |= ((plane[lane] >> c) & 1) << shift;
  return v;
}

// One part of a layer: (rows, K) weights in tiles, and its scales (affine.h) as float16, (rows / 8, groups, 2, 8)
// scales and biases or (rows / 8, groups, 1, 8) scales alone where every bias is -2^(bits-1) times its scale (a
// symmetric layer: a GGUF's Q4_0, Q5_0, Q8_0, Q6_K), which the kernel recomputes exactly instead of reading; or
// coded (`coded`), as the K-quants hold them: per tile and super-block of `per_super` groups, the planes' 8
// float16 factors each, then per group the planes' 8 int8 codes each, a scale (bias) being factor * code.
struct Part {
  const uint8_t* codes;
  const Half* sb;          // float16 scales and biases, or null
  const uint8_t* coded;    // coded ones, or null
  int64_t rows, bits, group, groups, col, planes;  // col: where its outputs start in y; planes: 1 or 2
  int64_t per_super, super_bytes;                  // coded: groups a super-block, its bytes

  const uint8_t* tile(int64_t t, int64_t K) const { return codes + t * K * bits; }
  const Half* tile_sb(int64_t t, int64_t g) const { return sb + (t * groups + g) * planes * ROWS; }
  // coded: group g's super-block of tile t (its factors), and the group's codes in it
  const uint8_t* super(int64_t t, int64_t g) const {
    return coded + (t * (groups / per_super) + g / per_super) * super_bytes;
  }
  const int8_t* group_codes(const uint8_t* sup, int64_t g) const {
    return reinterpret_cast<const int8_t*>(sup + planes * ROWS * 2 + (g % per_super) * planes * ROWS);
  }
};

// A tile's 8 scales and 8 biases of group g as float32.
void tile_scales(const Part& p, int64_t t, int64_t g, float* s, float* b) {
  const float offset = -static_cast<float>(int64_t{1} << (p.bits - 1));
  if (p.coded) {
    const uint8_t* sup = p.super(t, g);
    const Half* f = reinterpret_cast<const Half*>(sup);
    const int8_t* c = p.group_codes(sup, g);
    for (int r = 0; r < ROWS; ++r) {
      s[r] = static_cast<float>(f[r]) * static_cast<float>(c[r]);
      b[r] = p.planes == 2 ? static_cast<float>(f[ROWS + r]) * static_cast<float>(c[ROWS + r]) : offset * s[r];
    }
    return;
  }
  const Half* h = p.tile_sb(t, g);
  for (int r = 0; r < ROWS; ++r) {
    s[r] = static_cast<float>(h[r]);
    b[r] = p.planes == 2 ? static_cast<float>(h[ROWS + r]) : offset * s[r];
  }
}

#ifdef UMAKIT_SIMD
inline __m256 halves8(const Half* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
inline __m256 codes8(const int8_t* c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}

// tile_scales in registers, a tile's groups in order (lane r row r): the float16 pairs, or each super-block's
// factors times the group's codes, stepped through without a division per group.
struct GroupScales {
  const Part& p;
  const Half* h;
  const uint8_t* sup;
  int64_t in = 0;  // the group's place in its super-block

  GroupScales(const Part& part, int64_t t)
      : p(part),
        h(part.sb ? part.tile_sb(t, 0) : nullptr),
        sup(part.coded ? part.super(t, 0) : nullptr) {}

  UMAKIT_INLINE void next(__m256 offset, __m256& s, __m256& b) {
    if (sup) {
      const Half* f = reinterpret_cast<const Half*>(sup);
      const int8_t* c = reinterpret_cast<const int8_t*>(sup + p.planes * ROWS * 2) + in * p.planes * ROWS;
      s = _mm256_mul_ps(halves8(f), codes8(c));
      b = p.planes == 2 ? _mm256_mul_ps(halves8(f + ROWS), codes8(c + ROWS)) : _mm256_mul_ps(s, offset);
      if (++in == p.per_super) {
        in = 0;
        sup += p.super_bytes;
      }
      return;
    }
    s = halves8(h);
    b = p.planes == 2 ? halves8(h + ROWS) : _mm256_mul_ps(s, offset);
    h += p.planes * ROWS;
  }
};

// v's bits [from, from + n) of each byte moved to [to, to + n), the other bits cleared (16-bit shifts: what crosses
// a byte lies outside the kept bits, for the planes' from and to).
template <int N>
UMAKIT_INLINE __m256i moved(__m256i v, int from, int to) {
  const __m256i keep = _mm256_set1_epi8(static_cast<char>(((1 << N) - 1) << to));
  if (from > to) return _mm256_and_si256(_mm256_srli_epi16(v, from - to), keep);
  if (from < to) return _mm256_and_si256(_mm256_slli_epi16(v, to - from), keep);
  return _mm256_and_si256(v, keep);
}

// A tile-block's codes as 8 registers of bytes, q[c] holding weights 4c..4c+3 of each row: its planes (affine.h),
// each a few loads and per chunk a shift, a mask and an or.
template <int BITS>
UMAKIT_INLINE void decode(const uint8_t* tb, __m256i* q) {
  if constexpr (BITS == 8) {
    for (int c = 0; c < 8; ++c) q[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32 * c));
    return;
  }
  constexpr int NIBBLES = BITS >= 4 ? 4 : 0, CRUMBS = BITS - NIBBLES >= 2 ? 2 : 0;
  constexpr int BIT = BITS - NIBBLES - CRUMBS;  // 0 or 1
  const uint8_t* plane = tb;
  if constexpr (NIBBLES) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {
      const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + 32 * c));
      q[c] = _mm256_and_si256(n, low);
      q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
    }
    plane += 128;
  } else {
    for (int c = 0; c < 8; ++c) q[c] = _mm256_setzero_si256();
  }
  if constexpr (CRUMBS) {
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane + 32 * half));
      for (int c = 0; c < 4; ++c) q[4 * half + c] = _mm256_or_si256(q[4 * half + c], moved<2>(v, 2 * c, NIBBLES));
    }
    plane += 64;
  }
  if constexpr (BIT) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane));
    for (int c = 0; c < 8; ++c) q[c] = _mm256_or_si256(q[c], moved<1>(v, c, NIBBLES + CRUMBS));
  }
}

// The loop of a tile's outputs for TM rows of x, the form of x aside: per block of the tile (decoded into q),
// `block(q, b, gs)` adds each of its SUB groups' products to gs[h][m]; per group, after its last block, its
// scales meet those sums: `group(s, bias, g, gs[h], acc)`. SUB: the groups in a block, 1 (groups of 32 or more)
// or 2 (of 16: chunks 0-3, then 4-7).
template <int BITS, int TM, int SUB, typename Block, typename Group>
UMAKIT_INLINE void tile_loop(const Part& p, int64_t t, int64_t K, float* y, int64_t ldy, Block&& block,
                             Group&& group) {
  const int64_t per = SUB == 1 ? p.group / BLOCK : 1, blocks = K / BLOCK;
  const uint8_t* tb = p.tile(t, K);
  const __m256 offset = _mm256_set1_ps(-static_cast<float>(1 << (BITS - 1)));
  __m256 acc[TM];
  for (int m = 0; m < TM; ++m) acc[m] = _mm256_setzero_ps();
  GroupScales scales(p, t);
  for (int64_t b = 0, g = 0; b < blocks;) {
    __m256 gs[SUB][TM];
    for (int h = 0; h < SUB; ++h)
      for (int m = 0; m < TM; ++m) gs[h][m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < per; ++j, ++b, tb += 32 * BITS) {
      __m256i q[8];
      for (int l = 0; l < 32 * BITS; l += 64) _mm_prefetch(reinterpret_cast<const char*>(tb + AHEAD + l), _MM_HINT_T0);
      decode<BITS>(tb, q);
      block(q, b, gs);
    }
    for (int h = 0; h < SUB; ++h, ++g) {
      __m256 s, bias;
      scales.next(offset, s, bias);
      group(s, bias, g, gs[h], acc);
    }
  }
  for (int m = 0; m < TM; ++m) _mm256_storeu_ps(y + m * ldy, acc[m]);
}

// Outputs of tile t for TM rows of x, x in float32: per block, each chunk's 4 weights of 8 rows widened to
// float32 and met by the broadcast x value. Each x row's arithmetic is the same whatever TM is.
template <int BITS, int TM, int SUB>
void tile_f32(const Part& p, int64_t t, const float* x, const float* xsum, int64_t K, float* y, int64_t ldy) {
  constexpr int CH = 8 / SUB;  // chunks of a group in a block
  const __m256i byte = _mm256_set1_epi32(255);
  const auto block = [&](const __m256i* q, int64_t b, __m256 (&gs)[SUB][TM]) __attribute__((always_inline)) {
    for (int h = 0; h < SUB; ++h)
      for (int m = 0; m < TM; ++m) {
        const float* xb = x + m * K + b * BLOCK;
        __m256 d[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = h * CH; c < (h + 1) * CH; ++c) {
          d[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q[c], byte)), _mm256_set1_ps(xb[4 * c]), d[0]);
          d[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q[c], 8), byte)),
                                 _mm256_set1_ps(xb[4 * c + 1]), d[1]);
          d[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q[c], 16), byte)),
                                 _mm256_set1_ps(xb[4 * c + 2]), d[2]);
          d[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q[c], 24)), _mm256_set1_ps(xb[4 * c + 3]),
                                 d[3]);
        }
        gs[h][m] = _mm256_add_ps(gs[h][m], _mm256_add_ps(_mm256_add_ps(d[0], d[1]), _mm256_add_ps(d[2], d[3])));
      }
  };
  const auto group = [&](__m256 s, __m256 bias, int64_t g, const __m256* gs,
                         __m256* acc) __attribute__((always_inline)) {
    for (int m = 0; m < TM; ++m) {
      acc[m] = _mm256_fmadd_ps(s, gs[m], acc[m]);
      acc[m] = _mm256_fmadd_ps(bias, _mm256_set1_ps(xsum[m * p.groups + g]), acc[m]);
    }
  };
  tile_loop<BITS, TM, SUB>(p, t, K, y, ldy, block, group);
}
#endif

#ifdef UMAKIT_SIMD
// CH chunks of codes of 8 rows (q, 4 weights a row each) times x's int8 values (xb, 4 values broadcast at a time),
// summed per row in int32. Without VNNI, vpmaddubsw sums pairs of products in int16, saturating: a pair is at most
// 2 (2^BITS - 1) 127, so as many pairs as fit 32767 are added in int16 before vpmaddwd widens them (8 chunks at 4
// bits or fewer, 4 at 5, 2 at 6); 8-bit parts never come here without VNNI (`int8_loops`).
template <int BITS, int CH>
UMAKIT_INLINE __m256i block_dot(const __m256i* q, const uint8_t* xb) {
#ifdef UMAKIT_VNNI
  __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
  for (int c = 0; c < CH; c += 2) {
    i0 = _mm256_dpbusd_epi32(i0, q[c], _mm256_set1_epi32(static_cast<int>(load32(xb + 4 * c))));
    i1 = _mm256_dpbusd_epi32(i1, q[c + 1], _mm256_set1_epi32(static_cast<int>(load32(xb + 4 * c + 4))));
  }
  return _mm256_add_epi32(i0, i1);
#else
  constexpr int PAIR = 2 * ((1 << BITS) - 1) * 127;
  constexpr int FIT = PAIR * 8 <= 32767 ? 8 : PAIR * 4 <= 32767 ? 4 : 2;  // chunks summed in int16
  constexpr int RUN = FIT < CH ? FIT : CH;
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < CH; c += RUN) {
    __m256i pairs = _mm256_maddubs_epi16(q[c], _mm256_set1_epi32(static_cast<int>(load32(xb + 4 * c))));
    for (int k = 1; k < RUN; ++k)
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(
                                          q[c + k], _mm256_set1_epi32(static_cast<int>(load32(xb + 4 * (c + k))))));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  return acc;
#endif
}

// Whether a part of `bits` bits multiplies int8 inputs exactly here (block_dot).
constexpr bool int8_loops(int bits) { return kVNNI || bits < 8; }

// tile_f32 with x in int8 blocks (Inputs): each block's products summed in int32 by vpdpbusd (unsigned codes
// times signed inputs, 4 at a time), then scaled by the block's input scale, and the group's sum by the weights'
// scale; the biases meet the float32 sums of x. With PASSES 2 the remainder of x's rounding, itself in int8
// blocks, is multiplied too: 15 bits of each block's largest value instead of 8. What rounding is left is that of
// the codes centred, (code - c) * (rounded x - x) with c = 2^(bits-1), as llama.cpp's symmetric blocks have it,
// not code * (rounded x - x), twice as large: xdiff holds each group's sum of x minus the sum of its rounded
// values, and c * scale * xdiff goes back in. SUB as in tile_f32 (groups of 16 share a block's input scale).
template <int BITS, int TM, int PASSES, int SUB>
void tile_i8(const Part& p, int64_t t, const Inputs& in, const float* xsum, const float* xdiff, int64_t K,
             float* y, int64_t ldy) {
  constexpr int CH = 8 / SUB;
  const int64_t blocks = K / BLOCK;
  const float centre = static_cast<float>(1 << (BITS - 1));
  const auto block = [&](const __m256i* q, int64_t b, __m256 (&gs)[SUB][TM]) __attribute__((always_inline)) {
    for (int h = 0; h < SUB; ++h)
      for (int m = 0; m < TM; ++m) {
        const int64_t at = m * K + b * BLOCK + 4 * CH * h;
        gs[h][m] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(block_dot<BITS, CH>(q + CH * h, reinterpret_cast<const uint8_t*>(in.xq + at))),
            _mm256_set1_ps(in.dx[m * blocks + b]), gs[h][m]);
        if constexpr (PASSES == 2)
          gs[h][m] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(block_dot<BITS, CH>(q + CH * h, reinterpret_cast<const uint8_t*>(in.xq2 + at))),
              _mm256_set1_ps(in.dx2[m * blocks + b]), gs[h][m]);
      }
  };
  const auto group = [&](__m256 s, __m256 bias, int64_t g, const __m256* gs,
                         __m256* acc) __attribute__((always_inline)) {
    for (int m = 0; m < TM; ++m) {
      const __m256 sum = _mm256_add_ps(gs[m], _mm256_set1_ps(centre * xdiff[m * p.groups + g]));
      acc[m] = _mm256_fmadd_ps(s, sum, acc[m]);
      acc[m] = _mm256_fmadd_ps(bias, _mm256_set1_ps(xsum[m * p.groups + g]), acc[m]);
    }
  };
  tile_loop<BITS, TM, SUB>(p, t, K, y, ldy, block, group);
}
#endif

// The same sums in plain C++, per row of the tile (a different rounding from the vector lanes').
void tile_scalar(const Part& p, int64_t t, const float* x, const float* xsum, int64_t M, int64_t K, float* y,
                 int64_t ldy) {
  float s[ROWS], b[ROWS];
  const uint8_t* tiles = p.tile(t, K);
  const int bits = static_cast<int>(p.bits);
  for (int64_t m = 0; m < M; ++m) {
    float acc[ROWS] = {};
    for (int64_t g = 0; g < p.groups; ++g) {
      tile_scales(p, t, g, s, b);
      float d[ROWS] = {};
      for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
        const uint8_t* tb = tiles + k / BLOCK * 32 * p.bits;
        for (int r = 0; r < ROWS; ++r)
          d[r] += static_cast<float>(code_at(tb, bits, r, static_cast<int>(k % BLOCK))) * x[m * K + k];
      }
      for (int r = 0; r < ROWS; ++r) acc[r] += d[r] * s[r] + b[r] * xsum[m * p.groups + g];
    }
    for (int r = 0; r < ROWS; ++r) y[m * ldy + r] = acc[r];
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

// f(std::integral_constant<int, TM>, m) over x's rows m in tiles of XTILE, then the 1-3 left.
template <typename F>
void over_x_rows(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + XTILE <= M; m += XTILE) f(std::integral_constant<int, XTILE>{}, m);
  switch (M - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Tile t of a part, x multiplied in `form` (Inputs; xsum sums x, xdiff what int8 rounding took off it).
void part_tile(const Part& p, int64_t t, const Inputs& in, int64_t form, const float* xsum, const float* xdiff,
               int64_t M, int64_t K, float* y, int64_t ldy) {
  float* out = y + p.col + t * ROWS;
#ifdef UMAKIT_SIMD
  const int64_t G = p.groups;
  [[maybe_unused]] const int64_t blocks = K / BLOCK;
  const bool done = with_bits(p.bits, [&](auto width) {
    constexpr int B = decltype(width)::value;
    over_x_rows(M, [&](auto tile, int64_t m) {
      constexpr int TM = decltype(tile)::value;
      const bool halves = p.group < BLOCK;
      if ((form == INT8 || form == INT8X2) && int8_loops(B)) {
        const Inputs at{nullptr, in.xq + m * K, in.xq2 + m * K, in.dx + m * blocks, in.dx2 + m * blocks};
        const float *sums = xsum + m * G, *diffs = xdiff + m * G;
        if (form == INT8X2)
          return halves ? tile_i8<B, TM, 2, 2>(p, t, at, sums, diffs, K, out + m * ldy, ldy)
                        : tile_i8<B, TM, 2, 1>(p, t, at, sums, diffs, K, out + m * ldy, ldy);
        return halves ? tile_i8<B, TM, 1, 2>(p, t, at, sums, diffs, K, out + m * ldy, ldy)
                      : tile_i8<B, TM, 1, 1>(p, t, at, sums, diffs, K, out + m * ldy, ldy);
      }
      if (halves) return tile_f32<B, TM, 2>(p, t, in.x + m * K, xsum + m * G, K, out + m * ldy, ldy);
      tile_f32<B, TM, 1>(p, t, in.x + m * K, xsum + m * G, K, out + m * ldy, ldy);
    });
  });
  if (done) return;
#endif
  tile_scalar(p, t, in.x, xsum, M, K, out, ldy);
}

// A tile-block's codes as out[r][j], weight j of row r.
void block_codes(const uint8_t* tb, int64_t bits, uint8_t (*out)[BLOCK]) {
#ifdef UMAKIT_SIMD
  const bool done = with_bits(bits, [&](auto width) {
    __m256i q[8];
    decode<decltype(width)::value>(tb, q);
    alignas(32) uint8_t lanes[8][32];
    for (int c = 0; c < 8; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[c]), q[c]);
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 8; ++c) std::memcpy(&out[r][4 * c], &lanes[c][4 * r], 4);
  });
  if (done) return;
#endif
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < BLOCK; ++j) out[r][j] = static_cast<uint8_t>(code_at(tb, static_cast<int>(bits), r, j));
}

#ifdef UMAKIT_SIMD
// An 8x8 matrix of 32-bit elements in 8 registers, transposed in place: a tile-block's chunks (q[c], lane r: row
// r's weights 4c..4c+3) become its rows (q[r], bytes in order: row r's 32 codes).
inline void transpose8(__m256i* q) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(q[i], q[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(q[i], q[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    q[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// 8 float32 as bfloat16, rounded to nearest even, in the low 16 bits of each 32-bit lane.
inline __m256i bf16_lanes(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}

// 16 codes (bytes) as scale * code + bias, stored as float32 or bfloat16.
template <typename T>
inline void dequantize16(__m128i codes, __m256 s, __m256 b, T* out) {
  const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), s, b);
  const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), s, b);
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_lanes(lo), bf16_lanes(hi)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  }
}

#ifdef __AVX512BF16__
// 32 codes (bytes) as scale * code + bias in bfloat16, the first 16 under (s0, b0), the next under (s1, b1): the
// same float32 values as `dequantize16`'s, rounded to nearest even by one instruction (AVX512-BF16).
inline void dequantize32_bf16(__m256i codes, float s0, float b0, float s1, float b1, uint16_t* out) {
  const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes))),
                                    _mm512_set1_ps(s0), _mm512_set1_ps(b0));
  const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1))),
                                    _mm512_set1_ps(s1), _mm512_set1_ps(b1));
  _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}
#endif

// `dequantize_tiles` in vector loops: each tile-block decoded as the kernel decodes it, transposed to its rows,
// and each row's 32 codes widened, scaled and stored 16 at a time; scales stepped through as the kernel does.
template <int BITS, typename T>
void dequantize_tiles_simd(const Part& p, int64_t t0, int64_t t1, int64_t K, T* w) {
  const __m256 offset = _mm256_set1_ps(-static_cast<float>(1 << (BITS - 1)));
  alignas(32) float s[2][ROWS], b[2][ROWS];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tb = p.tile(t, K);
    T* rows = w + (t - t0) * ROWS * K;
    GroupScales scales(p, t);
    for (int64_t k = 0; k < K; k += BLOCK, tb += 32 * BITS) {
      // the scales of the block's two halves: one group's, or (groups of 16) each half its own
      for (int h = 0; h < 2; ++h) {
        if ((k + 16 * h) % p.group != 0) continue;
        __m256 sv, bv;
        scales.next(offset, sv, bv);
        _mm256_store_ps(s[h], sv);
        _mm256_store_ps(b[h], bv);
        if (p.group >= BLOCK || h == 1) break;
      }
      const int second = p.group < BLOCK ? 1 : 0;  // which scales the block's second half takes
      __m256i q[8];
      decode<BITS>(tb, q);
      transpose8(q);
#ifdef __AVX512BF16__
      if constexpr (!std::is_same_v<T, float>) {
        for (int r = 0; r < ROWS; ++r)
          dequantize32_bf16(q[r], s[0][r], b[0][r], s[second][r], b[second][r], rows + r * K + k);
        continue;
      }
#endif
      for (int r = 0; r < ROWS; ++r) {
        T* out = rows + r * K + k;
        dequantize16(_mm256_castsi256_si128(q[r]), _mm256_set1_ps(s[0][r]), _mm256_set1_ps(b[0][r]), out);
        dequantize16(_mm256_extracti128_si256(q[r], 1), _mm256_set1_ps(s[second][r]),
                     _mm256_set1_ps(b[second][r]), out + 16);
      }
    }
  }
}
#endif

// Tiles [t0, t1) of a part as float32 (or bfloat16, rounded to nearest even) rows (8 (t1 - t0), K):
// scale * code + bias.
template <typename T>
void dequantize_tiles(const Part& p, int64_t t0, int64_t t1, int64_t K, T* w) {
#ifdef UMAKIT_SIMD
  using Out = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
  if (with_bits(p.bits, [&](auto width) {
        dequantize_tiles_simd<decltype(width)::value>(p, t0, t1, K, reinterpret_cast<Out*>(w));
      }))
    return;
#endif
  float s[ROWS], b[ROWS];
  uint8_t q[ROWS][BLOCK];
  const int64_t span = std::min(p.group, BLOCK);  // weights of a block under one group's scales
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tb = p.tile(t, K);
    T* rows = w + (t - t0) * ROWS * K;
    for (int64_t k = 0; k < K; k += BLOCK, tb += 32 * p.bits) {
      block_codes(tb, p.bits, q);
      for (int64_t i0 = 0; i0 < BLOCK; i0 += span) {
        if ((k + i0) % p.group == 0) tile_scales(p, t, (k + i0) / p.group, s, b);
        for (int r = 0; r < ROWS; ++r) {
          if constexpr (std::is_same_v<T, at::BFloat16>) {  // rounded to nearest even, in loops that vectorize
            uint16_t* out = reinterpret_cast<uint16_t*>(rows + r * K + k);
            for (int64_t i = i0; i < i0 + span; ++i) {
              const float v = static_cast<float>(q[r][i]) * s[r] + b[r];
              uint32_t u;
              std::memcpy(&u, &v, 4);
              out[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            }
          } else {
            for (int64_t i = i0; i < i0 + span; ++i) rows[r * K + k + i] = static_cast<float>(q[r][i]) * s[r] + b[r];
          }
        }
      }
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
    TORCH_CHECK((g == 16 || g % BLOCK == 0) && g > 0 && K % g == 0, "group ", g,
                " must be 16 or a multiple of 32 dividing ", K);
    TORCH_CHECK(codes[i].scalar_type() == at::kByte && codes[i].is_contiguous() && codes[i].dim() == 2 &&
                    rows % ROWS == 0 && codes[i].size(1) == K * b / 8,
                "part ", i, ": codes must be contiguous uint8 (rows, K*bits/8), rows a multiple of ", ROWS);
    Part part{codes[i].data_ptr<uint8_t>(), nullptr, nullptr, rows, b, g, K / g, col, 0, 0, 0};
    const Tensor& s = sb[i];
    if (s.scalar_type() == at::kByte) {  // coded: (rows / 8, super-blocks, bytes each)
      const int64_t supers = s.dim() == 3 ? s.size(1) : 0;
      const int64_t per = supers > 0 && part.groups % supers == 0 ? part.groups / supers : 0;
      const int64_t planes = per > 0 && s.size(2) % (2 * ROWS + per * ROWS) == 0 ? s.size(2) / (2 * ROWS + per * ROWS)
                                                                                 : 0;
      TORCH_CHECK(s.is_contiguous() && s.size(0) * ROWS == rows && (planes == 1 || planes == 2),
                  "part ", i, ": coded scales must be contiguous uint8 (rows/8, super-blocks, planes * (16 + ",
                  "8 * groups a super-block))");
      part.coded = s.data_ptr<uint8_t>();
      part.planes = planes;
      part.per_super = per;
      part.super_bytes = s.size(2);
    } else {
      const int64_t planes = s.dim() == 4 ? s.size(2) : 0;
      TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && (planes == 1 || planes == 2) &&
                      s.size(0) * ROWS == rows && s.size(1) == K / g && s.size(3) == ROWS,
                  "part ", i, ": scales and biases must be contiguous float16 (rows/8, K/group, 2 or 1, 8)");
      part.sb = s.data_ptr<Half>();
      part.planes = planes;
    }
    parts.push_back(part);
    col += rows;
  }
  return parts;
}

}  // namespace

namespace umakit {

// A slab's outputs (M, n), float32 or bfloat16 (widened exactly), into columns of y whose rows are N apart: a plain
// loop, where a strided copy_ took about twice its CPU time (torch's profiler, 2026-12-06).
void widen_into(const Tensor& out, float* y, int64_t N) {
  const int64_t M = out.size(0), n = out.size(1);
  if (out.scalar_type() == at::kFloat) {
    const float* o = out.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N, o + m * n, n * sizeof(float));
    return;
  }
  const uint16_t* o = reinterpret_cast<const uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t bits = static_cast<uint32_t>(o[m * n + j]) << 16;
      std::memcpy(y + m * N + j, &bits, 4);
    }
}

// Tiles of a GEMM's slab: as many as hold 512K weights (1 MB in bfloat16, which stays in a core's L2 between its
// dequantization and its GEMM; 8 to 128 tiles), fewer where that would leave threads without four slabs each.
// Measured against 32 tiles whatever K (2026-12-06, 512 tokens, GEMM / kernel time, the two builds run one after
// the other): 0.37 against 0.44 on Qwen2.5-1.5B's shapes, 0.48 against 0.50 on the built-in model's; a third
// pair on Qwen2.5-0.5B's was within the VM's noise.
// Below SHORT rows of x (a server's prompt slices) a GEMM's own arithmetic is small beside each call's fixed cost
// (oneDNN packing the slab's weights for its loops, and its setup: a 128-row slab cost 2.5x a 512-row one per
// row at 16 rows of x), so slabs hold up to 1M weights, one a thread where a part is smaller. Measured 2026-12-07
// against the rule above (prefills alternating the two builds): the built-in model's 0.63-0.90x at 48-200 tokens
// (level at 16), a Qwen2.5-0.5B-shaped Q4_K_M's level (0.90-1.06x); slabs of 2M weights were slower on the
// Q4_K_M (1.1-1.2x at 96-200 tokens).
constexpr int64_t SHORT = 256;
int64_t slab_tiles(const std::vector<Part>& parts, int64_t K, int64_t M) {
  int64_t tiles = 0;
  for (const Part& p : parts) tiles += p.rows / ROWS;
  const int64_t threads = at::get_num_threads();
  if (M < SHORT) return std::clamp<int64_t>(tiles / threads, 1, std::max<int64_t>((int64_t{1} << 20) / (K * ROWS), 8));
  const int64_t fits = std::clamp<int64_t>((int64_t{1} << 19) / (K * ROWS), 8, 128);
  return std::clamp<int64_t>(tiles / (4 * threads), 1, fits);
}

// Tiles of a slab on AMX tiles: 256K weights (512 KB of bfloat16, well inside a core's L2), 4 to 32 tiles. Their
// GEMMs have no setup to pay for, so small slabs cost nothing and keep the threads' shares even.
int64_t amx_slab_tiles(int64_t K) { return std::clamp<int64_t>((int64_t{1} << 18) / (K * ROWS), 4, 32); }

static void multiply_rows(const Tensor& x, std::vector<Part> parts, int64_t inputs, bool each, Tensor& y);

Tensor affine_mm(const Tensor& x_in, at::TensorList codes, at::TensorList sb, at::IntArrayRef bits,
                 at::IntArrayRef groups, int64_t dense_rows, int64_t inputs) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "x must be float32 (rows, K)");
  const Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const std::vector<Part> parts = parts_of(codes, sb, bits, groups, K);
  const int64_t N = parts.back().col + parts.back().rows;
  Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (M >= dense_rows) {  // a long prefill: dequantize slabs of tiles once, then GEMMs (bfloat16, or gemm.cpp's)
    const bool bf16 = inputs & DENSE_BF16, onednn = inputs & DENSE_ONEDNN;
    // AMX tiles for a prompt slice's GEMMs; from SHORT rows on oneDNN's own loops were level with them (0.96-1.04x
    // at 256-1024 tokens on the built-in model, 2026-12-07), and its longer slabs stay
    const bool tiles = bf16 && (inputs & DENSE_AMX) && M < SHORT && amx_ready();
    const Tensor xb = bf16 ? x.to(at::kBFloat16) : x;
    std::vector<uint16_t> xv(tiles ? amx_inputs_size(M, K) : 0);  // x as the tiles' right operand, once
    if (tiles) amx_inputs(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K, xv.data());
    // slabs of output rows, each dequantized and multiplied by one thread while it is still in that core's cache
    const int64_t slab = tiles ? amx_slab_tiles(K) : slab_tiles(parts, K, M);
    std::vector<std::pair<const Part*, int64_t>> slabs;
    for (const Part& p : parts)
      for (int64_t t0 = 0; t0 < p.rows / ROWS; t0 += slab) slabs.emplace_back(&p, t0);
    const auto multiply = [&](int64_t i) {
      const Part& p = *slabs[i].first;
      const int64_t t0 = slabs[i].second, t1 = std::min(p.rows / ROWS, t0 + slab);
      const int64_t n = (t1 - t0) * ROWS;
      // the tiles read weight rows 32 at a time: rows past the slab's are read, never written out
      Tensor w = at::empty({tiles ? (n + 31) / 32 * 32 : n, K}, xb.options());
      if (bf16)
        dequantize_tiles(p, t0, t1, K, w.data_ptr<at::BFloat16>());
      else
        dequantize_tiles(p, t0, t1, K, w.data_ptr<float>());
      if (tiles) {
        amx_gemm(xv.data(), M, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), n, K,
                 y.data_ptr<float>() + p.col + t0 * ROWS, N);
        return;
      }
      const Tensor out = bf16 ? at::mm(xb, w.t()) : umakit::gemm_f32(x, w, onednn);  // (M, slab rows)
      widen_into(out, y.data_ptr<float>() + p.col + t0 * ROWS, N);
    };
    const at::ThreadLocalState caller;  // inference mode and the like, for the torch calls on the workers
    if (tiles) {  // small slabs, each thread taking the next: the parts' last slabs are smaller than the rest
      std::atomic<int64_t> next{0};
      at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(slabs.size());) multiply(i);
      });
      return y;
    }
    at::parallel_for(0, static_cast<int64_t>(slabs.size()), 1, [&](int64_t a, int64_t b) {
      const at::ThreadLocalStateGuard as_caller(caller);
      for (int64_t i = a; i < b; ++i) multiply(i);
    });
    return y;
  }
  multiply_rows(x, parts, inputs, false, y);
  return y;
}

// Below `dense_rows`: each output a dot product of its own, in the form `inputs` asks (affine_mm). `each`: part i
// multiplies row i of x alone, into row i of y (its columns from 0); else every part every row, into its columns.
static void multiply_rows(const Tensor& x, std::vector<Part> parts, int64_t inputs, bool each, Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  inputs &= ~(DENSE_BF16 | DENSE_ONEDNN | DENSE_AMX);
  const int64_t form = (inputs == INT8 || inputs == INT8X2) && kSIMD ? inputs : FLOAT32;
  const bool int8 = form != FLOAT32, two = form == INT8X2;
  std::vector<int8_t> xq(int8 ? M * K : 0), xq2(two ? M * K : 0);
  std::vector<float> dx(int8 ? M * K / BLOCK : 0), dx2(two ? M * K / BLOCK : 0), rest(two ? M * K : 0);
  if (int8) quantize_rows(x.data_ptr<float>(), M * K / BLOCK, xq.data(), dx.data());
  if (two) {  // what the first rounding left, rounded again
    const float* xv = x.data_ptr<float>();
    for (int64_t k = 0; k < M * K; ++k) rest[k] = xv[k] - dx[k / BLOCK] * xq[k];
    quantize_rows(rest.data(), M * K / BLOCK, xq2.data(), dx2.data());
  }
  // the sums of x over each part's groups, (rows, K / group); in int8, the sums of x less those of its rounded
  // values too
  std::vector<std::vector<float>> sums, diffs;
  const float* xp = x.data_ptr<float>();
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    const int64_t m0 = each ? static_cast<int64_t>(i) : 0, m1 = each ? m0 + 1 : M;
    std::vector<float> s((m1 - m0) * p.groups, 0.0f), d(int8 ? (m1 - m0) * p.groups : 0, 0.0f);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < p.groups; ++g) {
        float t = 0, r = 0;
        for (int64_t j = 0; j < p.group; ++j) {
          const int64_t k = m * K + g * p.group + j;
          t += xp[k];
          if (int8) r += two ? rest[k] - dx2[k / BLOCK] * xq2[k] : xp[k] - dx[k / BLOCK] * xq[k];
        }
        s[(m - m0) * p.groups + g] = t;
        if (int8) d[(m - m0) * p.groups + g] = r;
      }
    sums.push_back(std::move(s));
    diffs.push_back(std::move(d));
  }
  std::vector<Inputs> ins;  // each part's rows of x
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t m0 = each ? static_cast<int64_t>(i) : 0;
    ins.push_back({xp + m0 * K, int8 ? xq.data() + m0 * K : nullptr, two ? xq2.data() + m0 * K : nullptr,
                   int8 ? dx.data() + m0 * K / BLOCK : nullptr, two ? dx2.data() + m0 * K / BLOCK : nullptr});
    if (each) parts[i].col = 0;
  }
  std::vector<int64_t> first_tile{0};  // part i's tiles are [first_tile[i], first_tile[i + 1])
  for (const Part& p : parts) first_tile.push_back(first_tile.back() + p.rows / ROWS);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, first_tile.back(), 4, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < parts.size(); ++i)
      for (int64_t t = std::max(a, first_tile[i]); t < std::min(b, first_tile[i + 1]); ++t)
        part_tile(parts[i], t - first_tile[i], ins[i], form, sums[i].data(), diffs[i].data(), each ? 1 : M, K,
                  out + (each ? static_cast<int64_t>(i) * N : 0), N);
  });
}

// Row i of x (P, K) times part i alone (each (n, K) in tiles, n the same for every part) -> (P, n) float32, each
// row the bits it gets from affine_mm alone: the experts of a decode step, whose rows differ, in one call.
Tensor affine_mm_each(const Tensor& x_in, at::TensorList codes, at::TensorList sb, at::IntArrayRef bits,
                      at::IntArrayRef groups, int64_t inputs) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "x must be float32 (rows, K)");
  const Tensor x = x_in.contiguous();
  const std::vector<Part> parts = parts_of(codes, sb, bits, groups, x.size(1));
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == x.size(0), "one part a row");
  for (const Part& p : parts) TORCH_CHECK(p.rows == parts[0].rows, "every part of the same width");
  Tensor y = at::empty({x.size(0), parts[0].rows}, x.options());
  multiply_rows(x, parts, inputs, true, y);
  return y;
}

int64_t affine_features() {
  return (kAVX512 ? 1 : 0) | (kSIMD ? 2 : 0) | (kVNNI ? 4 : 0) | (kSIMD ? 8 : 0) | (amx_ready() ? 16 : 0);
}

// MLX's packing (rows, K*bits/32 uint32: code j at bits [j*bits, (j+1)*bits) of the row) -> tiles (affine.h).
Tensor affine_planes(const Tensor& weight, int64_t bits) {
  TORCH_CHECK(bits >= 2 && bits <= 8 && bits != 7, "bits must be 2, 3, 4, 5, 6 or 8, not ", bits);
  const Tensor w = weight.contiguous().view(at::kByte);
  const int64_t rows = w.size(0), row_bytes = w.size(1), K = row_bytes * 8 / bits;
  TORCH_CHECK(K % BLOCK == 0, "the input width must be a multiple of ", BLOCK);
  TORCH_CHECK(rows % ROWS == 0, "the rows must be a multiple of ", ROWS);
  Tensor out = at::empty({rows, row_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t step = 4 * bits;  // bytes of a row's 32 codes in MLX's packing
  at::parallel_for(0, rows / ROWS, 8, [&](int64_t a, int64_t b) {
    uint8_t buf[40];
    uint8_t c[ROWS][BLOCK];  // row r's codes
    uint8_t lane[8][32];     // lane[ch][l]: chunk ch's weight lane l, row l / 4's code 4 ch + l % 4
    for (int64_t t = a; t < b; ++t)
      for (int64_t k = 0; k < K; k += BLOCK) {
        const uint8_t* s0 = src + t * ROWS * row_bytes + k / BLOCK * step;  // row r's 32 codes at s0 + r * row_bytes
        uint8_t* o = dst + t * ROWS * row_bytes + k / BLOCK * ROWS * step;
        if (bits == 4 || bits == 8) {  // whole nibbles and bytes: moved, never unpacked (a first load's most layers)
          for (int r = 0; r < ROWS; ++r) {
            const uint8_t* s = s0 + r * row_bytes;
            for (int ch = 0; ch < (bits == 8 ? 8 : 4); ++ch) {
              if (bits == 8) {  // chunk ch's lanes 4r..4r+3: row r's codes 4ch..4ch+3
                std::memcpy(o + 32 * ch + 4 * r, s + 4 * ch, 4);
                continue;
              }
              // low nibbles: codes 4ch + i (bytes 2ch, 2ch + 1); high: codes 4ch + 16 + i (bytes 8 + 2ch, ...)
              for (int i = 0; i < 4; i += 2) {
                const uint8_t lo = s[2 * ch + i / 2], hi = s[8 + 2 * ch + i / 2];
                o[32 * ch + 4 * r + i] = static_cast<uint8_t>((lo & 15) | (hi << 4));
                o[32 * ch + 4 * r + i + 1] = static_cast<uint8_t>((lo >> 4) | (hi & 0xF0));
              }
            }
          }
          continue;
        }
        for (int r = 0; r < ROWS; ++r) {
          const uint8_t* s = s0 + r * row_bytes;
          if (bits == 6) {  // 4 codes in each 3 bytes
            for (int q = 0; q < BLOCK / 4; ++q, s += 3) {
              c[r][4 * q] = s[0] & 63;
              c[r][4 * q + 1] = static_cast<uint8_t>((s[0] >> 6) | ((s[1] & 15) << 2));
              c[r][4 * q + 2] = static_cast<uint8_t>((s[1] >> 4) | ((s[2] & 3) << 4));
              c[r][4 * q + 3] = s[2] >> 2;
            }
          } else {
            std::memset(buf, 0, sizeof(buf));
            std::memcpy(buf, s, step);
            for (int j = 0; j < BLOCK; ++j) {
              uint64_t word;
              std::memcpy(&word, buf + j * bits / 8, 8);
              c[r][j] = static_cast<uint8_t>((word >> (j * bits % 8)) & ((1u << bits) - 1));
            }
          }
          for (int ch = 0; ch < 8; ++ch) std::memcpy(&lane[ch][4 * r], &c[r][4 * ch], 4);
        }
        tile_lanes(lane, bits, o);
      }
  });
  return out;
}

void tile_lanes(const uint8_t lane[8][32], int64_t bits, uint8_t* o) {
  if (bits == 8) {  // the 8 chunks as bytes
    std::memcpy(o, lane, 256);
    return;
  }
  // each plane's bytes from 32 lanes at once (the loops over l vectorise)
  int shift = 0;
  if (bits >= 4) {
    for (int ch = 0; ch < 4; ++ch)
      for (int l = 0; l < 32; ++l)
        o[32 * ch + l] = static_cast<uint8_t>((lane[ch][l] & 15) | ((lane[ch + 4][l] & 15) << 4));
    o += 128;
    shift = 4;
  }
  if (bits - shift >= 2) {  // crumbs: byte l of half h holds chunk 4h + i's 2 bits at bits 2i, 2i + 1
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        int byte = 0;
        for (int i = 0; i < 4; ++i) byte |= ((lane[4 * h + i][l] >> shift) & 3) << (2 * i);
        o[32 * h + l] = static_cast<uint8_t>(byte);
      }
    o += 64;
    shift += 2;
  }
  if (bits - shift == 1) {  // one bit: byte l holds chunk ch's at bit ch
    for (int l = 0; l < 32; ++l) {
      int byte = 0;
      for (int ch = 0; ch < 8; ++ch) byte |= ((lane[ch][l] >> shift) & 1) << ch;
      o[l] = static_cast<uint8_t>(byte);
    }
  }
}

// Rows `ids` of a layer in tiles, as float32 (len(ids), K): a tied table's lookups, and the tests' reference.
Tensor affine_dequantize(const Tensor& codes, const Tensor& sb, int64_t bits, int64_t group, const Tensor& ids) {
  const int64_t K = codes.size(1) * 8 / bits;
  const std::vector<Part> parts = parts_of({codes}, {sb}, {bits}, {group}, K);
  const Part& p = parts[0];
  const Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t n = rows.numel();
  const int64_t* id = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < p.rows, "row ", id[i], " out of range");
  Tensor w = at::empty({n, K}, codes.options().dtype(at::kFloat));
  float* out = w.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    float s[ROWS], bias[ROWS];
    for (int64_t i = a; i < b; ++i) {
      const int64_t t = id[i] / ROWS;
      const int r = static_cast<int>(id[i] % ROWS);
      const uint8_t* tb = p.tile(t, K);
      for (int64_t k = 0; k < K; k += BLOCK, tb += 32 * bits)
        for (int j = 0; j < BLOCK; ++j) {
          if ((k + j) % group == 0) tile_scales(p, t, (k + j) / group, s, bias);
          out[i * K + k + j] = static_cast<float>(code_at(tb, static_cast<int>(bits), r, j)) * s[r] + bias[r];
        }
    }
  });
  return w;
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("affine_mm(Tensor x, Tensor[] codes, Tensor[] sb, int[] bits, int[] groups, int dense_rows, "
        "int inputs) -> Tensor");
  m.def("affine_features() -> int");
  m.def("gemm_f32(Tensor x, Tensor w, bool onednn) -> Tensor");
  m.def("gemm_onednn() -> bool");
  m.def("affine_planes(Tensor weight, int bits) -> Tensor");
  m.def("affine_dequantize(Tensor codes, Tensor sb, int bits, int group, Tensor ids) -> Tensor");
  m.impl("affine_mm", c10::DispatchKey::CPU, TORCH_FN(umakit::affine_mm));
  m.impl("affine_planes", c10::DispatchKey::CPU, TORCH_FN(umakit::affine_planes));
  m.impl("affine_features", c10::DispatchKey::CatchAll, TORCH_FN(umakit::affine_features));
  m.impl("gemm_f32", c10::DispatchKey::CPU, TORCH_FN(umakit::gemm_f32));
  m.impl("gemm_onednn", c10::DispatchKey::CatchAll, TORCH_FN(umakit::gemm_onednn));
  m.impl("affine_dequantize", c10::DispatchKey::CPU, TORCH_FN(umakit::affine_dequantize));
}
