// Sampling by an exponential race (the Gumbel-max trick): a row's token is the argmax over its kept tokens of
// logit * inv_temperature + g, g Gumbel noise drawn for each (row seed, token).  That is a draw from
// softmax(logits * inv_temperature) over the kept tokens, and it needs no normalization, no cumulative sums and
// no sort, so the head's kernel can take it as its tiles produce the logits (quant_linear_race,
// bf16_linear_race) and the [rows, vocabulary] logits are never written.
//
// The noise is counter-based: a pure function of the row's 64-bit seed (the sequence's key and the position of
// the token drawn, see engine/sampling_noise.py) and the token, computed in 16 lanes with the same arithmetic
// wherever it runs, so a row draws the same token alone, in any batch, at any thread count, and whether its
// logits were written (race_rows) or not (the head's kernels).

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "simd/vec16.h"
#include "top_k.h"

namespace fiberserve {

// A 32-bit mixing function with full avalanche (Wellons' lowbias32).
inline u32x16 mix32(u32x16 x) {
  x = (x ^ (x >> 16)) * 0x7FEB352Du;
  x = (x ^ (x >> 15)) * 0x846CA68Bu;
  return x ^ (x >> 16);
}

// log(x) for finite x > 0 (normal), 16 lanes: x = 2^e m with m in [sqrt(1/2), sqrt(2)), log(m) from Cephes'
// polynomial in m - 1 (relative error ~1e-7).
inline f32x16 log_positive(f32x16 x) {
  const i32x16 bits = vector_cast<i32x16>(x);
  i32x16 e = (bits >> 23) - 127;
  f32x16 m = vector_cast<f32x16>((bits & 0x007FFFFF) | 0x3F800000);  // [1, 2)
  const i32x16 high = m > 1.41421356f;
  m = select(high, m * 0.5f, m);
  e = e - high;  // a true comparison is -1
  const f32x16 f = m - 1.0f, z = f * f, k = convert<f32x16>(e);
  f32x16 p = f * 7.0376836292e-2f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  f32x16 y = p * f * z + k * -2.12194440e-4f - 0.5f * z;
  return (f + y) + k * 0.693359375f;
}

// The uniform numbers of tokens first..first+15 of the row seeded `seed`, as odd multiples k of 2^-24 (u = k 2^-24
// in (0, 1)), from the token's hash.
inline i32x16 uniform16(uint64_t seed, int64_t first) {
  const u32x16 token = convert<u32x16>(lane_index()) + static_cast<uint32_t>(first);
  const u32x16 h = mix32(mix32(token ^ static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32));
  return vector_cast<i32x16>((h >> 8) | 1u);
}

// The Gumbel noise of tokens first..first+15 of the row seeded `seed`: -log(-log(u)).
inline f32x16 gumbel16(uint64_t seed, int64_t first) {
  const f32x16 u = convert<f32x16>(uniform16(seed, first)) * 0x1p-24f;
  return -log_positive(-log_positive(u));
}

// The largest noise gumbel16 gives (at u = 1 - 2^-24), rounded up: a token whose logit * inv_temperature is
// more than this below a race's current k-th best cannot enter it.
constexpr float kGumbelMax = 16.7f;

// Whether a token of the 16 from `first`, with `scaled` = logit * inv_temperature, may reach `floor` in the race,
// from their uniform numbers alone (no logarithm): s + g >= floor needs g >= d = floor - s, i.e. u >= exp(-e^-d),
// so 1 - u <= e^-d (as exp(-x) >= 1 - x); the test takes 2^(ceil(-d log2 e) + 1) >= 2 e^-d (slack for
// rounding).  False means no lane can; true, that one may.
inline bool may_reach(f32x16 scaled, uint64_t seed, int64_t first, float floor) {
  f32x16 t = (scaled - floor) * 1.44269504f;  // -d log2 e
  t = select(t < -126.0f, t * 0.0f - 126.0f, select(t > 0.0f, t * 0.0f, t));
  const i32x16 bound_bits = (convert<i32x16>(t) + 128) << 23;  // 2^(ceil(t) + 1): conversion truncates to ceil
  const f32x16 one_minus_u = convert<f32x16>((1 << 24) - uniform16(seed, first)) * 0x1p-24f;
  return any_lane(one_minus_u < vector_cast<f32x16>(bound_bits));
}

// Tokens first..first+15's entries in the race: logit * inv_temperature + noise (-inf stays -inf: a token
// excluded by -inf never wins; NaN never enters a TopK).
inline f32x16 race16(f32x16 logits, float inv_temperature, uint64_t seed, int64_t first) {
  return logits * inv_temperature + gumbel16(seed, first);
}

// One row's candidates in a head's kernel: its k largest logits (re-scored exactly afterwards, see
// refine_top_logits), and, for a sampled row, its k largest race entries, so that the race's winner over the
// re-scored logits can be found from these two lists alone (see refined_race).
struct RowCandidates {
  TopK best;
  TopK race;
  float inv_temperature = 0.0f;  // 0: a greedy row, no race
  uint64_t seed = 0;

