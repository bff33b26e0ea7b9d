// CPU decode steps of a Llama-family stack in one call: one token of one sequence, one token of each of a
// batch's, or a few consecutive tokens of one sequence (a speculative verification), each row bit for bit as
// its own step would be: umakit's fused decode (see ../build.py).
//
// The eager step dispatches some 65 small ops per layer from Python, each a
// few microseconds, which is a third of a step on a 135M model. Here each
// layer is four calls of a quantized kernel (torch's int4 one, or umakit's
// affine one of affine_mm.cpp) and umakit's attention (attention.cpp); the norms, RoPE,
// cache writes, residuals and SiLU are loops over a few thousand floats. The
// math is the eager step's: float32 activations and cache, bfloat16 inputs
// for the int4 kernel, the same formulas in the same order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "affine.h"
#include "attention.h"

namespace {

using at::Tensor;

// weight * (x * rsqrt(mean(x^2) + eps)), float32.
void rms_norm(const float* x, const float* w, int64_t n, double eps, float* out) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// In place: weight * (x * rsqrt(mean(x^2) + eps)) over one head (qwen3's q/k norms), float32.
void rms_norm_inplace(float* x, const float* w, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) x[i] = w[i] * (x[i] * r);
}

// One projection as the eager model holds it: torch's int4 kernel (its inputs rounded to bfloat16 and, for an
// 8-bit layer, repeated for its two nibble planes), or umakit's affine kernel over one or more parts.
struct Linear {
  int64_t kind;  // INT4, INT4_SPLIT or AFFINE
  std::vector<Tensor> a, b;  // int4: packed and scales_and_zeros; affine: each part's codes and sb
  std::vector<int64_t> bits, groups;
};
constexpr int64_t INT4 = 0, INT4_SPLIT = 1, AFFINE = 2;

// (B, K) float32 -> (B, N) float32, each row as it is alone.
Tensor apply(const Linear& l, const Tensor& x, int64_t inputs) {
  if (l.kind == AFFINE) return umakit::affine_mm(x, l.a, l.b, l.bits, l.groups, INT64_MAX, inputs);
  Tensor xb = x.to(at::kBFloat16);
  if (l.kind == INT4_SPLIT) xb = at::cat({xb, xb}, 1);
  return at::_weight_int4pack_mm_for_cpu(xb, l.a[0], l.groups[0], l.b[0]).to(at::kFloat);
}

std::vector<Linear> linears(at::TensorList ta, at::TensorList tb, at::IntArrayRef kinds, at::IntArrayRef counts,
                            at::IntArrayRef bits, at::IntArrayRef groups) {
  TORCH_CHECK(kinds.size() == counts.size() && ta.size() == tb.size() && ta.size() == bits.size() &&
                  ta.size() == groups.size(), "a kind and a part count for each projection, bits and group per part");
  std::vector<Linear> out;
  size_t at_part = 0;
  for (size_t j = 0; j < kinds.size(); ++j) {
    TORCH_CHECK(kinds[j] == AFFINE || counts[j] == 1, "an int4 projection has one part");
    Linear l{kinds[j], {}, {}, {}, {}};
    for (int64_t i = 0; i < counts[j]; ++i, ++at_part) {
      TORCH_CHECK(at_part < ta.size(), "fewer parts than the counts say");
      l.a.push_back(ta[at_part]);
      l.b.push_back(tb[at_part]);
      l.bits.push_back(bits[at_part]);
      l.groups.push_back(groups[at_part]);
    }
    out.push_back(std::move(l));
  }
  TORCH_CHECK(at_part == ta.size(), "more parts than the counts say");
  return out;
}

