// A K-quant's scales found back as codes (scale_codes.py): each row of v, a super-block's scales as float32
// products, as a float16 factor times int8 codes, exactly. The factor is the row's largest |scale| over a code
// from `candidates` (63 for Q4_K/Q5_K's 6-bit codes, -128 or 127 for Q6_K's int8 ones, ...), rounded to float16;
// it fits where every scale divided by it rounds to an int8 code whose product with it is the scale again, in
// float32, as torch's ops compute it. Each row tries first the code the row before it took. In Python this was
// about 6 ms a layer of torch's ops (1.2 s of a 1.5B Q4_K_M's first load under cProfile).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace umakit {

using at::Tensor;

namespace {

// Whether v[0..per) is `code` times a float16 factor d = f16(amax / code), its codes written to `out`.
bool fits(const float* v, int64_t per, float amax, float code, c10::Half* d, int8_t* out) {
  const c10::Half h(amax / code);  // round to nearest even, as Tensor.to(float16)
  const float f = static_cast<float>(h);
  if (!std::isfinite(f) || f == 0.0f) return false;
  for (int64_t j = 0; j < per; ++j) {
    const float q = std::nearbyint(v[j] / f);  // half to even, as torch.round
    if (q < -128.0f || q > 127.0f || q * f != v[j]) return false;
    out[j] = static_cast<int8_t>(q);  // a later candidate overwrites a block this one did not fit
  }
  *d = h;
  return true;
}

}  // namespace

// v (rows, per) float32; candidates (n) float32. Returns the factors (rows) float16 and the codes (rows, per)
// int8; both empty where some row fits no candidate (a layer of other scales: the caller keeps float16 scales).
// An all-zero row is factor 0, codes 0.
std::tuple<Tensor, Tensor> scale_codes(const Tensor& v, const Tensor& candidates) {
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 2, "v must be 2-D float32");
  TORCH_CHECK(candidates.scalar_type() == at::kFloat && candidates.dim() == 1 && candidates.numel() > 0,
              "candidates must be 1-D float32");
  const Tensor vs = v.contiguous();
  const Tensor cs = candidates.contiguous();
  const int64_t rows = vs.size(0), per = vs.size(1), n = cs.numel();
  Tensor factors = at::empty({rows}, vs.options().dtype(at::kHalf));
  Tensor codes = at::empty({rows, per}, vs.options().dtype(at::kChar));
  const float* in = vs.data_ptr<float>();
  const float* cand = cs.data_ptr<float>();
  c10::Half* fo = factors.data_ptr<c10::Half>();
  int8_t* co = codes.data_ptr<int8_t>();
  std::atomic<bool> failed{false};
  at::parallel_for(0, rows, 1024, [&](int64_t a, int64_t b) {
    int64_t last = 0;  // the candidate the row before took
    for (int64_t r = a; r < b && !failed.load(std::memory_order_relaxed); ++r) {
      const float* row = in + r * per;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t j = 0; j < per; ++j) {
        finite = finite && std::isfinite(row[j]);
        amax = std::max(amax, std::fabs(row[j]));
      }
      if (!finite) {
        failed.store(true, std::memory_order_relaxed);
        return;
      }
      if (amax == 0.0f) {
        fo[r] = c10::Half(0.0f);
        std::fill(co + r * per, co + (r + 1) * per, int8_t{0});
        continue;
      }
      bool found = fits(row, per, amax, cand[last], fo + r, co + r * per);
      for (int64_t k = 0; k < n && !found; ++k) {
        if (k != last && fits(row, per, amax, cand[k], fo + r, co + r * per)) {
          found = true;
          last = k;
        }
      }
      if (!found) {
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  if (failed.load()) return {factors.new_empty({0}), codes.new_empty({0})};
  return {factors, codes};
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("scale_codes(Tensor v, Tensor candidates) -> (Tensor, Tensor)");
  m.impl("scale_codes", c10::DispatchKey::CPU, TORCH_FN(umakit::scale_codes));
}
