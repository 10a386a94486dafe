// The k largest values of each row (k <= 64), largest first; equal values in index order, so k = 1 is
// torch.argmax's first maximum.  One pass per row: 16 values at a time are compared with the current k-th
// best, and only the rare lanes above it are inserted.  Rows run in parallel; a row's result depends on the
// row alone.  NaN is never selected (a row of NaN gives index -1).
//
// refine_top_logits re-scores each row's k best logits exactly: the dot product of the row's float32 hidden
// state with each candidate's weight row, accumulated in float64 (a float32 x bf16 product is exact there) and
// rounded once, without materializing the [rows, k, hidden] products that gathering the weight rows would.
//
// refined_race picks each row's token over those re-scored logits from k + 1 candidates alone (a head kernel's,
// so the logits are never written).  A greedy row takes the argmax: the first k re-scored, the last the best of
// the rest, whose logit stays as it was; the largest value wins, equal values the lower index, exactly as
// torch.argmax over the re-scored row.  A sampled row runs its race (race.h): the first k candidates' race
// entries from their re-scored logits, against the best race entry of a token outside them (kept by the head's
// kernel).
//
// race_rows runs the race over written logits: 16 tokens at a time, and a group's noise is computed only where
// one of its tokens could still win (its scaled logit within kGumbelMax of the best entry so far).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "ops.h"
#include "race.h"
#include "top_k.h"
#include "simd/vec16.h"

namespace fiberserve {
namespace {

constexpr int64_t kMaxK = TopK::kMax;

template <typename scalar_t>
void top_k_row(const scalar_t* x, int64_t n, int64_t k, float* values, int64_t* indices) {
  TopK top(k);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) top.offer16(load16(x + j), j);
  for (; j < n; ++j) top.offer(static_cast<float>(x[j]), j);
  for (int64_t i = 0; i < k; ++i) values[i] = top.value(i), indices[i] = top.index(i);
}

typedef double f64x8 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));

// sum(h[i] * w[i]) for i < n, in float64: 8 partial sums in a fixed order, then their sum in a fixed order.
template <typename weight_t>
double exact_dot(const float* h, const weight_t* w, int64_t n) {
  f64x8 sum = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 hv, wv;
    for (int l = 0; l < 8; ++l) hv[l] = h[i + l], wv[l] = static_cast<float>(w[i + l]);
    sum += __builtin_convertvector(hv, f64x8) * __builtin_convertvector(wv, f64x8);
  }
  double total = ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
  for (; i < n; ++i) total += static_cast<double>(h[i]) * static_cast<double>(static_cast<float>(w[i]));
  return total;
}

// weight_rows checked and contiguous (undefined where not given): int64 [rows, k], each within weight's n rows.
at::Tensor candidate_rows(const std::optional<at::Tensor>& weight_rows, int64_t rows, int64_t k, int64_t n,
                          const char* op) {
  if (!weight_rows.has_value()) return at::Tensor();
  const at::Tensor r = weight_rows->contiguous();
  TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 2 && r.size(0) == rows && r.size(1) == k, op,
              ": weight_rows must be int64 [rows, k]");
  TORCH_CHECK(r.numel() == 0 || (r.min().item<int64_t>() >= 0 && r.max().item<int64_t>() < n), op,
              ": weight_rows must index weight's rows");
  return r;
}

}  // namespace

void refine_top_logits(at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight, int64_t k,
                       const std::optional<at::Tensor>& weight_rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "refine_top_logits: logits must be a contiguous float32 CPU matrix [rows, vocab]");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.size(0) == logits.size(0),
              "refine_top_logits: hidden must be float32 [rows, width]");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= logits.size(1), "refine_top_logits: k must be in [1, min(64, vocab)]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1), "refine_top_logits: weight must be [n, width]");
  const at::Tensor rows_of = candidate_rows(weight_rows, logits.size(0), k, weight.size(0), "refine_top_logits");
  TORCH_CHECK(rows_of.defined() || weight.size(0) == logits.size(1), "refine_top_logits: weight must be [vocab, width]");
  const int64_t* rp = rows_of.defined() ? rows_of.data_ptr<int64_t>() : nullptr;
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1), width = h.size(1);
  float* lp = logits.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  auto run = [&](auto zero) {
    using weight_t = decltype(zero);
    const weight_t* wp = w.data_ptr<weight_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      float values[kMaxK];
      int64_t indices[kMaxK];
      for (int64_t r = begin; r < end; ++r) {
        float* row = lp + r * vocab;
        top_k_row(row, vocab, k, values, indices);
        for (int64_t i = 0; i < k; ++i) {
          if (indices[i] < 0) continue;
          const weight_t* w_row = wp + (rp ? rp[r * k + i] : indices[i]) * width;
          row[indices[i]] = static_cast<float>(exact_dot(hp + r * width, w_row, width));
        }
      }
    });
  };
  switch (w.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "refine_top_logits: weight must be float32 or bfloat16, not ", w.scalar_type());
  }
}

namespace {

// The race entry of one token (lane 0 of race16 for the 16 tokens from it: the same bits as in any group).
float race_entry(float logit, float inv_temperature, uint64_t seed, int64_t token) {
  return race16(f32x16{} + logit, inv_temperature, seed, token)[0];
}

// The best of (value, token) pairs offered: the largest value, equal values the lower token; NaN never.
struct Best {
  int64_t token = -1;
  float value = -std::numeric_limits<float>::infinity();

