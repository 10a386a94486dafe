// LoRA additions (model/lora.py): adapters' low-rank products added to their rows of a product's output, in place,
// with no intermediate tensors (punica's BGMV on a CPU), every adapter's rows of one product in one parallel pass.
//
// Contract (see lora_add in ops.h), per group of rows that run under one adapter (a LoraGroup):
//   out    [N, W]   float32 / bfloat16 / float16, rows contiguous: the product's output, updated in place
//   x      [N, K]   the product's input, in a's dtype (float32 or bfloat16), K a multiple of 16
//   rows   int64 [M]  the group's rows; rows of no group are not touched
//   a      [R, K]   the parts' A matrices stacked: coordinates c = x a^T, rounded to a's dtype
//   bt     contiguous, each part's B transposed and scaled ([last - first, end - start]) from element `offset`, in
//          panels of 16 columns: panel j holds columns 16j .. 16j + 15 of every rank row, one row after another, so
//          the pass reads it front to back; part p adds c[first:last] times it to out[:, start:end]
//   parts  int64    per part (start, end, first, last, offset); end - start a multiple of 16
//
// A row's result depends on the row alone: each coordinate is a dot product with 16 fixed partial sums reduced in
// lane_sum's order, and each output's addition sums the coordinates' terms in rank order, so a row computes the
// same bits alone or in any group, tile and batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd/vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace fiberserve {
namespace {

constexpr int kChains = 4;  // coordinates, or panels of 16 output columns, summed at once for each row of a tile
// How far ahead of its reads the pass asks for B^T's panels (calls of add_panels); A's rows are asked for a chunk
// of rank rows ahead (the rows of A are short: a distance within a row would leave most of it unasked).  The
// loads it has in flight alone leave memory idle between them.
constexpr int64_t kPanelsAhead = 2;
// Rows that share each load of A and B^T (AVX2's 16 registers hold one row's sums only).
#if defined(__AVX512F__)
constexpr int kMaxTile = 4;
#else
constexpr int kMaxTile = 1;
#endif
// The most rows of one group a thread takes at a time (a prefill's many rows are shared out).
constexpr int64_t kMaxUnitRows = 64;

// One adapter's weights for one product, as add_rows reads them: A [rank, width], the parts' B^T (bt_size
// elements), and `parts` entries of (start, end, first, last, offset) in `layout`.
template <typename in_t>
struct LowRank {
  const in_t* a;
  int64_t rank, width;
  const in_t* bt;
  int64_t bt_size;
  const int64_t* layout;
  int64_t parts;

  int64_t work() const { return rank * width + bt_size; }  // multiply-adds a row
};

// Each chain's sum, rounded to in_t, as coordinate r + c of row t.
template <int T, int C, typename in_t>
void round_coordinates(const f32x16 (&sums)[T][C], int64_t rank, int64_t r, float* coordinates) {
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c)
      coordinates[t * rank + r + c] = static_cast<float>(static_cast<in_t>(lane_sum(sums[t][c])));
}

// Coordinates r .. r + C of T rows: C dot products of width K each, one chain of 16 partial sums per coordinate
// and row, rounded to in_t (a row's bits do not depend on C or T: each chain is its own).  bfloat16 on CPUs with
// AVX512-BF16, K a multiple of 32: vdpbf16ps on pairs straight from the bf16 input and A (lane l of a chain sums the
// products of elements 2l and 2l + 1 of every 32), no widening.
template <int T, int C, typename in_t>
void coordinates_of(const in_t* const (&input)[T], const LowRank<in_t>& w, int64_t r, float* coordinates) {
  f32x16 sums[T][C];
  const in_t* a = w.a + r * w.width;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<in_t, c10::BFloat16>) {
    if (w.width % (2 * kLanes) == 0) {
      __m512 pairs[T][C];
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) pairs[t][c] = _mm512_setzero_ps();
      for (int64_t k = 0; k < w.width; k += 2 * kLanes) {
        __m512bh in[T];
        for (int t = 0; t < T; ++t) in[t] = (__m512bh)_mm512_loadu_si512(input[t] + k);
        for (int c = 0; c < C; ++c) {
          __builtin_prefetch(a + (C + c) * w.width + k);
          const __m512bh weight = (__m512bh)_mm512_loadu_si512(a + c * w.width + k);
          for (int t = 0; t < T; ++t) pairs[t][c] = _mm512_dpbf16_ps(pairs[t][c], in[t], weight);
        }
      }
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) sums[t][c] = (f32x16)pairs[t][c];
      return round_coordinates<T, C, in_t>(sums, w.rank, r, coordinates);
    }
  }
