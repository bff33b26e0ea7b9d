// The decode step's attention (attention.h): a query a head over a few hundred cached keys is microseconds of
// arithmetic, which torch's attention op wraps in some 50 us of dispatch, checks and scratch allocation per call;
// a fused step makes one such call a row and a layer. Here it is three loops: the scores (dot products), their
// softmax (the largest subtracted, a vector exp), and the values' weighted sum, float32 throughout.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define UMAKIT_ATTN_SIMD
#endif

namespace umakit {
namespace {

#ifdef UMAKIT_ATTN_SIMD
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (a score minus the largest), 8 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (relative error below 2e-7), 2^n put in the exponent; below -87 the result is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, ln2 in two parts so that n * hi is exact
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef UMAKIT_ATTN_SIMD
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// scores[j] = e^(scores[j] - largest); returns their sum.
inline float exp_sum(float* scores, int64_t n, float largest) {
  int64_t j = 0;
  float sum = 0.0f;
#ifdef UMAKIT_ATTN_SIMD
  const __m256 m = _mm256_set1_ps(largest);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; j < n; ++j) sum += scores[j] = std::exp(scores[j] - largest);
  return sum;
}

// out += w * v
inline void axpy(float w, const float* v, float* out, int64_t n) {
  int64_t i = 0;
#ifdef UMAKIT_ATTN_SIMD
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
#endif
  for (; i < n; ++i) out[i] += w * v[i];
}

#ifdef UMAKIT_ATTN_SIMD
// The sums of 8 registers' lanes, as one register: lane t holds a[t]'s sum.
inline __m256 sums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

// scores[j] = scale q.k_j for keys j in [0, span); returns the largest. Keys 8 at a time, each its own chain of
// FMAs (hd a multiple of 8), so the additions do not wait on each other.
inline float score(const float* q, const float* keys, int64_t span, int64_t hd, float scale, float* scores) {
  int64_t j = 0;
  float largest = -std::numeric_limits<float>::infinity();
#ifdef UMAKIT_ATTN_SIMD
  if (hd % 8 == 0) {
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 top = _mm256_set1_ps(largest);
    for (; j + 8 <= span; j += 8) {
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(keys + (j + t) * hd + d), qv, acc[t]);
      }
      const __m256 s8 = _mm256_mul_ps(sums8(acc), sv);
      _mm256_storeu_ps(scores + j, s8);
      top = _mm256_max_ps(top, s8);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    largest = *std::max_element(lanes, lanes + 8);
  }
#endif
  for (; j < span; ++j) {
    scores[j] = dot(q, keys + j * hd, hd) * scale;
    largest = std::max(largest, scores[j]);
  }
  return largest;
}

// out = sum_j w[j] v_j over j in [0, span): 64 of out's values at a time in 8 registers, each key's 8 FMAs
// independent of each other.
inline void weigh(const float* w, const float* values, int64_t span, int64_t hd, float* out) {
  int64_t d = 0;
#ifdef UMAKIT_ATTN_SIMD
  for (; d + 64 <= hd; d += 64) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < span; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const float* v = values + j * hd + d;
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 8 * r), acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + d + 8 * r, acc[r]);
  }
#endif
  if (d == hd) return;
  std::fill(out + d, out + hd, 0.0f);
  for (int64_t j = 0; j < span; ++j) axpy(w[j], values + j * hd + d, out + d, hd - d);
}

}  // namespace

void attend_one(const float* q, const float* keys, const float* values, int64_t span, int64_t group, int64_t hd,
                float scale, float* scores, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    const float largest = score(q + g * hd, keys, span, hd, scale, scores);
    const float inv = 1.0f / exp_sum(scores, span, largest);
    float* o = out + g * hd;
    weigh(scores, values, span, hd, o);
    for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
  }
}

}  // namespace umakit
