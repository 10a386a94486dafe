// A running top-k list, shared by top_k_rows (over a row of logits) and the products' top-k kernels
// (quant_linear_race, bf16_linear_race: over a product's outputs as its tiles produce them, so the logits are
// never written).

#pragma once

#include <cstdint>
#include <limits>

#include "simd/vec16.h"

namespace fiberserve {

// The k largest values offered so far (k <= kMax), largest first; equal values in the order they were offered,
// so offering a row's values in index order keeps torch.argmax's first maximum first.  NaN is never kept; an
// entry not filled has index -1.  Two lists of disjoint index ranges merge by offering the lower range's entries,
// then the higher's, in list order: the result is the list of the whole range.
class TopK {
 public:
  static constexpr int64_t kMax = 64;

  explicit TopK(int64_t k = 1) : k_(k) {
    for (int64_t i = 0; i < k_; ++i) value_[i] = -std::numeric_limits<float>::infinity(), index_[i] = -1;
  }

  void offer(float value, int64_t index) {  // after the equal values already there
    if (value != value || (index_[k_ - 1] >= 0 && !(value > value_[k_ - 1]))) return;
    int64_t i = k_ - 1;
    for (; i > 0 && (index_[i - 1] < 0 || value > value_[i - 1]); --i) value_[i] = value_[i - 1], index_[i] = index_[i - 1];
    value_[i] = value, index_[i] = index;
  }

  // Whether one of 16 values would enter the list (it is not full, or a value is above its k-th best).
  bool reaches(f32x16 values) const { return !full() || any_lane(values > (f32x16{} + value_[k_ - 1])); }

  bool full() const { return index_[k_ - 1] >= 0; }
  float last() const { return value_[k_ - 1]; }  // the k-th best (when full)

  // 16 values with consecutive indices from `first`: only the rare lanes above the k-th best are offered.
  void offer16(f32x16 values, int64_t first) {
    if (!reaches(values)) return;  // the common case
    for (int l = 0; l < kLanes; ++l) offer(values[l], first + l);
  }

  void offer_all(const TopK& other) {
    for (int64_t i = 0; i < other.k_ && other.index_[i] >= 0; ++i) offer(other.value_[i], other.index_[i]);
  }

  int64_t k() const { return k_; }
  float value(int64_t i) const { return value_[i]; }
  int64_t index(int64_t i) const { return index_[i]; }

 private:
  int64_t k_;
  float value_[kMax];
  int64_t index_[kMax];
};

}  // namespace fiberserve
