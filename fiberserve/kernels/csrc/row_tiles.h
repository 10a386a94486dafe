// Rows in tiles of a compile-time height, for the products' kernels (linear_bf16.cpp, linear_quant.cpp): a tile's
// height is a template parameter, so its accumulators live in registers, and the last tile of a product takes
// whatever rows are left.

#pragma once

#include <cstdint>
#include <type_traits>

namespace fiberserve {

namespace detail {

template <int kHeight, typename Tile>
inline void last_tile(int64_t rows, int64_t r, const Tile& tile) {
  if constexpr (kHeight > 0) {
    if (rows == kHeight) return tile(std::integral_constant<int, kHeight>{}, r);
    last_tile<kHeight - 1>(rows, r, tile);
  }
}

}  // namespace detail

// Rows [r, end) as tiles of at most kRows rows: tile(std::integral_constant<int, height>{}, first_row) for each.
// Packed (kBalanced false): tiles of kRows rows and one last tile of the 1..kRows-1 rows left (if any), and
// after_full() after each full tile.  Balanced: ceil(rows / kRows) tiles whose heights differ by one at most (16
// rows at kRows = 5: 4 + 4 + 4 + 4, not 5 + 5 + 5 + 1), for tiles that a row or two leave waiting on their few
// sums' latency (avx2/linear_bf16.h), and after_full() after each.
template <int kRows, bool kBalanced = false, typename Tile, typename AfterFull>
inline void for_each_row_tile(int64_t r, int64_t end, const Tile& tile, const AfterFull& after_full) {
  if constexpr (kBalanced) {
    const int64_t rows = end - r, tiles = (rows + kRows - 1) / kRows;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t first = r + t * rows / tiles;
      detail::last_tile<kRows>(r + (t + 1) * rows / tiles - first, first, tile);
      after_full();
    }
    return;
  }
  for (; r + kRows <= end; r += kRows) {
    tile(std::integral_constant<int, kRows>{}, r);
    after_full();
  }
  detail::last_tile<kRows - 1>(end - r, r, tile);
}

}  // namespace fiberserve
