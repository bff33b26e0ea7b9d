// A GGUF tensor's blocks decoded as checkpoint/gguf/quants.py's decoders decode them, in C++: a float32 scale and
// bias per group, the same bits as the import's numpy decoders give, and the codes in MLX's packing (`gguf_affine`)
// or straight in the CPU kernel's tiles (`gguf_tiles`). A first CPU load of a GGUF reads the layers its import left
// in the GGUF through this (load/gguf_layers.py): numpy's decoders ran at 0.2-0.3 GB/s on 2 cores, a byte at a
// time through temporaries; here a row's blocks are decoded in registers (`gguf_affine`: 1.4-1.5 GB/s).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "affine.h"

namespace umakit {

using at::Tensor;

namespace {

// ggml's type ids, each block's weights, bytes, code width and group (a scale per group).
struct BlockType {
  int64_t id, weights, bytes, bits, group;
};
constexpr BlockType TYPES[] = {
    {2, 32, 18, 4, 32},     // Q4_0
    {3, 32, 20, 4, 32},     // Q4_1
    {6, 32, 22, 5, 32},     // Q5_0
    {7, 32, 24, 5, 32},     // Q5_1
    {8, 32, 34, 8, 32},     // Q8_0
    {12, 256, 144, 4, 32},  // Q4_K
    {13, 256, 176, 5, 32},  // Q5_K
    {14, 256, 210, 6, 16},  // Q6_K
};

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// A K-quant's 8 sub-blocks' 6-bit scale and min codes, packed in 12 bytes.
inline void k_codes(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 6) << 4);
    m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

// One block's codes q[weights] and its groups' scales and biases.
void decode(int64_t id, const uint8_t* b, uint8_t* q, float* scale, float* bias) {
  switch (id) {
    case 2: case 3: case 6: case 7: {  // Q4_0, Q4_1, Q5_0, Q5_1: low nibbles are weights 0-15, high 16-31
      const bool has_min = id == 3 || id == 7, five = id == 6 || id == 7;
      const float d = half(b);
      const uint8_t* qs = b + (has_min ? 4 : 2) + (five ? 4 : 0);
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      for (int l = 0; l < 16; ++l) {
        q[l] = (qs[l] & 0x0F) | (five ? ((qh >> l) & 1) << 4 : 0);
        q[16 + l] = (qs[l] >> 4) | (five ? ((qh >> (16 + l)) & 1) << 4 : 0);
      }
      scale[0] = d;
      bias[0] = has_min ? half(b + 2) : (five ? -16.0f : -8.0f) * d;
      return;
    }
    case 8: {  // Q8_0: signed codes, +128
      const float d = half(b);
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(b[2 + l] ^ 0x80);
      scale[0] = d;
      bias[0] = -128.0f * d;
      return;
    }
    case 12: case 13: {  // Q4_K, Q5_K: 32-byte chunk c holds sub-block 2c's low nibbles and 2c+1's high ones
      const float d = half(b), dmin = half(b + 2);
      uint8_t sc[8], m[8];
      k_codes(b + 4, sc, m);
      for (int j = 0; j < 8; ++j) {
        scale[j] = d * static_cast<float>(sc[j]);
        bias[j] = -(dmin * static_cast<float>(m[j]));
      }
      const bool five = id == 13;
      const uint8_t* qh = b + 16;  // Q5_K: bit j of byte i is the fifth bit of sub-block j's weight i
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = qs[32 * c + l];
          uint8_t lo = byte & 0x0F, hi = byte >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          q[64 * c + l] = lo;
          q[64 * c + 32 + l] = hi;
        }
      return;
    }
    default: {  // Q6_K: ql[128], qh[64], int8 scales[16], d; half h's quarter j, weight l: 128 h + 32 j + l
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const float d = half(b + 208);
      for (int j = 0; j < 16; ++j) {
        scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
        bias[j] = -32.0f * scale[j];
      }
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], high = qh[32 * h + l];
          uint8_t* o = q + 128 * h + l;
          o[0] = (a & 0x0F) | ((high & 3) << 4);
          o[32] = (c & 0x0F) | (((high >> 2) & 3) << 4);
          o[64] = (a >> 4) | (((high >> 4) & 3) << 4);
          o[96] = (c >> 4) | (((high >> 6) & 3) << 4);
        }
    }
  }
}

// Codes q[n] (n a multiple of 8) into MLX's bit string at out: code j at bits [j bits, (j + 1) bits).
void pack(const uint8_t* q, int64_t n, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, q, n);
    return;
  }
  for (int64_t i = 0; i < n; i += 8, out += bits) {
    uint64_t word = 0;
    for (int j = 0; j < 8; ++j) word |= static_cast<uint64_t>(q[i + j]) << (j * bits);
    std::memcpy(out, &word, bits);  // little-endian: the word's low bytes
  }
}

// ``type``'s blocks, checked to be ``blocks``' (2-D uint8, rows of whole blocks).
const BlockType& block_type(const Tensor& blocks, int64_t type) {
  const BlockType* t = nullptr;
  for (const BlockType& k : TYPES) t = k.id == type ? &k : t;
  TORCH_CHECK(t != nullptr, "ggml type ", type, " has no exact affine form");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "blocks must be 2-D uint8");
  TORCH_CHECK(blocks.size(1) % t->bytes == 0, "a row of ", blocks.size(1), " bytes is not whole blocks of ",
              t->bytes);
  return *t;
}

}  // namespace

