// One decode token of the gated delta rule (the linear attention of Qwen3.5 and Qwen3-Next), as transformers'
// `torch_recurrent_gated_delta_rule` computes it with q and k l2-normed in the kernel: for each value head, the
// state S (dk, dv) decays by exp(g), the value the state recalls for the key (S^T k) is replaced by v at rate
// beta, and the output is the new state read by the query. transformers does this as some fifteen torch ops a
// layer, each a pass over the layer's state (2 MB for Qwen3.5's 32 heads of 128 x 128); here it is two passes.
// The state is not changed in place: a new one is returned (the caches keep snapshots of the old).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace umakit {

using at::Tensor;

namespace {

// x (n) times rsqrt(sum x^2 + 1e-6), then divided by `by` (the query's sqrt(dk); 1 for the key).
void l2normed(const float* x, int64_t n, float by, float* out) {
  float ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv / by;
}

}  // namespace

// q, k (B, 1, Hk, dk); v (B, 1, Hv, dv); g, beta (B, 1, Hv); state (B, Hv, dk, dv); all float32.
// -> (out (B, 1, Hv, dv), the new state (B, Hv, dk, dv)).
std::tuple<Tensor, Tensor> delta_rule_step(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                           const Tensor& g_in, const Tensor& beta_in, const Tensor& state_in) {
  for (const Tensor* t : {&q_in, &k_in, &v_in, &g_in, &beta_in, &state_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "the gated delta rule's inputs must be float32");
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(1) == 1 && v_in.dim() == 4 && state_in.dim() == 4, "one token a row");
  const Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous(),
               beta = beta_in.contiguous(), state = state_in.contiguous();
  const int64_t B = q.size(0), Hk = q.size(2), dk = q.size(3), Hv = v.size(2), dv = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && Hv % Hk == 0 && state.size(0) == B && state.size(1) == Hv &&
                  state.size(2) == dk && state.size(3) == dv && g.numel() == B * Hv && beta.numel() == B * Hv,
              "shapes of the gated delta rule do not agree");
  Tensor out = at::empty({B, 1, Hv, dv}, v.options());
  Tensor next = at::empty_like(state);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>(), *sp = state.data_ptr<float>();
  float *op = out.data_ptr<float>(), *np = next.data_ptr<float>();
  const float root = std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, B * Hv, 1, [&](int64_t a, int64_t z) {
    std::vector<float> qn(dk), kn(dk), mem(dv), delta(dv);
    for (int64_t bh = a; bh < z; ++bh) {
      const int64_t b = bh / Hv, h = bh % Hv, kh = h / (Hv / Hk);
      l2normed(qp + (b * Hk + kh) * dk, dk, root, qn.data());
      l2normed(kp + (b * Hk + kh) * dk, dk, 1.0f, kn.data());
      const float decay = std::exp(gp[bh]), rate = bp[bh];
      const float* s = sp + bh * dk * dv;
      float* s2 = np + bh * dk * dv;
      std::fill(mem.begin(), mem.end(), 0.0f);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) mem[j] += s[i * dv + j] * decay * kn[i];
      const float* vr = vp + bh * dv;
      for (int64_t j = 0; j < dv; ++j) delta[j] = (vr[j] - mem[j]) * rate;
      float* o = op + bh * dv;
      std::fill(o, o + dv, 0.0f);
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          const float x = s[i * dv + j] * decay + kn[i] * delta[j];
          s2[i * dv + j] = x;
          o[j] += x * qn[i];
        }
    }
  });
  return {out, next};
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("delta_rule_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state) -> (Tensor, Tensor)");
  m.impl("delta_rule_step", c10::DispatchKey::CPU, TORCH_FN(umakit::delta_rule_step));
}
