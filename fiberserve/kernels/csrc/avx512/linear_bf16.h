// linear_bf16.cpp's row tile for CPUs with AVX512-BF16: vdpbf16ps on 16 output features a register, 6 rows x 4
// column blocks a tile (24 of the 32 zmm registers), and where the CPU has AMX and Linux grants it, AMX's tiles
// (amx/linear_bf16.h).  The packed layout and the tile's interface are the ones avx2/linear_bf16.h implements.

#pragma once

#include <immintrin.h>

#include "amx/linear_bf16.h"
#include "gated_add.h"

namespace fiberserve {
namespace {

constexpr int kBlock = 16;  // output features per packed block (one zmm of float32 sums)
constexpr int kCols = 4;    // blocks per tile: 64 output features
constexpr int kRows = 6;    // rows per tile: 6 x 4 = 24 accumulators of the 32 zmm registers
constexpr bool kBalancedTiles = false;  // see for_each_row_tile

// The rows as the tiles read them: bf16 pairs, straight from x.
using Row = uint16_t;
inline at::Tensor tile_rows(const at::Tensor& x) { return x.contiguous(); }
inline const Row* row_data(const at::Tensor& rows) { return reinterpret_cast<const Row*>(rows.data_ptr<at::BFloat16>()); }

inline void store(c10::BFloat16* out, __m512 y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(y));
}

inline void store(float* out, __m512 y) { _mm512_storeu_ps(out, y); }

// The value `store` writes, read back: what a product rounded to out_t hands the next kernel.
inline __m512 stored(__m512 y, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(y)), 16));
}

inline __m512 stored(__m512 y, const float*) { return y; }

// silu(gate) * up of one block of a gated product's row `row`: the sums rounded to out_t first, or where `add`
// adds to the row, the sums plus its additions at `feature` (gated_add.h).
template <typename out_t>
inline f32x16 gated_output(__m512 gate, __m512 up, const out_t* out, const GatedAdd& add, int64_t row,
                           int64_t feature) {
  if (add.adds(row))
    return silu_times((f32x16)gate + load16(add.gate + row * add.ld + feature),
                      (f32x16)up + load16(add.up + row * add.ld + feature));
  return silu_times((f32x16)stored(gate, out), (f32x16)stored(up, out));
}

// MR rows x NR blocks.  kGated: the first NR / 2 blocks are gate outputs and the others the matching up outputs
// (see GateUp in linear.py); the tile writes silu(gate) * up, NR / 2 blocks, each input rounded to out_t first as
// a separate product and silu_mul would see it.  Kept out of line, as in linear_quant.cpp.
template <int MR, int NR, bool kGated, typename out_t>
[[gnu::noinline]] void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, int64_t block_stride,
                 const float* bias, out_t* out, int64_t ldo, GatedAdd add = {}) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * block_stride + p * 2 * kBlock);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      if (bias) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + c * kBlock));
      if constexpr (!kGated) store(out + r * ldo + c * kBlock, acc[r][c]);
    }
  if constexpr (kGated)
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR / 2; ++c)
        store16(out + r * ldo + c * kBlock, gated_output(acc[r][c], acc[r][c + NR / 2], out, add, r, c * kBlock));
}

#if defined(FIBERSERVE_AMX)
// A unit's sums waiting for their epilogue (bias, rounding, SiLU x up): rows [next, rows) of `sums` go to `out`.
template <bool kGated, typename out_t>
struct PendingRows {
  const float* sums = nullptr;
  const float* bias = nullptr;
  out_t* out = nullptr;
  int64_t ldo = 0, next = 0, rows = 0;
  int count = 0;
  GatedAdd add = {};

  // Up to `n` more rows written.
  void drain(int64_t n) {
    for (const int64_t end = std::min(rows, next + n); next < end; ++next) {
      __m512 acc[kCols];
      for (int c = 0; c < count; ++c) {
        acc[c] = _mm512_load_ps(sums + next * amx::kCols * kBlock + c * kBlock);
        if (bias) acc[c] = _mm512_add_ps(acc[c], _mm512_loadu_ps(bias + c * kBlock));
      }
      out_t* row = out + next * ldo;
      if constexpr (kGated) {
        for (int c = 0; c < kCols / 2; ++c)
          store16(row + c * kBlock, gated_output(acc[c], acc[c + kCols / 2], row, add, next, c * kBlock));
      } else {
        for (int c = 0; c < count; ++c) store(row + c * kBlock, acc[c]);
      }
    }
  }
};

// blocks_of on AMX tiles: rows [0, rows) of x, which holds whole tiles of amx::kRows rows (the product pads it),
// against `count` blocks; only the first `rows` rows are written.  Units of one or two row tiles (two where there
// are) by a column group.  A unit's epilogue is done a few rows per k step of the next unit (two sums buffers),
// so that it overlaps the tile unit's work instead of following it: SiLU's exp and division cost about as much
// as a gated unit's tile work.
template <bool kGated, typename out_t>
void amx_blocks_of(const Row* x, int64_t rows, int64_t ldx, const uint16_t* w, int64_t K, int64_t count,
                   const float* bias, out_t* out, int64_t ldo, PrefetchCursor& prefetch, const GatedAdd& add) {
  const int64_t block_stride = K * kBlock, steps = K / (2 * amx::kPairs);
  alignas(64) float sums[2][2 * amx::kRows * amx::kCols * kBlock];
  PendingRows<kGated, out_t> pending;
  int buffer = 0;
  for (int64_t first = 0; first < count; first += kCols) {
    const int n = static_cast<int>(std::min<int64_t>(kCols, count - first));
    for (int64_t r = 0, height; r < rows; r += height) {
      height = rows - r > amx::kRows ? 2 * amx::kRows : amx::kRows;
      const int64_t per_step = (pending.rows - pending.next + steps - 1) / steps;
      const auto between = [&] { pending.drain(per_step); };
      const uint16_t* wg = w + first * block_stride;
      if (height > amx::kRows) {
        amx::pair_sums(x + r * ldx, ldx, wg, K, block_stride, n, sums[buffer], between);
        prefetch.step();
      } else {
        amx::tile_sums(x + r * ldx, ldx, wg, K, block_stride, n, sums[buffer], between);
      }
      prefetch.step();
      pending.drain(pending.rows);
      pending = {sums[buffer], bias ? bias + first * kBlock : nullptr,
                 out + r * ldo + (kGated ? first / 2 : first) * kBlock, ldo, 0, std::min(height, rows - r), n,
                 add.at(r, first / 2 * kBlock)};
      buffer ^= 1;
    }
  }
  pending.drain(pending.rows);
}
#endif

}  // namespace
}  // namespace fiberserve
