// linear_bf16.cpp's row tile for CPUs with AVX2 and FMA but no AVX512-BF16: the same packed layout
// ([N / 16][K / 2][16][2]) and vdpbf16ps's arithmetic done by hand.
//
// vdpbf16ps adds, per float32 lane, the product of the odd bf16 pair members and then that of the even ones (the
// order of Intel's pseudo-code, each addition rounded to nearest even).  A bf16 is the top half of a float32, and
// the product of two has at most 16 significant bits, so it is exact in float32: a fused multiply-add per member,
// odd then even, rounds each addition exactly as that pseudo-code does.  (vdpbf16ps also treats denormal inputs
// and results as zero, which a multiply-add does not; activations and weights of a served model are not
// denormal.)  Every output is still accumulated over k in order in its own lane, so rows stay batch invariant.
//
// Registers: 16 ymm.  A column block's two halves for 5 rows take 10 float sums, the block's weights widened to
// float32 4 (even and odd k, per half) and a broadcast 1: the tile walks its column blocks one at a time (tiles of
// one or two rows: 4 or 2 at a time), all its rows at once, into a buffer the epilogue reads.  The rows are
// widened to float32 once per product, so a broadcast is a plain load.  Weights: a column group of 4 blocks is
// 64 outputs x K bf16, read from L2 by each row tile.

#pragma once

#include <immintrin.h>

#include "avx2/store.h"

namespace fiberserve {
namespace {

constexpr int kBlock = 16;  // output features per packed block (two ymm of float32 sums)
constexpr int kCols = 4;    // blocks per column group: 64 output features
constexpr int kRows = 5;    // rows per tile: 5 x 2 sums, 4 widened weight vectors, a broadcast
constexpr bool kBalancedTiles = true;  // 16 rows as 4 x 4, not 5 + 5 + 5 + 1: one row has 2 sums in flight

// The rows as the tiles read them: x widened to float32 once per product (exact), so that a broadcast is a plain
// load.  (Widened per tile instead, a row was widened once per column group: 768 times in the output head.)
using Row = float;
inline at::Tensor tile_rows(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }
inline const Row* row_data(const at::Tensor& rows) { return rows.data_ptr<float>(); }

// A float broadcast to 8 lanes, loaded here and now (GCC would otherwise keep the broadcasts of a row tile in
// registers for the next k pair's, and push the sums onto the stack).
inline __m256 broadcast(const float* p) {
  __m256 v;
  __asm__ volatile("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
  return v;
}

// NB packed blocks (16 outputs each, all K; block_stride apart) against MR rows of x widened to float32 (row
// stride ldx): the float32 sums, to result (row stride ldr, block b at 16 b).  Per k pair and block: its weights
// widened (4 vectors), then per row the odd member's broadcast into both halves' sums, then the even one's.  NB > 1
// for tiles of one or two rows, whose sums would otherwise be too few chains of dependent multiply-adds to keep
// the units busy (a one-row block has 2; reading 4 blocks at once gives 8).  Each sum's arithmetic is the same
// whatever NB, so the rows keep their bits.
template <int MR, int NB>
[[gnu::always_inline]] inline void block_sums(const float* x, int64_t ldx, const uint16_t* w, int64_t block_stride,
                                              int64_t pairs, float* result, int64_t ldr) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[NB][MR][2];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < MR; ++r) acc[b][r][0] = acc[b][r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int b = 0; b < NB; ++b) {
      __m256 even[2], odd[2];  // outputs 0-7 and 8-15: k = 2p and 2p + 1
      for (int h = 0; h < 2; ++h) {
        const uint16_t* at = w + b * block_stride + p * 2 * kBlock + 16 * h;
        const __m256i pairs8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs8, 16));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(pairs8, high));
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 xo = broadcast(x + r * ldx + 2 * p + 1);  // odd first, as vdpbf16ps
        for (int h = 0; h < 2; ++h) acc[b][r][h] = _mm256_fmadd_ps(xo, odd[h], acc[b][r][h]);
        const __m256 xe = broadcast(x + r * ldx + 2 * p);
        for (int h = 0; h < 2; ++h) acc[b][r][h] = _mm256_fmadd_ps(xe, even[h], acc[b][r][h]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) _mm256_store_ps(result + r * ldr + kBlock * b + 8 * h, acc[b][r][h]);
}

// The AVX-512 tile's contract (see linear_bf16.cpp): MR rows x NR blocks of the product, plus bias, to out; kGated:
// the first NR / 2 blocks are gate outputs and the others the matching up outputs, written as silu(gate) * up.
template <int MR, int NR, bool kGated, typename out_t>
[[gnu::noinline]] void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t pairs, int64_t block_stride,
                            const float* bias, out_t* out, int64_t ldo, const GatedAdd& add = {}) {
  alignas(64) float result[MR][NR][kBlock];
  constexpr int NB = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // blocks at once: 8 sums or more (see block_sums)
  int c = 0;
  for (; c + NB <= NR; c += NB)
    block_sums<MR, NB>(x, ldx, w + c * block_stride, block_stride, pairs, result[0][c], NR * kBlock);
  for (; c < NR; ++c) block_sums<MR, 1>(x, ldx, w + c * block_stride, block_stride, pairs, result[0][c], NR * kBlock);
  store_tile<MR, NR, kGated>(result, bias, out, ldo, add);
}

}  // namespace
}  // namespace fiberserve
