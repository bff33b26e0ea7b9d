// A decode step's routed experts in one call (model/moe.py `SwitchMLP.gathered`): row r of x through expert
// idx[r]'s gated MLP, down(act(gate(x_r)) * up(x_r)), every projection a layer of one part on the affine kernel.
//
// Python took some 40 dispatches a layer for this (three kernel calls a picked expert, each behind a module
// call, plus the slicing, the activation and the joins), more time than the kernel's own on a small mixture.
// Here it is the same ops in the same order, so a row gets the bits it gets on the Python path: each projection
// runs each picked expert once, over the rows routed to it (one row each when no two rows share an expert), the
// activation and the product run on every row's gate and up at once, and the padding rows a lone part carries
// are cut off before them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "affine.h"

namespace umakit {

using at::Tensor;

namespace {

constexpr int64_t SILU = 0, GELU_TANH = 1;  // moe.py `ACTIVATION_CODES`

// One projection over every row: expert experts[j]'s codes and sb at planes[6 j + 2 p], [6 j + 2 p + 1].
Tensor project(const Tensor& x, const std::vector<int64_t>& row_expert, at::IntArrayRef experts,
               at::TensorList planes, int64_t p, int64_t bits, int64_t group, int64_t out, int64_t dense_rows,
               int64_t inputs) {
  const int64_t R = x.size(0), E = static_cast<int64_t>(experts.size());
  const auto run = [&](const Tensor& rows, int64_t j) {
    Tensor y = affine_mm(rows, {planes[6 * j + 2 * p]}, {planes[6 * j + 2 * p + 1]}, {bits}, {group}, dense_rows,
                         inputs);
    return y.size(1) > out ? y.narrow(1, 0, out) : y;
  };
  if (E == R) {  // each row its own expert (a lone decode step's picks are distinct): one row a call
    std::vector<Tensor> ys;
    ys.reserve(R);
    for (int64_t r = 0; r < R; ++r) ys.push_back(run(x.narrow(0, r, 1), row_expert[r]));
    return at::cat(ys);
  }
  Tensor y = at::empty({R, out}, x.options());
  for (int64_t j = 0; j < E; ++j) {
    std::vector<int64_t> mine;
    for (int64_t r = 0; r < R; ++r)
      if (row_expert[r] == j) mine.push_back(r);
    const Tensor rows = at::tensor(mine, x.options().dtype(at::kLong));
    y.index_copy_(0, rows, run(x.index_select(0, rows), j));
  }
  return y;
}

}  // namespace

// x (R, H) float32; idx (R) int64, row r's expert; experts: idx's distinct experts, ascending; planes: per expert
// of `experts`, its gate's, up's and down's codes and sb (6 an expert); bits, groups, outs: the three
// projections' (outs: gate's and up's width, then down's); act: SILU or GELU_TANH. -> (R, H) float32.
Tensor expert_rows(const Tensor& x, const Tensor& idx, at::IntArrayRef experts, at::TensorList planes,
                   at::IntArrayRef bits, at::IntArrayRef groups, at::IntArrayRef outs, int64_t act,
                   int64_t dense_rows, int64_t inputs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (rows, features) float32");
  TORCH_CHECK(idx.dim() == 1 && idx.size(0) == x.size(0), "one expert a row");
  TORCH_CHECK(static_cast<int64_t>(planes.size()) == 6 * static_cast<int64_t>(experts.size()), "6 planes an expert");
  TORCH_CHECK(bits.size() == 3 && groups.size() == 3 && outs.size() == 3, "gate, up and down");
  TORCH_CHECK(act == SILU || act == GELU_TANH, "unknown activation ", act);
  const Tensor ids = idx.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> row_expert(x.size(0));
  for (int64_t r = 0; r < x.size(0); ++r) {
    int64_t j = 0;
    while (j < static_cast<int64_t>(experts.size()) && experts[j] != id[r]) ++j;
    TORCH_CHECK(j < static_cast<int64_t>(experts.size()), "expert ", id[r], " has no planes");
    row_expert[r] = j;
  }
  const Tensor xs = x.contiguous();
  const Tensor gate = project(xs, row_expert, experts, planes, 0, bits[0], groups[0], outs[0], dense_rows, inputs);
  const Tensor up = project(xs, row_expert, experts, planes, 1, bits[1], groups[1], outs[1], dense_rows, inputs);
  const Tensor h = (act == SILU ? at::silu(gate) : at::gelu(gate, "tanh")) * up;
  return project(h, row_expert, experts, planes, 2, bits[2], groups[2], outs[2], dense_rows, inputs);
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("expert_rows(Tensor x, Tensor idx, int[] experts, Tensor[] planes, int[] bits, int[] groups, int[] outs, "
        "int act, int dense_rows, int inputs) -> Tensor");
  m.impl("expert_rows", c10::DispatchKey::CPU, TORCH_FN(umakit::expert_rows));
}
