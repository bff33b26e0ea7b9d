// CPU decode steps of a Llama-family stack in one call: one token of one sequence, one token of each of a
// batch's, or a few consecutive tokens of one sequence (a speculative verification), each row bit for bit as
// its own step would be: umakit's fused decode (see ../build.py).
//
// The eager step dispatches some 65 small ops per layer from Python, each a
// few microseconds, which is a third of a step on a 135M model. Here each
// layer is four calls of torch's int4 kernel and one of its attention; the
// norms, RoPE, cache writes, residuals and SiLU are loops over a few thousand
// floats. The math is the eager step's: float32 activations and cache,
// bfloat16 kernel inputs, the same formulas in the same order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

using at::BFloat16;
using at::Tensor;

// weight * (x * rsqrt(mean(x^2) + eps)), rounded to bfloat16, written `reps` times (nibble-plane layers).
void rms_norm_bf16(const float* x, const float* w, int64_t n, double eps, BFloat16* out, int64_t reps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = BFloat16(w[i] * (x[i] * r));
  for (int64_t k = 1; k < reps; ++k) std::copy(out, out + n, out + k * n);
}

// In place: weight * (x * rsqrt(mean(x^2) + eps)) over one head (qwen3's q/k norms), float32.
void rms_norm_inplace(float* x, const float* w, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) x[i] = w[i] * (x[i] * r);
}

Tensor int4_mm(const Tensor& x, const Tensor& packed, int64_t group, const Tensor& sz) {
  return at::_weight_int4pack_mm_for_cpu(x, packed, group, sz);  // (rows, N) bfloat16
}

// Layers [0, L) of one token per row, row b at positions[b] of cache row cache_rows[b] (empty: b); returns
// the hidden states (B, 1, H) before the final norm. The cache is (L, R, nkv, capacity, hd): a single
// sequence's (R = 1; several rows are then consecutive tokens of it, each seeing the ones before) or a
// batch's. Every row is computed exactly as it would be alone, in a step of its own: torch's int4 kernel
// gives each row of a matrix the bits it gives that row alone, and each row's attention is its own call over
// its own keys. So a batch reproduces its sequences' single steps, and T tokens of one sequence the T steps.
// Per layer l: norms[2l] (input), norms[2l+1] (post-attention); packed/sz/groups/splits[4l + j] for
// j = qkv, o, gate_up, down; qkv_bias[l] and qk_norms[2l], [2l+1] when given (else empty lists).
}  // namespace