// blocks (rows, bytes of a row's blocks) uint8, of ggml type ``type`` -> the codes in MLX's packing (rows,
// cols * bits / 8) uint8 and float32 scales and biases (rows, cols / group).
std::tuple<Tensor, Tensor, Tensor> gguf_affine(const Tensor& blocks, int64_t type) {
  const BlockType* t = &block_type(blocks, type);
  const Tensor src = blocks.contiguous();
  const int64_t rows = src.size(0), row_bytes = src.size(1);
  const int64_t n = row_bytes / t->bytes, cols = n * t->weights, per = t->weights / t->group;
  Tensor words = at::empty({rows, cols * t->bits / 8}, src.options());
  Tensor scales = at::empty({rows, cols / t->group}, src.options().dtype(at::kFloat));
  Tensor biases = at::empty_like(scales);
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* w = words.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  float* z = biases.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    uint8_t q[256];
    for (int64_t r = a; r < b; ++r)
      for (int64_t k = 0; k < n; ++k) {
        const int64_t at = r * (cols / t->group) + k * per;
        decode(t->id, in + r * row_bytes + k * t->bytes, q, s + at, z + at);
        pack(q, t->weights, t->bits, w + r * (cols * t->bits / 8) + k * t->weights * t->bits / 8);
      }
  });
  return {words, scales, biases};
}

// `gguf_affine`, its codes straight into the CPU kernel's tiles (affine.h; rows padded to a multiple of 8 with
// code 0, as `affine_planes` takes MLX's packing padded with zero rows), row r of the outputs the blocks' row
// order[r] (none: r). The tiles are `affine_planes`' of `gguf_affine`'s codes, byte for byte, without MLX's
// packing made and read between: a first load's GGUF layers (load/gguf_layers.py).
std::tuple<Tensor, Tensor, Tensor> gguf_tiles(const Tensor& blocks, int64_t type,
                                              const c10::optional<Tensor>& order) {
  const BlockType& t = block_type(blocks, type);
  const Tensor src = blocks.contiguous();
  const int64_t rows = src.size(0), row_bytes = src.size(1), n = row_bytes / t.bytes, K = n * t.weights;
  TORCH_CHECK(K % 32 == 0, "the input width must be a multiple of 32");
  Tensor idx;
  if (order.has_value()) {
    idx = order->to(at::kLong).contiguous();
    TORCH_CHECK(idx.numel() == rows, "order must name a row for each row");
  }
  const int64_t* ord = idx.defined() ? idx.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; ord && r < rows; ++r) TORCH_CHECK(ord[r] >= 0 && ord[r] < rows, "row ", ord[r], " is outside");
  const int64_t padded = (rows + 7) / 8 * 8, out_bytes = K * t.bits / 8, groups = K / t.group;
  const int64_t per = t.weights / t.group;
  Tensor tiles = at::empty({padded, out_bytes}, src.options());
  Tensor scales = at::empty({rows, groups}, src.options().dtype(at::kFloat));
  Tensor biases = at::empty_like(scales);
  const uint8_t* in = src.data_ptr<uint8_t>();
  uint8_t* o = tiles.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  float* z = biases.data_ptr<float>();
  at::parallel_for(0, padded / 8, 1, [&](int64_t a, int64_t b) {
    std::vector<uint8_t> codes(8 * K);  // the tile's 8 rows, decoded
    uint8_t lane[8][32];
    for (int64_t tile = a; tile < b; ++tile) {
      for (int64_t r = 0; r < 8; ++r) {
        const int64_t row = tile * 8 + r;
        uint8_t* c = codes.data() + r * K;
        if (row >= rows) {
          std::memset(c, 0, K);
          continue;
        }
        const uint8_t* from = in + (ord ? ord[row] : row) * row_bytes;
        for (int64_t k = 0; k < n; ++k)
          decode(t.id, from + k * t.bytes, c + k * t.weights, s + row * groups + k * per, z + row * groups + k * per);
      }
      for (int64_t k = 0; k < K; k += 32) {
        for (int ch = 0; ch < 8; ++ch)
          for (int r = 0; r < 8; ++r) std::memcpy(&lane[ch][4 * r], codes.data() + r * K + k + 4 * ch, 4);
        tile_lanes(lane, t.bits, o + tile * 8 * out_bytes + k / 32 * 32 * t.bits);
      }
    }
  });
  return {tiles, scales, biases};
}

}  // namespace umakit

TORCH_LIBRARY_FRAGMENT(umakit, m) {
  m.def("gguf_affine(Tensor blocks, int type) -> (Tensor, Tensor, Tensor)");
  m.impl("gguf_affine", c10::DispatchKey::CPU, TORCH_FN(umakit::gguf_affine));
  m.def("gguf_tiles(Tensor blocks, int type, Tensor? order) -> (Tensor, Tensor, Tensor)");
  m.impl("gguf_tiles", c10::DispatchKey::CPU, TORCH_FN(umakit::gguf_tiles));
}
