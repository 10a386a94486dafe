// The AVX2 tiles' epilogue (avx2/linear_bf16.h, avx2/linear_quant.h): a tile's float32 sums, which it leaves in a
// buffer, plus bias, to the product's output.

#pragma once

#include <cstdint>

#include "gated_add.h"
#include "simd/vec16.h"

namespace fiberserve {

// MR rows x NR blocks of 16 sums (plus bias, if any) to out (row stride ldo).  kGated: the first NR / 2 blocks are
// gate outputs and the others the matching up outputs (see GateUp in linear.py); the tile writes silu(gate) * up,
// NR / 2 blocks, each input rounded to out_t first as a separate product and silu_mul would see it, or where
// `add` adds to the row, the sums plus its additions (gated_add.h).
template <int MR, int NR, bool kGated, typename out_t>
inline void store_tile(const float (&sums)[MR][NR][kLanes], const float* bias, out_t* out, int64_t ldo,
                       const GatedAdd& add = {}) {
  for (int r = 0; r < MR; ++r) {
    f32x16 y[NR];
    for (int c = 0; c < NR; ++c) {
      y[c] = load16(sums[r][c]);
      if (bias) y[c] += load16(bias + c * kLanes);
      if constexpr (!kGated) store16(out + r * ldo + c * kLanes, y[c]);
    }
    if constexpr (kGated)
      for (int c = 0; c < NR / 2; ++c)
        store16(out + r * ldo + c * kLanes,
                add.adds(r) ? silu_times(y[c] + load16(add.gate + r * add.ld + c * kLanes),
                                         y[c + NR / 2] + load16(add.up + r * add.ld + c * kLanes))
                            : silu_times(stored16(y[c], out), stored16(y[c + NR / 2], out)));
  }
}

}  // namespace fiberserve
