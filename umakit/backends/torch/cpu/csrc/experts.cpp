// A decode step's routed experts in one call (model/moe.py `SwitchMLP.gathered`): row r of x through expert
// idx[r]'s gated MLP, down(act(gate(x_r)) * up(x_r)), every projection a layer of one part on the affine kernel.
//
// Python took some 40 dispatches a layer for this (three kernel calls a picked expert, each behind a module
// call, plus the slicing, the activation and the joins), more time than the kernel's own on a small mixture.
// Here a row gets the bits it gets on the Python path. That path runs each picked expert once over the rows
// routed to it; below `dense_rows` rows the kernel gives each row the bits it gives it alone, so here every
// row's gate and up are one call (`affine_mm_each`: row i times part i, one parallel loop over every tile) and
// its down a second, where one kernel call a projection and expert had each paid its own setup and threads' join.
// Where an expert takes `dense_rows` rows or more (a GEMM's bits), it runs as the Python path does, expert by
// expert. The activation and the product run on every row's gate and up at once, as in Python.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "affine.h"

namespace umakit {

using at::Tensor;

namespace {

constexpr int64_t SILU = 0, GELU_TANH = 1;  // moe.py `ACTIVATION_CODES`

// One projection over every row, as moe.py runs it where an expert takes a GEMM: each expert once over the rows
// routed to it; expert experts[j]'s codes and sb at planes[6 j + 2 p], [6 j + 2 p + 1].
Tensor project(const Tensor& x, const std::vector<int64_t>& row_expert, at::IntArrayRef experts,
               at::TensorList planes, int64_t p, int64_t bits, int64_t group, int64_t out, int64_t dense_rows,
               int64_t inputs) {
  const int64_t R = x.size(0), E = static_cast<int64_t>(experts.size());
  const auto run = [&](const Tensor& rows, int64_t j) {
    Tensor y = affine_mm(rows, {planes[6 * j + 2 * p]}, {planes[6 * j + 2 * p + 1]}, {bits}, {group}, dense_rows,
                         inputs);
    return y.size(1) > out ? y.narrow(1, 0, out) : y;
  };
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

// Rows `x` (n, K), row i times the layer at planes[slots[i]], planes[slots[i] + 1] alone: (n, out), padding cut off.
Tensor each_row(const Tensor& x, at::TensorList planes, const std::vector<int64_t>& slots, int64_t bits, int64_t group,
                int64_t out, int64_t inputs) {
  std::vector<Tensor> codes, sb;
  for (const int64_t i : slots) {
    codes.push_back(planes[i]);
    sb.push_back(planes[i + 1]);
  }
  const int64_t n = static_cast<int64_t>(slots.size());
  const Tensor y = affine_mm_each(x, codes, sb, std::vector<int64_t>(n, bits), std::vector<int64_t>(n, group),
                                  inputs);
  return y.size(1) > out ? y.narrow(1, 0, out).contiguous() : y;
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
  const int64_t R = xs.size(0), E = static_cast<int64_t>(experts.size());
  std::vector<int64_t> count(E, 0);
  for (const int64_t j : row_expert) ++count[j];
  const auto act_of = [&](const Tensor& gate, const Tensor& up) {
    return (act == SILU ? at::silu(gate) : at::gelu(gate, "tanh")) * up;
  };
  if (*std::max_element(count.begin(), count.end()) >= dense_rows) {  // some expert's rows take a GEMM
    const Tensor gate = project(xs, row_expert, experts, planes, 0, bits[0], groups[0], outs[0], dense_rows, inputs);
    const Tensor up = project(xs, row_expert, experts, planes, 1, bits[1], groups[1], outs[1], dense_rows, inputs);
    return project(act_of(gate, up), row_expert, experts, planes, 2, bits[2], groups[2], outs[2], dense_rows,
                   inputs);
  }
  std::vector<int64_t> gates, ups, downs;
  for (const int64_t j : row_expert) {
    gates.push_back(6 * j);
    ups.push_back(6 * j + 2);
    downs.push_back(6 * j + 4);
  }
  Tensor gate, up;
  if (bits[0] == bits[1] && groups[0] == groups[1]) {  // gate and up in one call: x twice, gates then ups
    gates.insert(gates.end(), ups.begin(), ups.end());
    const Tensor both = each_row(at::cat({xs, xs}), planes, gates, bits[0], groups[0], outs[0], inputs);
    gate = both.narrow(0, 0, R);
    up = both.narrow(0, R, R);
  } else {
    gate = each_row(xs, planes, gates, bits[0], groups[0], outs[0], inputs);
    up = each_row(xs, planes, ups, bits[1], groups[1], outs[1], inputs);
  }
  return each_row(act_of(gate, up), planes, downs, bits[2], groups[2], outs[2], inputs);
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("expert_rows(Tensor x, Tensor idx, int[] experts, Tensor[] planes, int[] bits, int[] groups, int[] outs, "
        "int act, int dense_rows, int inputs) -> Tensor");
  m.impl("expert_rows", c10::DispatchKey::CPU, TORCH_FN(umakit::expert_rows));
}