#endif
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) sums[t][c] = load16(input[t]) * load16(a + c * w.width);
  for (int64_t k = kLanes; k < w.width; k += kLanes) {
    f32x16 in[T];
    for (int t = 0; t < T; ++t) in[t] = load16(input[t] + k);
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(a + (C + c) * w.width + k);
      const f32x16 weight = load16(a + c * w.width + k);
      for (int t = 0; t < T; ++t) sums[t][c] += in[t] * weight;
    }
  }
  round_coordinates<T, C, in_t>(sums, w.rank, r, coordinates);
}

// Adds C panels of 16 columns from `column` of one part (its B^T panels at b, rank rows first .. last) to T rows,
// or writes them there (Write: the rows' old values are never read).
template <bool Write, int T, int C, typename in_t, typename out_t>
void add_panels(out_t* const (&target)[T], const float* coordinates, int64_t rank, const in_t* b, int64_t first,
                int64_t last, int64_t column) {
  const int64_t panel = (last - first) * kLanes;  // elements of one panel
  const in_t* panels = b + (column / kLanes) * panel;
  f32x16 added[T][C] = {};
  for (int64_t r = first; r < last; ++r) {
    const in_t* b_row = panels + (r - first) * kLanes;
    f32x16 weight[C];
    for (int c = 0; c < C; ++c) {
      __builtin_prefetch(b_row + (kPanelsAhead * C + c) * panel);
      weight[c] = load16(b_row + c * panel);
    }
    for (int t = 0; t < T; ++t) {
      const float coordinate = coordinates[t * rank + r];
      for (int c = 0; c < C; ++c) added[t][c] += coordinate * weight[c];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) {
      out_t* o = target[t] + column + c * kLanes;
      if constexpr (Write)
        store16(o, added[t][c]);
      else
        store16(o, load16(o) + added[t][c]);
    }
}

// Calls step(std::integral_constant<int, T>{}, first) for rows first .. first + T of `count`, in tiles of up to
// kMaxTile rows.
template <typename F>
void for_tiles(int64_t count, F&& step) {
  int64_t first = 0;
  for (; first + kMaxTile <= count; first += kMaxTile) step(std::integral_constant<int, kMaxTile>{}, first);
  if constexpr (kMaxTile > 1) {
    switch (count - first) {
      case 3: return step(std::integral_constant<int, std::min(3, kMaxTile)>{}, first);
      case 2: return step(std::integral_constant<int, std::min(2, kMaxTile)>{}, first);
      case 1: return step(std::integral_constant<int, 1>{}, first);
    }
  }
}

// The addition to `count` rows of one group: each chunk of A (kChains rank rows) and of B^T (kChains panels) is
// read from memory once and serves every tile of the rows while it is in cache; every load serves a tile's rows.
template <bool Write, typename in_t, typename out_t>
void add_rows(out_t* out, int64_t out_stride, const in_t* x, int64_t x_stride, const int64_t* rows, int64_t count,
              const LowRank<in_t>& w, float* coordinates) {
  auto coordinates_from = [&](int64_t r, auto chains) {
    for_tiles(count, [&](auto tile, int64_t first) {
      constexpr int T = decltype(tile)::value;
      const in_t* input[T];
      for (int t = 0; t < T; ++t) input[t] = x + rows[first + t] * x_stride;
      coordinates_of<T, decltype(chains)::value>(input, w, r, coordinates + first * w.rank);
    });
  };
  int64_t r = 0;
  for (; r + kChains <= w.rank; r += kChains) coordinates_from(r, std::integral_constant<int, kChains>{});
  for (; r < w.rank; ++r) coordinates_from(r, std::integral_constant<int, 1>{});
  for (int64_t p = 0; p < w.parts; ++p) {
    const int64_t *part = w.layout + 5 * p, columns = part[1] - part[0];
    const in_t* b = w.bt + part[4];
    auto add_from = [&](int64_t column, auto chains) {
      for_tiles(count, [&](auto tile, int64_t first) {
        constexpr int T = decltype(tile)::value;
        out_t* target[T];
        for (int t = 0; t < T; ++t) target[t] = out + rows[first + t] * out_stride + part[0];
        add_panels<Write, T, decltype(chains)::value>(target, coordinates + first * w.rank, w.rank, b, part[2],
                                                      part[3], column);
      });
    };
    int64_t j = 0;
    for (; j + kChains * kLanes <= columns; j += kChains * kLanes) add_from(j, std::integral_constant<int, kChains>{});
    for (; j < columns; j += kLanes) add_from(j, std::integral_constant<int, 1>{});
  }
}

// Rows first .. first + count of one group: what a thread of the parallel pass takes at a time.
struct Unit {
  size_t group;
  int64_t first, count;
};

template <bool Write, typename in_t, typename out_t>
void add_groups(at::Tensor& out, const at::Tensor& x, const std::vector<LoraGroup>& groups) {
  std::vector<LowRank<in_t>> weights;
  int64_t rows = 0, max_rank = 0, max_work = 1;
  for (const LoraGroup& g : groups) {
    weights.push_back({g.a.data_ptr<in_t>(), g.a.size(0), g.a.size(1), g.bt.data_ptr<in_t>(), g.bt.numel(),
                       g.parts.data(), static_cast<int64_t>(g.parts.size() / 5)});
    rows += g.rows.size(0);
    max_rank = std::max(max_rank, g.a.size(0));
    max_work = std::max(max_work, weights.back().work());
  }
  // Each group's rows in as few units as give every thread a share (the adapter's weights are read once per
  // unit), at most kMaxUnitRows each, dealt out largest first to the thread with the least work so far (a unit's
  // work: reading its weights, as much as four rows' arithmetic, and its rows'); a pass of under about 64k
  // multiply-adds a thread (a decode's few rows of a small model) stays on the calling thread.
  const int64_t threads = at::get_num_threads();
  const int64_t most = std::clamp<int64_t>((rows + threads - 1) / threads, 1, kMaxUnitRows);
  std::vector<Unit> units;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t count = groups[g].rows.size(0), split = (count + most - 1) / most;
    for (int64_t i = 0; i < split; ++i)
      units.push_back({g, i * count / split, (i + 1) * count / split - i * count / split});
  }
  auto work_of = [&](const Unit& u) { return weights[u.group].work() * (4 + u.count); };
  std::sort(units.begin(), units.end(), [&](const Unit& a, const Unit& b) { return work_of(a) > work_of(b); });
  const int64_t shares = std::min<int64_t>(threads, static_cast<int64_t>(units.size()));
  std::vector<std::vector<Unit>> share(shares);
  std::vector<int64_t> work(shares, 0);
  for (const Unit& u : units) {
    const size_t least = std::min_element(work.begin(), work.end()) - work.begin();
    share[least].push_back(u);
    work[least] += work_of(u);
  }
  out_t* out_data = out.data_ptr<out_t>();
  const in_t* x_data = x.data_ptr<in_t>();
  const int64_t out_stride = out.stride(0), x_stride = x.stride(0);
  at::parallel_for(0, shares, std::max<int64_t>(1, 65536 / (most * max_work)), [&](int64_t begin, int64_t end) {
    std::vector<float> coordinates(most * max_rank);
    for (int64_t i = begin; i < end; ++i)
      for (const Unit& u : share[i])
        add_rows<Write>(out_data, out_stride, x_data, x_stride, groups[u.group].rows.data_ptr<int64_t>() + u.first,
                        u.count, weights[u.group], coordinates.data());
  });
}

