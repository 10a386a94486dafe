// Memory a compute-bound kernel pulls into cache as it runs, for the kernel after it: the decoder loop hands the
// next layer's keys and values to the gate/up product, whose tiles keep the cores busy with arithmetic while the
// lines arrive.  Paged attention alone reads them at the speed of memory with little arithmetic to hide it behind
// (it runs about twice as fast with the K/V in cache).

#pragma once

#include <ATen/Parallel.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace fiberserve {

using ByteRange = std::pair<const char*, int64_t>;

// Byte ranges, in the order their user will read them.
struct PrefetchPlan {
  std::vector<ByteRange> ranges;
};

// Ranges issued a few cache lines at a time: call step() once per tile, `tiles` times in all.
class PrefetchCursor {
 public:
  PrefetchCursor() = default;

  PrefetchCursor(const ByteRange* first, const ByteRange* last, int64_t tiles) : range_(first), end_(last) {
    if (tiles <= 0) return;
    int64_t lines = 0;
    for (auto* r = range_; r < end_; ++r) lines += (r->second + 63) / 64;
    per_step_ = (lines + tiles - 1) / tiles;
  }

  // The calling thread's share of a plan: its ranges split evenly by index between the region's threads.  The
  // team's size comes from OpenMP itself: at::get_num_threads() is the pool's size, which a region with fewer
  // work items than threads does not fill, and inside a region on a worker thread it returns 1 (the worker's
  // share would then run past the plan's end).
  static PrefetchCursor thread_share(const PrefetchPlan* plan, int64_t tiles) {
    if (plan == nullptr || plan->ranges.empty()) return {};
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads();
#else
    const int64_t threads = 1;
#endif
    const int64_t count = static_cast<int64_t>(plan->ranges.size()), thread = std::min<int64_t>(at::get_thread_num(), threads - 1);
    const ByteRange* ranges = plan->ranges.data();
    return PrefetchCursor(ranges + count * thread / threads, ranges + count * (thread + 1) / threads, tiles);
  }

  void step() {
    for (int64_t n = 0; n < per_step_ && range_ < end_; ++n) {
      __builtin_prefetch(range_->first + offset_, 0, 2);
      offset_ += 64;
      if (offset_ >= range_->second) ++range_, offset_ = 0;
    }
  }

 private:
  const ByteRange* range_ = nullptr;
  const ByteRange* end_ = nullptr;
  int64_t offset_ = 0, per_step_ = 0;
};

}  // namespace fiberserve