// Layers [0, L) of one token per row, row b at positions[b] of cache row cache_rows[b] (empty: b); returns
// the hidden states (B, 1, H) before the final norm. The cache is (L, R, nkv, capacity, hd): a single
// sequence's (R = 1; several rows are then consecutive tokens of it, each seeing the ones before) or a
// batch's. Every row is computed exactly as it would be alone, in a step of its own: torch's int4 kernel and
// umakit's affine kernel give each row of a matrix the bits they give that row alone, and each row's
// attention is its own call over its own keys. So a batch reproduces its sequences' single steps, and T
// tokens of one sequence the T steps.
// Per layer l: norms[2l] (input), norms[2l+1] (post-attention); projections 4l + j for j = qkv, o, gate_up,
// down, each of kinds[4l + j] with counts[4l + j] parts in ta/tb/bits/groups; qkv_bias[l] and qk_norms[2l],
// [2l+1] when given (else empty lists); inputs: the affine kernel's form of x (affine.h).
}  // namespace

namespace umakit {

Tensor decode_layers(const Tensor& x_in, const Tensor& inv_freq, at::IntArrayRef positions,
                     at::IntArrayRef cache_rows, Tensor k_cache, Tensor v_cache, at::TensorList norms,
                     at::TensorList qk_norms, at::TensorList ta, at::TensorList tb, at::IntArrayRef kinds,
                     at::IntArrayRef counts, at::IntArrayRef bits, at::IntArrayRef groups, at::TensorList qkv_bias,
                     int64_t nh, int64_t nkv, int64_t hd, double eps, double scale, int64_t window,
                     at::IntArrayRef nope, int64_t inputs) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 activations only");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the cache must be contiguous, (layers, rows, kv heads, capacity, head dim)");
  const int64_t L = k_cache.size(0), R = k_cache.size(1), capacity = k_cache.size(3), H = x_in.size(-1);
  const int64_t B = static_cast<int64_t>(positions.size());
  TORCH_CHECK(B >= 1 && x_in.numel() == B * H, B, " rows of ", H, " expected");
  TORCH_CHECK(cache_rows.empty() || static_cast<int64_t>(cache_rows.size()) == B, "one cache row per row");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == 4 * L && static_cast<int64_t>(norms.size()) == 2 * L,
              "weights for ", L, " layers expected");
  const std::vector<Linear> lin = linears(ta, tb, kinds, counts, bits, groups);
  std::vector<int64_t> row(B);
  for (int64_t b = 0; b < B; ++b) {
    row[b] = cache_rows.empty() ? b : cache_rows[b];
    TORCH_CHECK(row[b] >= 0 && row[b] < R, "cache row ", row[b], " is outside the cache's ", R);
    TORCH_CHECK(positions[b] >= 0 && positions[b] < capacity, "position ", positions[b], " is outside the cache of ",
                capacity);
  }
  Tensor x = x_in.reshape({B, H}).contiguous().clone();
  float* xp = x.data_ptr<float>();
  const int64_t half = hd / 2, heads = nh + 2 * nkv, row_stride = nkv * capacity * hd;

  // RoPE at each row's position, as rope_cos_sin computes it: float32 angles, sin's first half negated.
  std::vector<float> cos_(B * hd), sin_(B * hd);
  const float* inv = inv_freq.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    float *c = cos_.data() + b * hd, *s = sin_.data() + b * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float f = static_cast<float>(positions[b]) * inv[i];
      c[i] = c[i + half] = std::cos(f);
      s[i] = -std::sin(f);
      s[i + half] = std::sin(f);
    }
  }
  std::vector<float> head(hd), rotated(hd);
  Tensor q = at::empty({B, nkv, nh / nkv, hd}, x.options());
  float* qp = q.data_ptr<float>();
  const float attn_scale = static_cast<float>(scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(hd)));
  const int64_t group = nh / nkv;
  Tensor normed = at::empty({B, H}, x.options());
  float* np_ = normed.data_ptr<float>();

  for (int64_t l = 0; l < L; ++l) {
    const int64_t j = 4 * l;
    const bool rope = std::find(nope.begin(), nope.end(), l) == nope.end();  // smollm3: every fourth layer has none
    // attention
    for (int64_t b = 0; b < B; ++b) rms_norm(xp + b * H, norms[2 * l].data_ptr<float>(), H, eps, np_ + b * H);
    Tensor qkv = apply(lin[j], normed, inputs);
    const float* bias = qkv_bias.empty() ? nullptr : qkv_bias[l].data_ptr<float>();
    float* kl = k_cache[l].data_ptr<float>();  // (R, nkv, capacity, hd)
    float* vl = v_cache[l].data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const float* y = qkv.data_ptr<float>() + b * heads * hd;
      const float *c = cos_.data() + b * hd, *s = sin_.data() + b * hd;
      const int64_t pos = positions[b];
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < hd; ++i) head[i] = bias ? y[h * hd + i] + bias[h * hd + i] : y[h * hd + i];
        if (h >= nh + nkv) {  // values: stored as they are
          std::copy(head.begin(), head.end(), vl + row[b] * row_stride + ((h - nh - nkv) * capacity + pos) * hd);
          continue;
        }
        if (!qk_norms.empty())
          rms_norm_inplace(head.data(), qk_norms[2 * l + (h < nh ? 0 : 1)].data_ptr<float>(), hd, eps);
        for (int64_t i = 0; i < hd; ++i) rotated[i] = rope ? head[i] * c[i] + head[(i + half) % hd] * s[i] : head[i];
        float* dst = h < nh ? qp + (b * nh + h) * hd : kl + row[b] * row_stride + ((h - nh) * capacity + pos) * hd;
        std::copy(rotated.begin(), rotated.end(), dst);
      }
    }
    // Each row alone, over its keys [first, position]; all the rows' keys and values are written by now (the
    // tokens of one sequence see each other's). Rows and kv heads split between the threads.
    Tensor attn = at::empty({B, nh * hd}, x.options());
    float* ap = attn.data_ptr<float>();
    at::parallel_for(0, B * nkv, 1, [&](int64_t from, int64_t to) {
      std::vector<float> scores(capacity);
      for (int64_t u = from; u < to; ++u) {
        const int64_t b = u / nkv, kvh = u % nkv;
        const int64_t first = window > 0 ? std::max<int64_t>(0, positions[b] + 1 - window) : 0;
        const int64_t at_key = row[b] * row_stride + (kvh * capacity + first) * hd;
        attend_one(qp + (b * nh + kvh * group) * hd, kl + at_key, vl + at_key, positions[b] + 1 - first, group, hd,
                   attn_scale, scores.data(), ap + (b * nh + kvh * group) * hd);
      }
    });
    Tensor o = apply(lin[j + 1], attn, inputs);
    const float* op = o.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) xp[i] += op[i];

    // MLP
    for (int64_t b = 0; b < B; ++b) rms_norm(xp + b * H, norms[2 * l + 1].data_ptr<float>(), H, eps, np_ + b * H);
    Tensor gu = apply(lin[j + 2], normed, inputs);
    const int64_t inter = gu.size(1) / 2;
    Tensor act = at::empty({B, inter}, x.options());
    for (int64_t b = 0; b < B; ++b) {
      const float* g = gu.data_ptr<float>() + b * 2 * inter;
      float* a = act.data_ptr<float>() + b * inter;
      for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.0f + std::exp(-g[i])) * g[inter + i];
    }
    Tensor d = apply(lin[j + 3], act, inputs);
    const float* dp = d.data_ptr<float>();
    for (int64_t i = 0; i < B * H; ++i) xp[i] += dp[i];
  }
  return x.view({B, 1, H});
}

}  // namespace umakit

TORCH_LIBRARY(umakit, m) {
  m.def("decode_layers(Tensor x, Tensor inv_freq, int[] positions, int[] cache_rows, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor[] norms, Tensor[] qk_norms, Tensor[] ta, Tensor[] tb, int[] kinds, "
        "int[] counts, int[] bits, int[] groups, Tensor[] qkv_bias, int nh, int nkv, int hd, float eps, "
        "float scale, int window, int[] nope, int inputs) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(umakit::decode_layers));
}
