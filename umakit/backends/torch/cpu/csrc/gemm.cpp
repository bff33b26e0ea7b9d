// float32 GEMMs for the CPU's long prefills, on oneDNN where torch carries it.
//
// torch's float32 mm goes to its BLAS (MKL in the x86 wheels), whose dispatch takes the 256-bit path on AMD's
// AVX-512 CPUs; oneDNN, which torch links for its bfloat16 and reduced-precision matmuls, runs float32 at full
// precision with 512-bit FMAs there: (512 x 1536) x (1536 x 8960) took 31 ms against 68-73 ms on 2 threads of
// an AMD EPYC (2026-12-06), with outputs within 1e-6 of float64's (MKL's within 4e-7). torch exports
// at::native::mkldnn_matmul without declaring it in its installed headers, so it is declared here weak: a
// build of torch without it, or a CPU oneDNN's checks refuse (no AVX-512 BW/VL/DQ), leaves at::mm, as does
// `onednn` false (the caller's choice: cpu/affine_kernel.py takes oneDNN where torch runs its AVX-512 kernels, so
// that ATEN_CPU_CAPABILITY=avx2 shows what an AVX2 CPU gets).
#include "affine.h"

#include <atomic>

namespace at::native {
__attribute__((weak)) void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& result,
                                         float beta, float alpha);
}  // namespace at::native

namespace {

std::atomic<int> onednn_state{0};  // 0: untried, 1: works, -1: refused here

bool onednn_usable() {
  return at::native::mkldnn_matmul != nullptr && at::globalContext().userEnabledMkldnn() &&
         onednn_state.load() >= 0;
}

}  // namespace

namespace umakit {

at::Tensor gemm_f32(const at::Tensor& x, const at::Tensor& w, bool onednn) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() == 2 && w.dim() == 2 &&
                  x.size(1) == w.size(1), "gemm_f32: float32 (M, K) and (N, K)");
  if (onednn && onednn_usable() && x.size(0) > 0 && w.size(0) > 0) {
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    try {
      at::native::mkldnn_matmul(x.contiguous(), w.contiguous().t(), y, 0.0f, 1.0f);
      onednn_state.store(1);
      return y;
    } catch (const c10::Error&) {
      if (onednn_state.load() == 1) throw;  // it ran before: this is a real error, not the CPU's refusal
      onednn_state.store(-1);
    }
  }
  return at::mm(x, w.t());
}

bool gemm_onednn() {
  if (onednn_usable() && onednn_state.load() == 0) gemm_f32(at::ones({1, 32}), at::ones({8, 32}), true);  // ask once
  return onednn_usable() && onednn_state.load() == 1;
}

}  // namespace umakit