namespace umakit {

Tensor decode_layers(const Tensor& x_in, const Tensor& inv_freq, at::IntArrayRef positions,
                     at::IntArrayRef cache_rows, Tensor k_cache, Tensor v_cache, at::TensorList norms,
                     at::TensorList qk_norms, at::TensorList packed, at::TensorList sz, at::IntArrayRef groups,
                     at::IntArrayRef splits, at::TensorList qkv_bias, int64_t nh, int64_t nkv, int64_t hd,
                     double eps, double scale, int64_t window) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 activations only");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the cache must be contiguous, (layers, rows, kv heads, capacity, head dim)");
  const int64_t L = k_cache.size(0), R = k_cache.size(1), capacity = k_cache.size(3), H = x_in.size(-1);
  const int64_t B = static_cast<int64_t>(positions.size());
  TORCH_CHECK(B >= 1 && x_in.numel() == B * H, B, " rows of ", H, " expected");
  TORCH_CHECK(cache_rows.empty() || static_cast<int64_t>(cache_rows.size()) == B, "one cache row per row");
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == 4 * L && static_cast<int64_t>(norms.size()) == 2 * L,
              "weights for ", L, " layers expected");
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
  const c10::optional<double> attn_scale = scale > 0 ? c10::optional<double>(scale) : c10::nullopt;

  for (int64_t l = 0; l < L; ++l) {
    const int64_t j = 4 * l;
    // attention
    const int64_t rq = splits[j] ? 2 : 1;
    Tensor xb = at::empty({B, H * rq}, at::TensorOptions().dtype(at::kBFloat16));
    for (int64_t b = 0; b < B; ++b)
      rms_norm_bf16(xp + b * H, norms[2 * l].data_ptr<float>(), H, eps, xb.data_ptr<BFloat16>() + b * H * rq, rq);
    Tensor qkv = int4_mm(xb, packed[j], groups[j], sz[j]);
    const float* bias = qkv_bias.empty() ? nullptr : qkv_bias[l].data_ptr<float>();
    float* kl = k_cache[l].data_ptr<float>();  // (R, nkv, capacity, hd)
    float* vl = v_cache[l].data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const BFloat16* y = qkv.data_ptr<BFloat16>() + b * heads * hd;
      const float *c = cos_.data() + b * hd, *s = sin_.data() + b * hd;
      const int64_t pos = positions[b];
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < hd; ++i) {
          const float v = static_cast<float>(y[h * hd + i]);
          head[i] = bias ? v + bias[h * hd + i] : v;
        }
        if (h >= nh + nkv) {  // values: stored as they are
          std::copy(head.begin(), head.end(), vl + row[b] * row_stride + ((h - nh - nkv) * capacity + pos) * hd);
          continue;
        }
        if (!qk_norms.empty())
          rms_norm_inplace(head.data(), qk_norms[2 * l + (h < nh ? 0 : 1)].data_ptr<float>(), hd, eps);
        for (int64_t i = 0; i < hd; ++i) rotated[i] = head[i] * c[i] + head[(i + half) % hd] * s[i];
        float* dst = h < nh ? qp + (b * nh + h) * hd : kl + row[b] * row_stride + ((h - nh) * capacity + pos) * hd;
        std::copy(rotated.begin(), rotated.end(), dst);
      }
    }
    // Each row alone: one query per head at its position, each kv group's queries riding the time axis, over
    // its keys [first, position]. All the rows' keys and values are written by now (the tokens of one
    // sequence see each other's).
    const int64_t ro = splits[j + 1] ? 2 : 1;
    Tensor attn = at::empty({B, nh * hd * ro}, at::TensorOptions().dtype(at::kBFloat16));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, positions[b] + 1 - window) : 0;
      const int64_t span = positions[b] + 1 - first;
      Tensor keys = k_cache[l].narrow(0, row[b], 1).narrow(2, first, span);
      Tensor values = v_cache[l].narrow(0, row[b], 1).narrow(2, first, span);
      Tensor out = at::scaled_dot_product_attention(q.narrow(0, b, 1), keys, values, {}, 0.0, false, attn_scale)
                       .contiguous();
      const float* op = out.data_ptr<float>();
      BFloat16* dst = attn.data_ptr<BFloat16>() + b * nh * hd * ro;
      for (int64_t i = 0; i < nh * hd; ++i) dst[i] = BFloat16(op[i]);
      if (ro == 2) std::copy(dst, dst + nh * hd, dst + nh * hd);
    }
    Tensor o = int4_mm(attn, packed[j + 1], groups[j + 1], sz[j + 1]);
    const BFloat16* op = o.data_ptr<BFloat16>();
    for (int64_t i = 0; i < B * H; ++i) xp[i] += static_cast<float>(op[i]);

    // MLP
    const int64_t rg = splits[j + 2] ? 2 : 1;
    Tensor hb = at::empty({B, H * rg}, at::TensorOptions().dtype(at::kBFloat16));
    for (int64_t b = 0; b < B; ++b)
      rms_norm_bf16(xp + b * H, norms[2 * l + 1].data_ptr<float>(), H, eps, hb.data_ptr<BFloat16>() + b * H * rg,
                    rg);
    Tensor gu = int4_mm(hb, packed[j + 2], groups[j + 2], sz[j + 2]);
    const int64_t inter = gu.size(1) / 2, rd = splits[j + 3] ? 2 : 1;
    Tensor act = at::empty({B, inter * rd}, at::TensorOptions().dtype(at::kBFloat16));
    for (int64_t b = 0; b < B; ++b) {
      const BFloat16* g = gu.data_ptr<BFloat16>() + b * 2 * inter;
      BFloat16* a = act.data_ptr<BFloat16>() + b * inter * rd;
      for (int64_t i = 0; i < inter; ++i) {
        const float gate = static_cast<float>(g[i]), up = static_cast<float>(g[inter + i]);
        a[i] = BFloat16(gate / (1.0f + std::exp(-gate)) * up);
      }
      if (rd == 2) std::copy(a, a + inter, a + inter);
    }
    Tensor d = int4_mm(act, packed[j + 3], groups[j + 3], sz[j + 3]);
    const BFloat16* dp = d.data_ptr<BFloat16>();
    for (int64_t i = 0; i < B * H; ++i) xp[i] += static_cast<float>(dp[i]);
  }
  return x.view({B, 1, H});
}

}  // namespace umakit

TORCH_LIBRARY(umakit, m) {
  m.def("decode_layers(Tensor x, Tensor inv_freq, int[] positions, int[] cache_rows, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor[] norms, Tensor[] qk_norms, Tensor[] packed, Tensor[] sz, int[] groups, "
        "int[] splits, Tensor[] qkv_bias, int nh, int nkv, int hd, float eps, float scale, int window) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(umakit::decode_layers));
}
