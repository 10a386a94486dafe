// Paged attention for CPU: every query row attends to its own sequence's keys, read in place from the
// KV cache through the sequence's page table.
//
// Contract (see fiberserve/model/kernels/__init__.py for the Python side):
//   q        [T, H, D]          float32 / bfloat16 / float16; rows may be strided, heads and dims packed
//   k, v     [slots, KVH, D]    one layer of the cache, same dtype as q, contiguous
//   pages    int32 [S, P]       page table of each sequence (span); slot = page * page_size + offset
//   row_span int32 [T]          the span of each row, or -1 for a padding row (output zero)
//   row_keys int32 [T]          how many keys the row sees (its position + 1: causal)
//   returns  [T, H * D]         query head qh reads kv head qh / (H / KVH)
//
// Batch invariance: a row's result depends only on its query and its keys.  Each (row, kv head) is one
// work item with a fixed order of operations (float32 dot products with 16 fixed partial sums, a two-pass
// softmax, a float32 weighted sum in key order), so a row computes the same bits alone, inside any batch,
// as a decode token or inside a prefill chunk of any length.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace fiberserve {
namespace {

constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kMaxChunks = 16;  // head_dim / 16

// One (row, kv head) work item: the G query heads sharing the kv head, against the row's n keys, read a page
// (page_size consecutive slots) at a time.  kChunks = head_dim / 16 when fixed at compile time, else 0.
template <typename scalar_t, int kChunks>
struct Attend {
  const scalar_t *q, *k, *v;
  const int32_t *pages, *span_of, *keys_of;
  scalar_t* out;
  int64_t q_row_stride, heads, kv_heads, dim, max_pages, page_size;
  float scale;

  void run(int64_t begin, int64_t end) const {
    const int64_t C = kChunks ? kChunks : dim / kLanes, D = C * kLanes, G = heads / kv_heads;
    const int64_t slot_stride = kv_heads * D;
    f32x16 query[kMaxGroup][kMaxChunks], acc[kMaxGroup][kMaxChunks], key[kMaxChunks];
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, head = item % kv_heads;
      scalar_t* o = out + (row * heads + head * G) * D;
      const int32_t span = span_of[row];
      if (span < 0) {
        std::fill(o, o + G * D, scalar_t(0));
        continue;
      }
      const int64_t n = keys_of[row], padded = (n + kLanes - 1) / kLanes * kLanes;
      const int32_t* table = pages + span * max_pages;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) query[g][c] = load16(q + row * q_row_stride + (head * G + g) * D + c * kLanes);
      scores.assign(G * padded, 0.0f);

      for (int64_t first = 0; first < n; first += page_size) {
        const scalar_t* page = k + (static_cast<int64_t>(table[first / page_size]) * page_size * kv_heads + head) * D;
        for (int64_t j = 0, count = std::min(page_size, n - first); j < count; ++j) {
          for (int64_t c = 0; c < C; ++c) key[c] = load16(page + j * slot_stride + c * kLanes);
          for (int64_t g = 0; g < G; ++g) {
            f32x16 sum = query[g][0] * key[0];
            for (int64_t c = 1; c < C; ++c) sum += query[g][c] * key[c];
            scores[g * padded + first + j] = lane_sum(sum) * scale;
          }
        }
      }

      float total[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * padded;
        float top = s[0];
        for (int64_t j = 1; j < n; ++j) top = s[j] > top ? s[j] : top;
        f32x16 sum = {};
        for (int64_t j = 0; j < padded; j += kLanes) {
          f32x16 e = exp_nonpositive(load16(s + j) - top);
          for (int64_t l = 0; l < kLanes; ++l) e[l] = j + l < n ? e[l] : 0.0f;  // padding: zero weight
          std::memcpy(s + j, &e, sizeof e);
          sum += e;
        }
        total[g] = lane_sum(sum);
      }

      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) acc[g][c] = f32x16{};
      for (int64_t first = 0; first < n; first += page_size) {
        const scalar_t* page = v + (static_cast<int64_t>(table[first / page_size]) * page_size * kv_heads + head) * D;
        for (int64_t j = 0, count = std::min(page_size, n - first); j < count; ++j) {
          for (int64_t c = 0; c < C; ++c) key[c] = load16(page + j * slot_stride + c * kLanes);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * padded + first + j];
            for (int64_t c = 0; c < C; ++c) acc[g][c] += p * key[c];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.0f / total[g];
        for (int64_t c = 0; c < C; ++c)
          store16(o + g * D + c * kLanes, acc[g][c] * inv);
      }
    }
  }
};

template <typename scalar_t, int kChunks>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
            const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale,
            at::Tensor& out) {
  const Attend<scalar_t, kChunks> work{q.data_ptr<scalar_t>(),       k.data_ptr<scalar_t>(),
                                       v.data_ptr<scalar_t>(),       pages.data_ptr<int32_t>(),
                                       row_span.data_ptr<int32_t>(), row_keys.data_ptr<int32_t>(),
                                       out.data_ptr<scalar_t>(),     q.stride(0),                  q.size(1),
                                       k.size(1),                    q.size(2),
                                       pages.size(1),                page_size,
                                       static_cast<float>(scale)};
  at::parallel_for(0, q.size(0) * k.size(1), 1, [&](int64_t begin, int64_t end) { work.run(begin, end); });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                           const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention runs on CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [rows, heads, dim]");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "head counts or sizes do not match");
  TORCH_CHECK(q.size(1) / k.size(1) <= kMaxGroup, "at most ", kMaxGroup, " query heads per kv head");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kLanes * kMaxChunks, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(pages.scalar_type() == at::kInt && row_span.scalar_type() == at::kInt &&
                  row_keys.scalar_type() == at::kInt, "index tensors must be int32");
  // rows may be strided (q is usually a slice of the fused qkv output); heads and dims must be packed
  at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  at::Tensor table = pages.contiguous(), spans = row_span.contiguous(), keys = row_keys.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    switch (q.size(2) / kLanes) {
      case 4: attend<scalar_t, 4>(qc, k, v, table, spans, keys, page_size, scale, out); break;
      case 8: attend<scalar_t, 8>(qc, k, v, table, spans, keys, page_size, scale, out); break;
      default: attend<scalar_t, 0>(qc, k, v, table, spans, keys, page_size, scale, out);
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace fiberserve
