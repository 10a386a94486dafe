// Additions to a gated gate/up product's sums before its activation (LoRA adapters' rows; see LoraAdditions in
// decoder_layers.cpp).

#pragma once

#include <cstdint>

namespace fiberserve {

// Where rows[r], output row r's gate and up sums of feature f take gate[r * ld + f] and up[r * ld + f] (float32,
// after the bias) and SiLU x up is taken of the float32 results; other rows are activated as without (gate and up
// rounded to the output's dtype first, as a separate product and silu_mul would see them).  A default one adds
// nothing.  at() moves the origin to a tile's first row and feature, as the kernels move their output pointer.
struct GatedAdd {
  const float* gate = nullptr;
  const float* up = nullptr;
  int64_t ld = 0;
  const bool* rows = nullptr;

  bool adds(int64_t row) const { return rows != nullptr && rows[row]; }
  GatedAdd at(int64_t row, int64_t feature) const {
    if (rows == nullptr) return {};
    return {gate + row * ld + feature, up + row * ld + feature, ld, rows + row};
  }
};

}  // namespace fiberserve
