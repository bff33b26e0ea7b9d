// One query per head against a row's cached keys, for fused_decode.cpp's layers: attention.cpp.
#pragma once

#include <cstdint>

namespace umakit {

// For each of the `group` query heads of one kv head: softmax(scale q k_j) over keys j = 0..span-1, then the
// weighted sum of the values. q (group, hd), out (group, hd); keys and values hd apart. Every row's bits are its
// own, whatever else the step computes: the loops run per query, in the same order, on any batch.
void attend_one(const float* q, const float* keys, const float* values, int64_t span, int64_t group, int64_t hd,
                float scale, float* scores, float* out);

}  // namespace umakit
