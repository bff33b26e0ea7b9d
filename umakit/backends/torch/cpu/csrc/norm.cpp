// RMSNorm over the last axis in one call, for the eager model's norms on a CPU (model/llama.py `RMSNorm`, gemma's
// 1 + w and gemma4's weightless one): w * (x * r), r = 1 / sqrt(mean(x^2) + eps), in float32 with the mean summed
// in double, as the fused decode step computes it (fused_decode.cpp). In Python the formula is seven dispatches,
// about 22 us a norm here; a gemma4 decode step has 11 norms a layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace umakit {

using at::Tensor;

// x (..., n) float32; weight (n) float32 or absent; plus_one: the scale is 1 + weight (gemma's).
Tensor rms_norm(const Tensor& x, const c10::optional<Tensor>& weight, double eps, bool plus_one) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be float32");
  const Tensor xs = x.contiguous();
  const int64_t n = xs.size(-1), rows = n ? xs.numel() / n : 0;
  Tensor w;
  if (weight.has_value()) {
    w = weight->contiguous();
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == n, "the weight must be float32, one a feature");
  }
  Tensor out = at::empty_like(xs);
  const float* in = xs.data_ptr<float>();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = in + r * n;
      float* orow = o + r * n;
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + e);
      if (wp == nullptr) {
        for (int64_t i = 0; i < n; ++i) orow[i] = xr[i] * inv;
      } else if (plus_one) {
        for (int64_t i = 0; i < n; ++i) orow[i] = (xr[i] * inv) * (1.0f + wp[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) orow[i] = wp[i] * (xr[i] * inv);
      }
    }
  });
  return out;
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, bool plus_one) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(umakit::rms_norm));
}
