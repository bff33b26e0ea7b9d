// The fused decode step (fused_decode.cpp), for the library's other entry points (light.cpp).
#pragma once

#include <ATen/ATen.h>

namespace umakit {

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& inv_freq, at::IntArrayRef positions,
                         at::IntArrayRef cache_rows, at::Tensor k_cache, at::Tensor v_cache, at::TensorList norms,
                         at::TensorList qk_norms, at::TensorList packed, at::TensorList sz, at::IntArrayRef groups,
                         at::IntArrayRef splits, at::TensorList qkv_bias, int64_t nh, int64_t nkv, int64_t hd,
                         double eps, double scale, int64_t window);

}  // namespace umakit