  explicit RowCandidates(int64_t k = 1) : best(k), race(k) {}

  void offer16(f32x16 logits, int64_t first) {
    best.offer16(logits, first);
    if (inv_temperature <= 0.0f) return;
    const f32x16 scaled = logits * inv_temperature;
    if (!race.reaches(scaled + kGumbelMax) || (race.full() && !may_reach(scaled, seed, first, race.last())))
      return;  // the common case: no noise computed
    race.offer16(race16(logits, inv_temperature, seed, first), first);
  }

  void offer_all(const RowCandidates& other) {
    best.offer_all(other.best);
    race.offer_all(other.race);
  }
};

// A race's parameters, checked: inv_temperature float32 and seeds int64, one per row.
inline std::pair<at::Tensor, at::Tensor> race_parameters(const at::Tensor& inv_temperature, const at::Tensor& seeds,
                                                         int64_t rows) {
  const at::Tensor t = inv_temperature.to(at::kFloat).contiguous(), s = seeds.to(at::kLong).contiguous();
  TORCH_CHECK(t.numel() == rows && s.numel() == rows, "a race needs inv_temperature and seeds [rows]");
  return {t, s};
}

// What a head's kernel hands back: each row's k largest logits (values, indices [M, k], as top_k_rows), and its
// k largest race entries (race_values, race_indices [M, k]; none for a greedy row, inv_temperature 0).
struct Candidates {
  at::Tensor values, indices, race_values, race_indices;
  at::Tensor inv_temperature, seeds;  // float32 and int64 [M]

  Candidates(const at::Tensor& x, int64_t M, int64_t k, const at::Tensor& inv_temperature_,
             const at::Tensor& seeds_) {
    std::tie(inv_temperature, seeds) = race_parameters(inv_temperature_, seeds_, M);
    values = at::empty({M, k}, x.options().dtype(at::kFloat));
    indices = at::empty({M, k}, x.options().dtype(at::kLong));
    race_values = at::empty_like(values);
    race_indices = at::empty_like(indices);
  }

  // Each thread's running lists, [threads][M], each row's set up for its race.
  std::vector<RowCandidates> lists(int64_t threads, int64_t M) const {
    std::vector<RowCandidates> out(static_cast<size_t>(threads * M), RowCandidates(values.size(1)));
    const float* t = inv_temperature.data_ptr<float>();
    const int64_t* s = seeds.data_ptr<int64_t>();
    for (int64_t i = 0; i < threads * M; ++i) {
      out[i].inv_temperature = t[i % M];
      out[i].seed = static_cast<uint64_t>(s[i % M]);
    }
    return out;
  }

  // Writes each row's lists merged in thread order (thread t's indices all below thread t + 1's), so equal values
  // stay in index order.
  void merge(const std::vector<RowCandidates>& lists, int64_t M) {
    const int64_t threads = M > 0 ? static_cast<int64_t>(lists.size()) / M : 0, k = values.size(1);
    for (int64_t r = 0; r < M; ++r) {
      RowCandidates merged(k);
      for (int64_t t = 0; t < threads; ++t) merged.offer_all(lists[t * M + r]);
      write(merged.best, r, values, indices);
      write(merged.race, r, race_values, race_indices);
    }
  }

 private:
  static void write(const TopK& list, int64_t r, at::Tensor& values, at::Tensor& indices) {
    const int64_t k = list.k();
    float* v = values.data_ptr<float>() + r * k;
    int64_t* ix = indices.data_ptr<int64_t>() + r * k;
    for (int64_t i = 0; i < k; ++i) v[i] = list.value(i), ix[i] = list.index(i);
  }
};

}  // namespace fiberserve