  void offer(float v, int64_t t) {
    if (v == v && (token < 0 || v > value || (v == value && t < token))) token = t, value = v;
  }
};

// Each row's pick from its head candidates (see refined_race), rows in parallel.
at::Tensor refined_picks(const at::Tensor& values, const at::Tensor& indices, const at::Tensor& race_values,
                         const at::Tensor& race_indices, const at::Tensor& hidden, const at::Tensor& weight,
                         const float* inv_temperature, const int64_t* seeds,
                         const std::optional<at::Tensor>& weight_rows) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat && indices.scalar_type() == at::kLong &&
                  indices.sizes() == values.sizes() && values.size(1) >= 2,
              "refined_race: values float32 and indices int64 [rows, k + 1], k >= 1");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.size(0) == values.size(0),
              "refined_race: hidden must be float32 [rows, width]");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1), "refined_race: weight must be [vocab, width]");
  const at::Tensor rows_of = candidate_rows(weight_rows, values.size(0), values.size(1) - 1, weight.size(0), "refined_race");
  const int64_t* rp = rows_of.defined() ? rows_of.data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(race_values.sizes() == values.sizes() && race_values.scalar_type() == at::kFloat &&
                  race_indices.sizes() == values.sizes() && race_indices.scalar_type() == at::kLong,
              "refined_race: race_values float32 and race_indices int64 [rows, k + 1]");
  const at::Tensor v = values.contiguous(), ix = indices.contiguous(), h = hidden.contiguous(), w = weight.contiguous();
  const at::Tensor rv = race_values.contiguous(), ri = race_indices.contiguous();
  const int64_t rows = v.size(0), k = v.size(1) - 1, width = h.size(1);
  at::Tensor picked = at::empty({rows}, ix.options());
  const float *vp = v.data_ptr<float>(), *hp = h.data_ptr<float>(), *rvp = rv.data_ptr<float>();
  const int64_t *ip = ix.data_ptr<int64_t>(), *rip = ri.data_ptr<int64_t>();
  int64_t* out = picked.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    using weight_t = decltype(zero);
    const weight_t* wp = w.data_ptr<weight_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* value = vp + r * (k + 1);
        const int64_t* index = ip + r * (k + 1);
        const float inv_t = inv_temperature[r];
        const uint64_t seed = static_cast<uint64_t>(seeds[r]);
        Best best;
        int64_t scored = 0;  // the re-scored candidates: the first k (fewer in a row of NaN)
        for (; scored < k && index[scored] >= 0; ++scored) {
          const weight_t* w_row = wp + (rp ? rp[r * k + scored] : index[scored]) * width;
          const float refined = static_cast<float>(exact_dot(hp + r * width, w_row, width));
          best.offer(inv_t > 0.0f ? race_entry(refined, inv_t, seed, index[scored]) : refined, index[scored]);
        }
        if (inv_t > 0.0f) {  // the best race entry of a token not re-scored
          const float* entry = rvp + r * (k + 1);
          const int64_t* token = rip + r * (k + 1);
          for (int64_t j = 0; j <= k && token[j] >= 0; ++j)
            if (std::find(index, index + scored, token[j]) == index + scored) {
              best.offer(entry[j], token[j]);
              break;
            }
        } else if (index[k] >= 0) {  // the best of the rest, as it stands: its logit is not re-scored
          best.offer(value[k], index[k]);
        }
        out[r] = best.token;
      }
    });
  };
  switch (w.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "refined_race: weight must be float32 or bfloat16, not ", w.scalar_type());
  }
  return picked;
}

}  // namespace

at::Tensor refined_race(const at::Tensor& values, const at::Tensor& indices, const at::Tensor& race_values,
                        const at::Tensor& race_indices, const at::Tensor& hidden, const at::Tensor& weight,
                        const at::Tensor& inv_temperature, const at::Tensor& seeds,
                        const std::optional<at::Tensor>& weight_rows) {
  const auto [t, s] = race_parameters(inv_temperature, seeds, values.size(0));
  return refined_picks(values, indices, race_values, race_indices, hidden, weight,
                       t.data_ptr<float>(), s.data_ptr<int64_t>(), weight_rows);
}

at::Tensor race_rows(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& seeds) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "race_rows: logits must be a float32 CPU matrix [rows, vocab]");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const auto [t, s] = race_parameters(inv_temperature, seeds, rows);
  TORCH_CHECK(rows == 0 || t.min().item<float>() > 0.0f, "race_rows: inv_temperature must be > 0");
  at::Tensor picked = at::empty({rows}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *tp = t.data_ptr<float>();
  const int64_t* sp = s.data_ptr<int64_t>();
  int64_t* out = picked.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const f32x16 excluded = f32x16{} - __builtin_inff();
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      const float inv_t = tp[r];
      const uint64_t seed = static_cast<uint64_t>(sp[r]);
      Best best;
      for (int64_t j = 0; j < n; j += kLanes) {
        f32x16 l;
        if (j + kLanes <= n) {
          l = load16(row + j);
        } else {  // the last tokens, the lanes past them excluded
          float tail[kLanes];
          store16(tail, excluded);
          std::copy(row + j, row + n, tail);
          l = load16(tail);
        }
        const f32x16 scaled = l * inv_t;
        if (!any_lane(scaled + kGumbelMax > best.value)) continue;  // no token here can win
        if (best.token >= 0 && !may_reach(scaled, seed, j, best.value)) continue;
        const f32x16 entry = race16(l, inv_t, seed, j);
        if (!any_lane(entry > best.value)) continue;
        for (int i = 0; i < kLanes; ++i)
          if (entry[i] > best.value) best.offer(entry[i], j + i);
      }
      out[r] = best.token;
    }
  });
  return picked;
}

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
