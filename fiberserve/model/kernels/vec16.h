// 16-lane float32 vectors for the CPU kernels (GCC/Clang vector extensions: one AVX-512 register, or two AVX2
// ones, with no intrinsics and no ISA lock-in), and the loads, stores and reductions the kernels share.
//
// Every reduction here runs in a fixed order (16 partial sums, then a halving tree), so a row's result depends
// only on the row: never on the batch around it, the thread that runs it or the row count.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace fiberserve {

// 16 float32 lanes (one AVX-512 register; GCC/Clang vector extensions, so no intrinsics and no ISA lock-in).
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the top half of a float32: widen and shift.
inline f32x16 load16(const c10::BFloat16* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline f32x16 load16(const c10::Half* p) {
  float wide[kLanes];
  for (int l = 0; l < kLanes; ++l) wide[l] = static_cast<float>(p[l]);
  return load16(wide);
}

// The sum of the 16 lanes in a fixed order (a halving tree: lane l += lane l + 8, then + 4, + 2, + 1): the same
// bits wherever it runs.
inline float lane_sum(f32x16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  v += __builtin_shufflevector(v, v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return v[0];
}

// exp(x) for x <= 0 (softmax numerators), 16 lanes: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial (relative error < 2e-7), 2^k through the exponent bits.  Results below 2^-126 are flushed.
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 floor = x * 0.0f - 87.0f;
  x = x < floor ? floor : x;
  f32x16 k = x * 1.44269504088896341f;
  for (int l = 0; l < kLanes; ++l) k[l] = __builtin_rintf(k[l]);
  const f32x16 r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
  f32x16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  u32x16 bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += __builtin_convertvector(__builtin_convertvector(k, i32x16), u32x16) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// Round to nearest even, as PyTorch does (NaN stays NaN).
inline void store16(c10::BFloat16* p, f32x16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 quiet = (bits >> 16) | 0x40u;
  const u16x16 half = __builtin_convertvector(v != v ? quiet : rounded, u16x16);
  std::memcpy(p, &half, sizeof half);
}

inline void store16(c10::Half* p, f32x16 v) {
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<c10::Half>(v[l]);
}

}  // namespace fiberserve
