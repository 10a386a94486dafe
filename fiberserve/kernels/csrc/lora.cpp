// LoRA additions (model/lora.py): an adapter's low-rank product added to its rows of a product's output, in place,
// in one pass per row with no intermediate tensors (punica's BGMV for one adapter's rows on a CPU).
//
// Contract (see lora_add in ops.h):
//   out    [N, W]   float32 / bfloat16 / float16, rows contiguous: the product's output, updated in place
//   x      [N, K]   the product's input, in a's dtype (float32 or bfloat16), K a multiple of 16
//   rows   int64 [M]  the rows to add to (an adapter's group); other rows are not touched
//   a      [R, K]   the parts' A matrices stacked: coordinates c = x a^T, rounded to a's dtype
//   bt     contiguous, each part's B transposed and scaled, [last - first, end - start] from element `offset`:
//                   part p adds c[first:last] times it to out[:, start:end]
//   layout int64    per part (start, end, first, last, offset); end - start a multiple of 16
//
// A row's result depends on the row alone: each coordinate is a dot product with 16 fixed partial sums reduced in
// lane_sum's order, and each output's addition sums the coordinates' terms in rank order, so a row computes the
// same bits alone or in any group and batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "simd/vec16.h"

namespace fiberserve {
namespace {

constexpr int kChains = 4;  // independent sums in flight: coordinates, or blocks of 16 output columns

template <typename in_t, typename out_t>
void add_rows(out_t* out, int64_t out_stride, const in_t* x, int64_t x_stride, const int64_t* rows, int64_t count,
              const in_t* a, int64_t rank, int64_t width, const in_t* bt, int64_t bt_size, const int64_t* layout,
              int64_t parts) {
  // Rows per task: about 64k multiply-adds, so a decode's few rows stay on the calling thread.
  const int64_t work = rank * width + bt_size;
  at::parallel_for(0, count, std::max<int64_t>(1, 65536 / std::max<int64_t>(work, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> coordinates(rank);
    for (int64_t i = begin; i < end; ++i) {
      const in_t* input = x + rows[i] * x_stride;
      for (int64_t r = 0; r < rank; r += kChains) {  // kChains coordinates at a time, each its own chain
        const int64_t chains = std::min<int64_t>(kChains, rank - r);
        f32x16 sums[kChains];
        for (int64_t c = 0; c < chains; ++c) sums[c] = load16(input) * load16(a + (r + c) * width);
        for (int64_t k = kLanes; k < width; k += kLanes) {
          const f32x16 in = load16(input + k);
          for (int64_t c = 0; c < chains; ++c) sums[c] += in * load16(a + (r + c) * width + k);
        }
        for (int64_t c = 0; c < chains; ++c)  // rounded to a's dtype
          coordinates[r + c] = static_cast<float>(static_cast<in_t>(lane_sum(sums[c])));
      }
      out_t* target = out + rows[i] * out_stride;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t *part = layout + 5 * p, start = part[0], columns = part[1] - part[0];
        const in_t* b = bt + part[4];
        for (int64_t j = 0; j < columns; j += kChains * kLanes) {  // kChains blocks of 16 columns at a time
          const int64_t blocks = std::min<int64_t>(kChains, (columns - j) / kLanes);
          f32x16 added[kChains] = {};
          for (int64_t r = part[2]; r < part[3]; ++r) {
            const in_t* b_row = b + (r - part[2]) * columns + j;
            for (int64_t c = 0; c < blocks; ++c) added[c] += coordinates[r] * load16(b_row + c * kLanes);
          }
          for (int64_t c = 0; c < blocks; ++c) {
            out_t* o = target + start + j + c * kLanes;
            store16(o, load16(o) + added[c]);
          }
        }
      }
    }
  });
}

}  // namespace

void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a, const at::Tensor& bt,
              c10::IntArrayRef layout) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && x.dim() == 2 && x.stride(1) == 1 && x.size(0) == out.size(0),
              "lora_add: out and x must be [rows, features] with packed rows");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type() && a.dim() == 2 && a.size(1) == x.size(1),
              "lora_add: a [rank, K] and bt must be contiguous, in x's dtype");
  TORCH_CHECK(x.size(1) % kLanes == 0, "lora_add: the input width must be a multiple of 16");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "lora_add: rows must be int64 [M]");
  TORCH_CHECK(layout.size() % 5 == 0, "lora_add: the layout is (start, end, first, last, col) per part");
  const at::Tensor indices = rows.contiguous();
  const int64_t* row = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.size(0); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < out.size(0), "lora_add: row ", row[i], " is out of range");
  for (size_t p = 0; p < layout.size(); p += 5)
    TORCH_CHECK(layout[p] >= 0 && layout[p + 1] <= out.size(1) && (layout[p + 1] - layout[p]) % kLanes == 0 &&
                    layout[p + 2] >= 0 && layout[p + 2] <= layout[p + 3] && layout[p + 3] <= a.size(0) &&
                    layout[p + 4] >= 0 &&
                    layout[p + 4] + (layout[p + 3] - layout[p + 2]) * (layout[p + 1] - layout[p]) <= bt.numel(),
                "lora_add: part ", p / 5, " does not fit out, a and bt");
  auto run = [&](auto input_zero, auto output_zero) {
    using in_t = decltype(input_zero);
    using out_t = decltype(output_zero);
    add_rows<in_t, out_t>(out.data_ptr<out_t>(), out.stride(0), x.data_ptr<in_t>(), x.stride(0), row,
                          indices.size(0), a.data_ptr<in_t>(), a.size(0), a.size(1), bt.data_ptr<in_t>(), bt.numel(),
                          layout.data(), static_cast<int64_t>(layout.size() / 5));
  };
  auto with_output = [&](auto input_zero) {
    switch (out.scalar_type()) {
      case at::kFloat: return run(input_zero, float{});
      case at::kBFloat16: return run(input_zero, c10::BFloat16{});
      case at::kHalf: return run(input_zero, c10::Half{});
      default: TORCH_CHECK(false, "lora_add: out must be float32, bfloat16 or float16, not ", out.scalar_type());
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: return with_output(float{});
    case at::kBFloat16: return with_output(c10::BFloat16{});
    default: TORCH_CHECK(false, "lora_add: x must be float32 or bfloat16, not ", x.scalar_type());
  }
}

}  // namespace fiberserve
