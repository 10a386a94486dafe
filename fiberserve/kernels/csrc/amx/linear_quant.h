// linear_quant.cpp's 16-row tiles on AMX's int8 tile unit: tdpbsud multiplies signed activation bytes by
// unsigned weight bytes into int32, 16 rows x 16 output features x one scale group (32 or 16 inputs) a product.
//
// A scale group's integer sums are exact on either unit, and this tile scales them into float32 with the vector
// tile's own scale_group (avx512/linear_quant.h), group after group in order: a row gets the same bits here as on
// the vpdpbusd tiles, so a product runs its whole 16-row tiles here and the rows left over there, and rows stay
// batch invariant.
//
// A B tile is kK / 4 lines of 16 outputs x 4 inputs, the packed layout's 64-byte steps (linear_quant.cpp): the
// 8-bit layout's are read in place, the 2-, 3-, 4- and 6-bit layouts' unpacked into bytes first, as the vector
// tile unpacks them in registers.  Two C tiles alternate, so one group's tile product runs while the previous
// group's sums are scaled on the vector units.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define FIBERSERVE_AMX_INT8 1

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "amx/tiles.h"

namespace fiberserve {
namespace {

// Whether a product of M rows runs its 16-row tiles on AMX: built with them, granted by the OS, and a tile's rows.
inline bool amx_int8_runs(int64_t M) { return M >= kAmxRows && amx::amx_ready(); }

// The pairs of scale groups an AMX tile of format F walks over K inputs: the calls of its between().
template <typename F>
inline int64_t amx_pairs(int64_t K) {
  return (K / F::kScaleGroup + 1) / 2;
}

// C tiles (16 rows of 16 int32) in tmm0..tmm3; A (16 rows x kK bytes) in tmm4 and tmm5; B (kK / 4 lines of 64
// bytes) in tmm6 and tmm7.
template <int kK>
void amx_int8_configure() {
  static const amx::TileConfig config = [] {
    amx::TileConfig c;
    for (int t = 0; t < 4; ++t) c.bytes_per_row[t] = 64, c.rows[t] = kAmxRows;
    for (int t = 4; t < 6; ++t) c.bytes_per_row[t] = kK, c.rows[t] = kAmxRows;
    for (int t = 6; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = kK / 4;
    return c;
  }();
  _tile_loadconfig(&config);
}

// What a thread's share of a product in format F holds while it runs: the tile configuration, where AMX runs.
template <typename F>
class AmxInt8Scope {
 public:
  explicit AmxInt8Scope(bool runs) : runs_(runs) {
    if (runs) amx_int8_configure<F::kScaleGroup>();
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
  if constexpr (F::kBits == 8) {
    return w + g * F::kScaleGroup / 4 * 64;
  } else if constexpr (F::kHalves) {
    const uint8_t* block = w + g / 2 * F::kBlockBytes;
    const auto unpack = [&](auto h) {
      constexpr int kHalf = decltype(h)::value;
      _mm512_store_si512(bytes, half_block_q<F::kBits, kHalf, 0>(block));
      _mm512_store_si512(bytes + 64, half_block_q<F::kBits, kHalf, 1>(block));
      _mm512_store_si512(bytes + 128, half_block_q<F::kBits, kHalf, 2>(block));
      _mm512_store_si512(bytes + 192, half_block_q<F::kBits, kHalf, 3>(block));
    };
    if (g % 2) unpack(std::integral_constant<int, 1>{});
    else unpack(std::integral_constant<int, 0>{});
    return bytes;
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

// The tile products of a pair of scale groups (the second where `two`) for NR (1 or 2) column blocks: group i's A
// tile in tmm4 + i, column block c's B tile in tmm6 + c, the sums of (group i, column block c) in C tile tmm(2 i +
// c).  Tile instructions name their registers in the instruction, hence one line per tile.
template <int NR>
[[gnu::always_inline]] inline void pair_products(const int8_t* a, int64_t lda, int64_t a_step,
                                                 const uint8_t* const (&b)[2][2], bool two) {
  _tile_loadd(4, a, lda);
  _tile_loadd(6, b[0][0], 64);
  _tile_zero(0);
  _tile_dpbsud(0, 4, 6);
  if constexpr (NR == 2) {
    _tile_loadd(7, b[0][1], 64);
    _tile_zero(1);
    _tile_dpbsud(1, 4, 7);
  }
  if (!two) return;
  _tile_loadd(5, a + a_step, lda);
  _tile_loadd(6, b[1][0], 64);
  _tile_zero(2);
  _tile_dpbsud(2, 5, 6);
  if constexpr (NR == 2) {
    _tile_loadd(7, b[1][1], 64);
    _tile_zero(3);
    _tile_dpbsud(3, 5, 7);
  }
}

// The C tiles of pair_products, stored: (group i, column block c) at sums[i][c], 16 rows of 16 int32.
template <int NR>
[[gnu::always_inline]] inline void store_pair_sums(int32_t (&sums)[2][2][kAmxRows * kBlock], bool two) {
  constexpr int64_t kStride = kBlock * sizeof(int32_t);
  _tile_stored(0, sums[0][0], kStride);
  if constexpr (NR == 2) _tile_stored(1, sums[0][1], kStride);
  if (!two) return;
  _tile_stored(2, sums[1][0], kStride);
  if constexpr (NR == 2) _tile_stored(3, sums[1][1], kStride);
}

// The vector tile's contract (tile in avx512/linear_quant.h) for 16 rows, on AMX.  The scale groups go in pairs:
// a pair's sums are stored, the next pair's tile products issued, and the stored sums scaled on the vector units
// while the tile unit computes; a pair's weights are unpacked two pairs ahead, so its tile loads find them in cache.
// between() runs after each pair (amx_pairs of them): a few lines of the prefetches the caller spreads over the
// tile, where the vector tiles issue theirs after each tile.
template <int NR, typename F, bool kGated, typename out_t, typename Between>
[[gnu::noinline]] void amx_tile(const QuantizedRows& x, int64_t row0, const ColumnBlocks<F>& cols, const float* bias,
                                out_t* out, int64_t ldo, const GatedAdd& add, const Between& between) {
  static_assert(NR == 1 || NR == 2, "AMX tiles take one or two column blocks");
  constexpr int kK = F::kScaleGroup;
  const int64_t groups = x.K / kK;
  alignas(64) uint8_t unpacked[2][2][2][kK * kBlock];  // [pair parity][group of the pair][column block]
  alignas(64) int32_t sums_out[2][2][kAmxRows * kBlock];  // [group of the pair][column block]
  const int8_t* a = x.q + row0 * x.K;
  const auto weights = [&](int64_t g, int parity, const uint8_t* (&b)[2][2]) {  // pair from g's B tiles
    for (int i = 0; i < 2 && g + i < groups; ++i)
      for (int c = 0; c < NR; ++c)
        b[i][c] = group_weights<F>(cols.w + c * cols.w_stride, g + i, unpacked[parity][i][c]);
  };
  __m512 acc[kAmxRows][NR];
  for (int r = 0; r < kAmxRows; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  const auto scale = [&](int64_t g, int i) {  // group g's sums, the pair's i-th, scaled into acc
    __m512i sums[kAmxRows][NR];
    for (int r = 0; r < kAmxRows; ++r) {  // signed formats' sums start at -zero * sum(xq), as on vpdpbusd
      const __m512i start = _mm512_set1_epi32(F::kMins ? 0 : x.offset_of<kK>(row0 + r, g) / (128 / F::kZero));
      for (int c = 0; c < NR; ++c)
        sums[r][c] = _mm512_add_epi32(_mm512_load_si512(sums_out[i][c] + r * kBlock), start);
    }
    scale_group<kAmxRows, NR, F>(x, row0, g / F::kScalesPerBlock, g, sums, cols, acc);
  };
  const uint8_t* b[2][2][2] = {};  // [pair parity] B tiles
  const auto issue = [&](int64_t g) { pair_products<NR>(a + g * kK, x.K, kK, b[g / 2 % 2], g + 1 < groups); };
  weights(0, 0, b[0]);
  issue(0);
  if (groups > 2) weights(2, 1, b[1]);
  for (int64_t g = 0; g < groups; g += 2) {
    store_pair_sums<NR>(sums_out, g + 1 < groups);
    if (g + 2 < groups) issue(g + 2);
    if (g + 4 < groups) weights(g + 4, g / 2 % 2, b[g / 2 % 2]);  // the pair whose tile loads are done
    scale(g, 0);
    if (g + 1 < groups) scale(g + 1, 1);
    between();
  }
  finish_tile<kAmxRows, NR, kGated>(acc, bias, out, ldo, add);
}

}  // namespace
}  // namespace fiberserve

#endif
