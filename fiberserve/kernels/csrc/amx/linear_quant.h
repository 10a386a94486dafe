// linear_quant.cpp's 16-row tiles on AMX's int8 tile unit: tdpbsud multiplies signed activation bytes by
// unsigned weight bytes into int32, 16 rows x 16 output features x one scale group of 32 inputs a product.
//
// A scale group's integer sums are exact on either unit, and this tile scales them into float32 with the vector
// tile's own scale_group (avx512/linear_quant.h), group after group in order: a row gets the same bits here as on
// the vpdpbusd tiles, so a product runs its whole 16-row tiles here and the rows left over there, and rows stay
// batch invariant.
//
// A B tile is 8 lines of 16 outputs x 4 inputs, the packed layout's 64-byte steps (linear_quant.cpp): the 8-bit
// layout's are read in place, the 4-bit layout's unpacked into bytes first, as the vector tile unpacks them in
// registers.  Two C tiles alternate, so one group's tile product runs while the previous group's sums are scaled
// on the vector units.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FIBERSERVE_AMX_INT8 1

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "amx/tiles.h"

namespace fiberserve {
namespace {

// Whether format F runs on these tiles: those with a scale per 32 inputs.  A scale per 16 (Q6_K, Q3_K, Q2_K) halves
// each tile product's work but not the tile unit's loads and stores per product, and those formats run slower here
// than on the vector tiles from 32 rows on (docs/performance.md).
template <typename F>
constexpr bool kOnAmx = F::kScaleGroup == kGroup;

// Whether a product of M rows in format F runs its 16-row tiles on AMX: a format these tiles take, a tile's rows,
// and the tiles granted by the OS.
template <typename F>
inline bool amx_int8_runs(int64_t M) {
  return kOnAmx<F> && M >= kAmxRows && amx::amx_ready();
}

// The prefetch steps an AMX tile over K inputs takes (calls of its between()): one per scale group of each of its
// kCols column blocks.
inline int64_t amx_steps(int64_t K) { return kCols * (K / kGroup); }

// C tiles (16 rows of 16 int32) in tmm0 and tmm1; A (16 rows x 32 bytes) in tmm2 and tmm3; B (8 lines of 64 bytes)
// in tmm4 and tmm5: a scale group's three in tmm(p), tmm(2 + p), tmm(4 + p), p alternating.
inline void amx_int8_configure() {
  static const amx::TileConfig config = [] {
    amx::TileConfig c;
    for (int p = 0; p < 2; ++p) {
      c.bytes_per_row[p] = 64, c.rows[p] = kAmxRows;
      c.bytes_per_row[2 + p] = kGroup, c.rows[2 + p] = kAmxRows;
      c.bytes_per_row[4 + p] = 64, c.rows[4 + p] = kGroup / 4;
    }
    return c;
  }();
  _tile_loadconfig(&config);
}

// What a thread's share of a product holds while it runs: the tile configuration, where AMX runs.
class AmxInt8Scope {
 public:
  explicit AmxInt8Scope(bool runs) : runs_(runs) {
    if (runs) amx_int8_configure();
  }
  ~AmxInt8Scope() {
    if (runs_) amx::amx_release();
  }
  AmxInt8Scope(const AmxInt8Scope&) = delete;
  AmxInt8Scope& operator=(const AmxInt8Scope&) = delete;

