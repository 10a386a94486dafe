// linear_bf16.cpp's tiles on AMX (Intel's tile registers, tdpbf16ps): 16 rows x 64 output features per tile.
//
// The packed weight's layout, [N / 16][K / 2][16][2], is already AMX's: 16 k-pairs of one block of 16 outputs are
// 16 lines of 64 bytes, one B tile.  A tile of x is 16 rows x 32 k (64 bytes of each row), read in place; the
// product pads a tail of fewer than 16 rows with zero rows, since a tile's C[m][n] is computed from row m alone.
// So, as with vdpbf16ps, a row's arithmetic does not depend on the rows around it, and every row of a process
// takes the same path (AMX for every row count, never a mix), which keeps the rows batch invariant.
//
// A thread's tile configuration is its own: each parallel chunk loads it (amx_configure) and releases the tiles
// when done (amx_release, amx/tiles.h).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FIBERSERVE_AMX 1

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx/tiles.h"

namespace fiberserve::amx {

constexpr int kRows = 16;  // rows per tile
constexpr int kPairs = 16;  // k-pairs per step: 32 bf16 of each row, 64 bytes
constexpr int kBlock = 16;  // outputs per C tile
constexpr int kCols = 4;   // C tiles: tmm0..tmm3; x in tmm4; weights in tmm5..tmm7

// Every tile 16 rows x 64 bytes.
inline void amx_configure() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = kRows;
    return c;
  }();
  _tile_loadconfig(&config);
}

// C[16, 16 * count] = x[16, K] . W^T for `count` (1..4) consecutive packed blocks, into `sums` (row stride 64
// floats).  x: 16 rows of K bf16 with row stride ldx (elements); w: the first block; K a multiple of 32.
// between() runs after each k step's instructions are issued: vector work there (the previous tile's epilogue)
// runs while the tile unit computes, instead of after it.
template <typename Between>
inline void tile_sums(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, int64_t block_stride, int count,
                      float* sums, const Between& between) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = ldx * 2;
  for (int64_t k = 0; k < K; k += 2 * kPairs) {
    const uint16_t* wk = w + k * kBlock;  // k / 2 pairs in, 2 * kBlock values per pair
    _tile_loadd(4, x + k, stride);
    _tile_loadd(5, wk, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (count > 1) {
      _tile_loadd(6, wk + block_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (count > 2) {
      _tile_loadd(7, wk + 2 * block_stride, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (count > 3) {
      _tile_loadd(5, wk + 3 * block_stride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    between();
  }
  constexpr int64_t kSumStride = kCols * kBlock * sizeof(float);
  _tile_stored(0, sums, kSumStride);
  if (count > 1) _tile_stored(1, sums + kBlock, kSumStride);
  if (count > 2) _tile_stored(2, sums + 2 * kBlock, kSumStride);
  if (count > 3) _tile_stored(3, sums + 3 * kBlock, kSumStride);
}

// tile_sums for 32 rows (x's next 16 rows start ldx * 16 on), into `sums` of 32 rows: two row tiles share each
// weight tile and two column blocks each row tile (2 x 2 accumulators, 4 tile loads per 4 tdpbf16ps instead of 5).
// The same k steps in the same order for every output, so the same bits as tile_sums.
template <typename Between>
inline void pair_sums(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, int64_t block_stride, int count,
                      float* sums, const Between& between) {
  constexpr int64_t kSumStride = kCols * kBlock * sizeof(float), kLower = kRows * kCols * kBlock;
  const int64_t stride = ldx * 2;
  const uint16_t* x1 = x + kRows * ldx;
  for (int c = 0; c < count; c += 2) {
    const bool two = c + 1 < count;
    const uint16_t* wc = w + c * block_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 2 * kPairs) {
      const uint16_t* wk = wc + k * kBlock;
      _tile_loadd(4, x + k, stride);
      _tile_loadd(6, wk, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, x1 + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two) {
        _tile_loadd(7, wk + block_stride, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
      between();
    }
    float* s = sums + c * kBlock;
    _tile_stored(0, s, kSumStride);
    _tile_stored(2, s + kLower, kSumStride);
    if (two) {
      _tile_stored(1, s + kBlock, kSumStride);
      _tile_stored(3, s + kLower + kBlock, kSumStride);
    }
  }
}

}  // namespace fiberserve::amx

#endif
