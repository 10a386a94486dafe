// The k largest values of each row (k <= 64), largest first; equal values in index order, so k = 1 is
// torch.argmax's first maximum.  One pass per row: 16 values at a time are compared with the current k-th
// best, and only the rare lanes above it are inserted.  Rows run in parallel; a row's result depends on the
// row alone.  NaN is never selected (a row of NaN gives index -1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>

#include "ops.h"
#include "vec16.h"

namespace fiberserve {
namespace {

constexpr int64_t kMaxK = 64;

// Whether any lane of a comparison result (0 or -1 per lane) is set.
inline bool any_lane(i32x16 m) {
  m |= __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  m |= __builtin_shufflevector(m, m, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  m |= __builtin_shufflevector(m, m, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  m |= __builtin_shufflevector(m, m, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return m[0] != 0;
}

template <typename scalar_t>
void top_k_row(const scalar_t* x, int64_t n, int64_t k, float* values, int64_t* indices) {
  float best[kMaxK];
  int64_t where[kMaxK];
  for (int64_t i = 0; i < k; ++i) best[i] = -std::numeric_limits<float>::infinity(), where[i] = -1;
  auto insert = [&](float value, int64_t index) {  // after the equal values already there
    if (value != value || (where[k - 1] >= 0 && !(value > best[k - 1]))) return;
    int64_t i = k - 1;
    for (; i > 0 && (where[i - 1] < 0 || value > best[i - 1]); --i) best[i] = best[i - 1], where[i] = where[i - 1];
    best[i] = value, where[i] = index;
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f32x16 v = load16(x + j);
    if (where[k - 1] >= 0 && !any_lane(v > (f32x16{} + best[k - 1]))) continue;  // the common case
    for (int l = 0; l < kLanes; ++l) insert(v[l], j + l);
  }
  for (; j < n; ++j) insert(static_cast<float>(x[j]), j);
  for (int64_t i = 0; i < k; ++i) values[i] = best[i], indices[i] = where[i];
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> top_k_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "top_k_rows: x must be a CPU matrix [rows, n]");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= x.size(1), "top_k_rows: k must be in [1, min(64, n)]");
  const at::Tensor a = x.contiguous();
  const int64_t rows = a.size(0), n = a.size(1);
  at::Tensor values = at::empty({rows, k}, a.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({rows, k}, a.options().dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* xp = a.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) top_k_row(xp + r * n, n, k, vp + r * k, ip + r * k);
    });
  };
  switch (a.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "top_k_rows supports float32 and bfloat16, not ", a.scalar_type());
  }
  return {values, indices};
}

}  // namespace fiberserve
