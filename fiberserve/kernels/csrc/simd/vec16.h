// 16-lane float32 vectors for the CPU kernels (GCC/Clang vector extensions, no intrinsics: one AVX-512 register,
// or on other CPUs two 8-lane halves, simd/vec16_halves.h), and the loads, stores and reductions the kernels share.
// Code on these types writes a lane-wise choice as select(mask, a, b) and a conversion as convert<To>(v), which
// both representations provide.
//
// Every reduction here runs in a fixed order (16 partial sums, then a halving tree), so a row's result depends
// only on the row: never on the batch around it, the thread that runs it or the row count.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace fiberserve {

#if defined(__AVX512F__)
// 16 lanes: one AVX-512 register (GCC/Clang vector extensions).
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// Whether a vector type is simd/vec16_halves.h's pair of 8-lane halves (never, here).
template <typename T>
constexpr bool kIsHalves = false;

template <typename To, typename From>
inline To convert(From v) {
  return __builtin_convertvector(v, To);
}

template <typename M, typename V>
inline V select(M mask, V a, V b) {
  return mask ? a : b;
}

// The bits of v as another 16-lane type of the same size.
template <typename To, typename From>
inline To vector_cast(From v) {
  return (To)v;
}

template <typename V>
inline V load_vector(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store_vector(void* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
#endif

}  // namespace fiberserve

#if !defined(__AVX512F__)
#include "simd/vec16_halves.h"  // the same types as two 8-lane halves, and the shuffles below for them
#endif

namespace fiberserve {

constexpr int kLanes = 16;

inline f32x16 load16(const float* p) { return load_vector<f32x16>(p); }

// bfloat16 is the top half of a float32: widen and shift.
inline f32x16 load16(const c10::BFloat16* p) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return widen_bf16(p);  // two AVX2 halves (simd/vec16_halves.h)
#else
  return vector_cast<f32x16>(convert<u32x16>(load_vector<u16x16>(p)) << 16);
#endif
}

inline f32x16 load16(const c10::Half* p) {
  float wide[kLanes];
  for (int l = 0; l < kLanes; ++l) wide[l] = static_cast<float>(p[l]);
  return load16(wide);
}

#if defined(__AVX512F__)  // (simd/vec16_halves.h has these for the halves)
// The sum of the 16 lanes in a fixed order (a halving tree: lane l += lane l + 8, then + 4, + 2, + 1): the same
// bits wherever it runs.
inline float lane_sum(f32x16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  v += __builtin_shufflevector(v, v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return v[0];
}

// lane_sum of each of 16 vectors at once: result lane j = lane_sum(v[j]), bit for bit (the same halving tree,
// lane l with l + 8, then + 4, + 2, + 1), with the shuffles shared: 4 rounds that halve the vectors' count
// while doubling the keys per vector.  Lanes of v that hold no data only produce lanes to ignore.
inline f32x16 lane_sums16(const f32x16 (&v)[kLanes]) {
  // Round 1: w[i] = [v[2i] (l + l+8) for l < 8 | v[2i+1] (l + l+8) for l < 8].
  f32x16 w[8];
  for (int i = 0; i < 8; ++i) {
    const f32x16 lo = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const f32x16 hi = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    w[i] = lo + hi;
  }
  // Round 2: x[i] = 4 keys (2i's pair, 2i+1's pair) x 4 lanes, each lane l + l+4 of its 8.
  f32x16 x[4];
  for (int i = 0; i < 4; ++i) {
    const f32x16 lo = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const f32x16 hi = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    x[i] = lo + hi;
  }
  // Round 3: y[i] = 8 keys x 2 lanes, each lane l + l+2 of its 4.
  f32x16 y[2];
  for (int i = 0; i < 2; ++i) {
    const f32x16 lo = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const f32x16 hi = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    y[i] = lo + hi;
  }
  // Round 4: 16 keys x 1 lane, lane 0 + lane 1 of its 2.
  const f32x16 lo = __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const f32x16 hi = __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return lo + hi;
}

inline i32x16 lane_index() { return i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// Whether any lane of a comparison result (0 or -1 per lane) is set.
inline bool any_lane(i32x16 m) {
  m |= __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  m |= __builtin_shufflevector(m, m, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  m |= __builtin_shufflevector(m, m, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  m |= __builtin_shufflevector(m, m, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return m[0] != 0;
}
#endif

// The largest of p[0..n), n >= 1, reading whole vectors (p must hold n rounded up to 16 floats).  A maximum is
// the same whichever order it is taken in, so this is exactly the scalar loop's result, without its chain of
// dependent compares.
inline float max_of(const float* p, int64_t n) {
  const f32x16 lowest = f32x16{} - __builtin_inff();
  f32x16 best = lowest;
  for (int64_t j = 0; j < n; j += kLanes) {
    f32x16 v = load16(p + j);
    v = select(lane_index() + static_cast<int32_t>(j) < static_cast<int32_t>(n), v, lowest);
    best = select(v > best, v, best);
  }
  float top = best[0];
  for (int l = 1; l < kLanes; ++l) top = best[l] > top ? best[l] : top;
  return top;
}

// exp(x) for x <= 0 (softmax numerators), 16 lanes: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial (relative error < 2e-7), 2^k through the exponent bits.  Results below 2^-126 are flushed.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 floor = x * 0.0f - 87.0f;
  x = select(x < floor, floor, x);
  f32x16 k = x * 1.44269504088896341f;
  k = (k + 12582912.0f) - 12582912.0f;  // round to nearest even (1.5 * 2^23: |k| < 2^22), as rintf does
  const f32x16 r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  f32x16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return vector_cast<f32x16>(vector_cast<u32x16>(p) + (convert<u32x16>(convert<i32x16>(k)) << 23));
}

// silu(g) * u, silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so that the exponent is never positive.  silu_mul
// and the linear kernels' gated epilogue both compute it here, so they give the same bits.
inline f32x16 silu_times(f32x16 g, f32x16 u) {
  const f32x16 e = exp_nonpositive(select(g < 0.0f, g, -g));
  const f32x16 sigmoid = select(g < 0.0f, e, e * 0.0f + 1.0f) / (e + 1.0f);
  return g * sigmoid * u;
}

inline void store16(float* p, f32x16 v) { store_vector(p, v); }

// The bits of v rounded to the nearest bfloat16, to nearest even, in their top halves (not for NaN).
inline u32x16 bf16_rounded_bits(f32x16 v) {
  const u32x16 bits = vector_cast<u32x16>(v);
  return bits + 0x7FFFu + ((bits >> 16) & 1u);
}

// v rounded to the nearest bfloat16 (not NaN), as float32.
inline f32x16 round_to_bf16(f32x16 v) { return vector_cast<f32x16>(bf16_rounded_bits(v) & 0xFFFF0000u); }

// Round to nearest even, as PyTorch does (NaN stays NaN).
inline void store16(c10::BFloat16* p, f32x16 v) {
  const u32x16 bits = vector_cast<u32x16>(v);
  const u32x16 rounded = bf16_rounded_bits(v) >> 16;
  const u32x16 quiet = (bits >> 16) | 0x40u;
  store_vector(p, convert<u16x16>(select(v != v, quiet, rounded)));
}

inline void store16(c10::Half* p, f32x16 v) {
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<c10::Half>(v[l]);
}

// What store16 to an out_t writes, read back as float32: what a product rounded to out_t hands the next kernel.
template <typename out_t>
inline f32x16 stored16(f32x16 y, const out_t*) {
  out_t rounded[kLanes];
  store16(rounded, y);
  return load16(rounded);
}

inline f32x16 stored16(f32x16 y, const float*) { return y; }

}  // namespace fiberserve