template <typename F>
void with_output_type(at::ScalarType type, const char* op, F&& run) {
  switch (type) {
    case at::kFloat: return run(float{});
    case at::kBFloat16: return run(c10::BFloat16{});
    case at::kHalf: return run(c10::Half{});
    default: TORCH_CHECK(false, op, ": out must be float32, bfloat16 or float16, not ", type);
  }
}

}  // namespace

bool covers_every_column(c10::IntArrayRef parts, int64_t columns) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t p = 0; p + 4 < parts.size(); p += 5) spans.emplace_back(parts[p], parts[p + 1]);
  std::sort(spans.begin(), spans.end());
  int64_t covered = 0;
  for (const auto& [start, end] : spans) {
    if (start != covered) return false;
    covered = end;
  }
  return covered == columns;
}

void lora_add_groups(at::Tensor& out, const at::Tensor& x, const std::vector<LoraGroup>& groups, bool write) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && x.dim() == 2 && x.stride(1) == 1 && x.size(0) == out.size(0),
              "lora_add: out and x must be [rows, features] with packed rows");
  TORCH_CHECK(x.size(1) % kLanes == 0, "lora_add: the input width must be a multiple of 16");
  for (const LoraGroup& g : groups) {
    const at::Tensor &a = g.a, &bt = g.bt;
    TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.scalar_type() == x.scalar_type() &&
                    bt.scalar_type() == x.scalar_type() && a.dim() == 2 && a.size(1) == x.size(1),
                "lora_add: a [rank, K] and bt must be contiguous, in x's dtype");
    TORCH_CHECK(g.rows.scalar_type() == at::kLong && g.rows.dim() == 1 && g.rows.is_contiguous(),
                "lora_add: rows must be contiguous int64 [M]");
    TORCH_CHECK(g.parts.size() % 5 == 0, "lora_add: the layout is (start, end, first, last, offset) per part");
    const int64_t* row = g.rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < g.rows.size(0); ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < out.size(0), "lora_add: row ", row[i], " is out of range");
    const c10::IntArrayRef parts = g.parts;
    for (size_t p = 0; p < parts.size(); p += 5)
      TORCH_CHECK(parts[p] >= 0 && parts[p + 1] <= out.size(1) && (parts[p + 1] - parts[p]) % kLanes == 0 &&
                      parts[p + 2] >= 0 && parts[p + 2] <= parts[p + 3] && parts[p + 3] <= a.size(0) &&
                      parts[p + 4] >= 0 &&
                      parts[p + 4] + (parts[p + 3] - parts[p + 2]) * (parts[p + 1] - parts[p]) <= bt.numel(),
                  "lora_add: part ", p / 5, " does not fit out, a and bt");
    TORCH_CHECK(!write || covers_every_column(parts, out.size(1)),
                "lora_add: writing, each group's parts must cover out's columns once");
  }
  auto with_output = [&](auto input_zero) {
    with_output_type(out.scalar_type(), "lora_add", [&](auto output_zero) {
      if (write)
        add_groups<true, decltype(input_zero), decltype(output_zero)>(out, x, groups);
      else
        add_groups<false, decltype(input_zero), decltype(output_zero)>(out, x, groups);
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: return with_output(float{});
    case at::kBFloat16: return with_output(c10::BFloat16{});
    default: TORCH_CHECK(false, "lora_add: x must be float32 or bfloat16, not ", x.scalar_type());
  }
}

void lora_add(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& rows,
              const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt, c10::IntArrayRef layout) {
  TORCH_CHECK(rows.size() == a.size() && a.size() == bt.size(), "lora_add: one rows, a and bt per group");
  std::vector<LoraGroup> groups;
  size_t at = 0;
  for (size_t g = 0; g < rows.size(); ++g) {
    TORCH_CHECK(at < layout.size() && at + 1 + 5 * static_cast<size_t>(layout[at]) <= layout.size(),
                "lora_add: the layout is shorter than its groups need");
    const size_t parts = static_cast<size_t>(layout[at]);
    groups.push_back({rows[g].contiguous(), a[g], bt[g], layout.slice(at + 1, 5 * parts)});
    at += 1 + 5 * parts;
  }
  TORCH_CHECK(at == layout.size(), "lora_add: the layout is longer than its groups need");
  lora_add_groups(out, x, groups);
}

}  // namespace fiberserve