 private:
  bool runs_;
};

// The B tile of scale group g of a column block's weights w: in place (bytes), or unpacked into `bytes`.
template <typename F>
[[gnu::always_inline]] inline const uint8_t* group_weights(const uint8_t* w, int64_t g, uint8_t* bytes) {
  static_assert(kOnAmx<F>, "a scale per 32 inputs");
  if constexpr (F::kBits == 8) {
    return w + g * (kGroup / 4) * 64;
  } else {  // 4 bits, a scale per block: the low nibbles hold inputs 0..15, the high ones 16..31
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + (g * 4 + j) * 64);
      _mm512_store_si512(bytes + j * 64, _mm512_and_si512(v, low));
      _mm512_store_si512(bytes + (4 + j) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
    return bytes;
  }
}

// A scale group's tile product into C tile p (0 or 1), and its sums stored: tile instructions name their registers
// in the instruction, hence a function per C tile.
[[gnu::always_inline]] inline void group_product(std::integral_constant<int, 0>, const int8_t* a, int64_t lda,
                                                 const uint8_t* b) {
  _tile_loadd(2, a, lda);
  _tile_loadd(4, b, 64);
  _tile_zero(0);
  _tile_dpbsud(0, 2, 4);
}

[[gnu::always_inline]] inline void group_product(std::integral_constant<int, 1>, const int8_t* a, int64_t lda,
                                                 const uint8_t* b) {
  _tile_loadd(3, a, lda);
  _tile_loadd(5, b, 64);
  _tile_zero(1);
  _tile_dpbsud(1, 3, 5);
}

[[gnu::always_inline]] inline void store_sums(std::integral_constant<int, 0>, int32_t* sums) {
  _tile_stored(0, sums, kBlock * sizeof(int32_t));
}

[[gnu::always_inline]] inline void store_sums(std::integral_constant<int, 1>, int32_t* sums) {
  _tile_stored(1, sums, kBlock * sizeof(int32_t));
}

// acc[r] += rows row0..row0+15 of x times one column block, every scale group in order.  Group g + 1's tile
// product is issued before group g's sums are stored and scaled, so the tile unit computes while the vector units
// scale; a group's weights are unpacked a group ahead of its tile loads.  between() after every group.
template <typename F, typename Between>
[[gnu::always_inline]] inline void amx_column_block(const QuantizedRows& x, int64_t row0, const ColumnBlocks<F>& col,
                                                    __m512 (&acc)[kAmxRows][1], const Between& between) {
  const int64_t groups = x.K / kGroup;
  alignas(64) uint8_t unpacked[2][kGroup * kBlock];
  alignas(64) int32_t sums_out[kAmxRows * kBlock];
  const int8_t* a = x.q + row0 * x.K;
  const uint8_t* b[2] = {};
  const auto issue = [&](auto p, int64_t g) { group_product(p, a + g * kGroup, x.K, b[decltype(p)::value]); };
  const auto scale = [&](auto p, int64_t g) {
    store_sums(p, sums_out);
    __m512i sums[kAmxRows][1];
    for (int r = 0; r < kAmxRows; ++r) {  // signed formats' sums start at -zero * sum(xq), as on vpdpbusd
      const int32_t start = F::kMins ? 0 : x.offset_of<kGroup>(row0 + r, g) / (128 / F::kZero);
      sums[r][0] = _mm512_add_epi32(_mm512_load_si512(sums_out + r * kBlock), _mm512_set1_epi32(start));
    }
    scale_group<kAmxRows, 1, F>(x, row0, g / F::kScalesPerBlock, g, sums, col, acc);
    between();
  };
  // Group g's three steps, p = g % 2: its product issued, the weights of g + 2 unpacked, g's sums scaled.
  const auto group = [&](auto p, int64_t g) {
    constexpr int kNext = 1 - decltype(p)::value;
    if (g + 1 < groups) issue(std::integral_constant<int, kNext>{}, g + 1);
    if (g + 2 < groups) b[decltype(p)::value] = group_weights<F>(col.w, g + 2, unpacked[decltype(p)::value]);
    scale(p, g);
  };
  constexpr std::integral_constant<int, 0> kEven;
  constexpr std::integral_constant<int, 1> kOdd;
  b[0] = group_weights<F>(col.w, 0, unpacked[0]);
  issue(kEven, 0);
  if (groups > 1) b[1] = group_weights<F>(col.w, 1, unpacked[1]);
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    group(kEven, g);
    group(kOdd, g + 1);
  }
  if (g < groups) group(kEven, g);
}

// The vector tile's contract (tile in avx512/linear_quant.h) for 16 rows, on AMX: a column block at a time, its
// float sums in registers.
template <int NR, typename F, bool kGated, typename out_t, typename Between>
[[gnu::noinline]] void amx_tile(const QuantizedRows& x, int64_t row0, const ColumnBlocks<F>& cols, const float* bias,
                                out_t* out, int64_t ldo, const GatedAdd& add, const Between& between) {
  __m512 acc[kAmxRows][NR];
  for (int c = 0; c < NR; ++c) {
    __m512 column[kAmxRows][1];
    for (int r = 0; r < kAmxRows; ++r) column[r][0] = _mm512_setzero_ps();
    const ColumnBlocks<F> col{cols.w + c * cols.w_stride, cols.d + c * cols.dm_stride,
                              cols.m ? cols.m + c * cols.dm_stride : nullptr, cols.w_stride, cols.dm_stride};
    amx_column_block<F>(x, row0, col, column, between);
    for (int r = 0; r < kAmxRows; ++r) acc[r][c] = column[r][0];
  }
  finish_tile<kAmxRows, NR, kGated>(acc, bias, out, ldo, add);
}

}  // namespace
}  // namespace fiberserve

#endif
