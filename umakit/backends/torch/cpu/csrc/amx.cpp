// A prompt slice's bfloat16 GEMMs on AMX tiles, where the CPU has them (Intel Xeon from Sapphire Rapids on).
//
// affine_mm's GEMM side dequantizes a slab of weights into bfloat16 rows while they are in a core's cache; at::mm
// then hands them to oneDNN, which repacks every slab for its own loops before it multiplies: at 16 rows of x
// that repacking and the call's setup were most of a prompt slice's pass (111 us a slab of 1M weights, 300 calls
// in a pass of the built-in model). Here the slab's rows are the tiles' left operand as they lie (16 weight rows of
// 32 inputs a tile, no repacking), and x, small and shared by every slab of the call, is laid out once as the
// right operand: pairs of adjacent inputs, 16 rows of x a tile. Each tile product sums in float32, and the outputs
// are written as float32 into y, never rounded to bfloat16.
//
// Built only where the compiler is given AMX (build.py passes -mamx-tile -mamx-bf16 where /proc/cpuinfo lists
// them); at run time the kernel asks Linux for the tiles' state once (arch_prctl), and where that is refused
// `amx_ready` is false and the caller keeps at::mm.
#include "affine.h"

#include <algorithm>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define UMAKIT_AMX 1
#endif

namespace umakit {

#ifdef UMAKIT_AMX
namespace {

struct TileConfig {  // palette 1's 64-byte layout (Intel SDM, LDTILECFG)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_granted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// Tiles 0-1: 16 weight rows each (A); 2-3: 16 rows of x each, as input pairs (B); 4-7: the 2 x 2 outputs (C).
void load_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// C tile (16 weight rows, 16 rows of x) into y's rows m0.., columns n0..; only the rows and columns that exist.
void scatter(const float (&c)[16][16], float* y, int64_t ldy, int64_t m0, int64_t M, int64_t n0, int64_t n) {
  const int64_t rows = std::min<int64_t>(16, M - m0), cols = std::min<int64_t>(16, n - n0);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < cols; ++i) y[(m0 + j) * ldy + n0 + i] = c[i][j];
}

}  // namespace

bool amx_ready() {
  static const bool ready = tiles_granted();
  return ready;
}

void amx_inputs(const uint16_t* x, int64_t M, int64_t K, uint16_t* xv) {
  const int64_t mblocks = (M + 15) / 16;
  std::memset(xv, 0, amx_inputs_size(M, K) * sizeof(uint16_t));
  // a tile at a time (1 KB, in L1): its row r holds input pair r of its 32 inputs, column j row j of its 16 of x
  for (int64_t kb = 0; kb < K / 32; ++kb)
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(xv) + (kb * mblocks + mb) * 256;
      for (int64_t j = 0; j < 16 && mb * 16 + j < M; ++j) {
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x + (mb * 16 + j) * K) + kb * 16;
        for (int r = 0; r < 16; ++r) tile[r * 16 + j] = pairs[r];
      }
    }
}

void amx_gemm(const uint16_t* xv, int64_t M, const uint16_t* w, int64_t n, int64_t K, float* y, int64_t ldy) {
  const int64_t mblocks = (M + 15) / 16, kblocks = K / 32, stride = K * 2;
  alignas(64) float c[4][16][16];
  load_config();
  for (int64_t n0 = 0; n0 < n; n0 += 32) {
    for (int64_t mb = 0; mb < mblocks; mb += 2) {
      const bool two = mb + 1 < mblocks;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        _tile_loadd(0, w + n0 * K + kb * 32, stride);
        _tile_loadd(1, w + (n0 + 16) * K + kb * 32, stride);
        _tile_loadd(2, xv + (kb * mblocks + mb) * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 1, 2);
        if (two) {
          _tile_loadd(3, xv + (kb * mblocks + mb + 1) * 512, 64);
          _tile_dpbf16ps(6, 0, 3);
          _tile_dpbf16ps(7, 1, 3);
        }
      }
      _tile_stored(4, c[0], 64);
      _tile_stored(5, c[1], 64);
      scatter(c[0], y, ldy, mb * 16, M, n0, n);
      scatter(c[1], y, ldy, mb * 16, M, n0 + 16, n);
      if (two) {
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
        scatter(c[2], y, ldy, mb * 16 + 16, M, n0, n);
        scatter(c[3], y, ldy, mb * 16 + 16, M, n0 + 16, n);
      }
    }
  }
  _tile_release();
}

#else

bool amx_ready() { return false; }
void amx_inputs(const uint16_t*, int64_t, int64_t, uint16_t*) { TORCH_CHECK(false, "built without AMX"); }
void amx_gemm(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t) {
  TORCH_CHECK(false, "built without AMX");
}

#endif

int64_t amx_inputs_size(int64_t M, int64_t K) { return (M + 15) / 16 * 16 * K; }

}  // namespace umakit
