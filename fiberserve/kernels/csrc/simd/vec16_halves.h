// simd/vec16.h's 16-lane types on CPUs without AVX-512: each a pair of 8-lane halves (one AVX2 register each).
//
// Why not the 64-byte vector-extension types there: GCC lowers them poorly without AVX-512.  Comparisons
// and selects became scalar code lane by lane, a scalar times a vector went through 16 stores to the stack, and
// every variable of the type lived in memory (paged attention's loops were mostly moves).  A
// struct of two halves lives in two registers, and its operations are the 16-lane ones half by half: lane l is
// lane l of `lo` (l < 8) or lane l - 8 of `hi`, with the same arithmetic per lane, so results keep their bits.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fiberserve {

template <typename H>
struct Halves {
  using Half = H;
  H lo, hi;

  auto operator[](int l) const { return l < 8 ? lo[l] : hi[l - 8]; }
};

template <typename T>
constexpr bool kIsHalves = false;
template <typename H>
constexpr bool kIsHalves<Halves<H>> = true;

template <typename S>
using Scalar = std::enable_if_t<std::is_arithmetic_v<S>, S>;

// Elementwise operators, half by half: both operands vectors, or one of them a scalar (broadcast, as the
// vector extensions do).
#define FIBERSERVE_HALVES_OPERATOR(op)                                                                       \
  template <typename H>                                                                                      \
  inline auto operator op(Halves<H> a, Halves<H> b) {                                                        \
    return Halves<decltype(a.lo op b.lo)>{a.lo op b.lo, a.hi op b.hi};                                       \
  }                                                                                                          \
  template <typename H, typename S>                                                                          \
  inline auto operator op(Halves<H> a, S s)->Halves<decltype(a.lo op Scalar<S>(s))> {                        \
    return {a.lo op s, a.hi op s};                                                                           \
  }                                                                                                          \
  template <typename H, typename S>                                                                          \
  inline auto operator op(S s, Halves<H> a)->Halves<decltype(Scalar<S>(s) op a.lo)> {                        \
    return {s op a.lo, s op a.hi};                                                                           \
  }

FIBERSERVE_HALVES_OPERATOR(+)
FIBERSERVE_HALVES_OPERATOR(-)
FIBERSERVE_HALVES_OPERATOR(*)
FIBERSERVE_HALVES_OPERATOR(/)
FIBERSERVE_HALVES_OPERATOR(&)
FIBERSERVE_HALVES_OPERATOR(|)
FIBERSERVE_HALVES_OPERATOR(^)
FIBERSERVE_HALVES_OPERATOR(<<)
FIBERSERVE_HALVES_OPERATOR(>>)
FIBERSERVE_HALVES_OPERATOR(<)
FIBERSERVE_HALVES_OPERATOR(>)
FIBERSERVE_HALVES_OPERATOR(!=)
#undef FIBERSERVE_HALVES_OPERATOR

template <typename H>
inline Halves<H> operator-(Halves<H> a) {
  return {-a.lo, -a.hi};
}

template <typename H, typename B>
inline Halves<H>& operator+=(Halves<H>& a, B b) {
  return a = a + b;
}

template <typename H, typename B>
inline Halves<H>& operator|=(Halves<H>& a, B b) {
  return a = a | b;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

using f32x16 = Halves<f32x8>;
using i32x16 = Halves<i32x8>;
using u32x16 = Halves<u32x8>;
using u16x16 = Halves<u16x8>;

// __builtin_convertvector, lane by lane.
template <typename To, typename H>
inline To convert(Halves<H> v) {
  return {__builtin_convertvector(v.lo, typename To::Half), __builtin_convertvector(v.hi, typename To::Half)};
}

// mask ? a : b, lane by lane (mask lanes 0 or -1, from a comparison).
template <typename M, typename H>
inline Halves<H> select(Halves<M> mask, Halves<H> a, Halves<H> b) {
  return {mask.lo ? a.lo : b.lo, mask.hi ? a.hi : b.hi};
}

// The bits of v as another 16-lane type of the same size.
template <typename To, typename H>
inline To vector_cast(Halves<H> v) {
  return {(typename To::Half)v.lo, (typename To::Half)v.hi};
}

// Loads and stores half by half: GCC copied a whole struct through the stack, 16 bytes at a time.
template <typename V>
inline V load_vector(const void* p) {
  typename V::Half lo, hi;
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, static_cast<const char*>(p) + sizeof lo, sizeof hi);
  return {lo, hi};
}

template <typename H>
inline void store_vector(void* p, Halves<H> v) {
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(static_cast<char*>(p) + sizeof v.lo, &v.hi, sizeof v.hi);
}

#if defined(__AVX2__)
// 16 bfloat16 widened to float32 (the top half of each lane's bits), each half by one zero-extending load
// (vpmovzxwd) and a shift: GCC's vector conversion widens through 128-bit halves and inserts.
inline f32x16 widen_bf16(const void* p) {
  const auto half = [](const void* q) {
    return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(q))), 16);
  };
  return {half(p), half(static_cast<const char*>(p) + 16)};
}
#endif

inline i32x16 lane_index() { return {i32x8{0, 1, 2, 3, 4, 5, 6, 7}, i32x8{8, 9, 10, 11, 12, 13, 14, 15}}; }

// lane_sum's halving tree: lane l + lane l + 8 is lo + hi; then + 4, + 2, + 1 within the half.
inline float lane_sum(f32x16 v) {
  f32x8 s = v.lo + v.hi;
  s += __builtin_shufflevector(s, s, 4, 5, 6, 7, 4, 5, 6, 7);
  s += __builtin_shufflevector(s, s, 2, 3, 2, 3, 2, 3, 2, 3);
  s += __builtin_shufflevector(s, s, 1, 1, 1, 1, 1, 1, 1, 1);
  return s[0];
}

// simd/vec16.h's lane_sums16 (see there), its rounds on halves: each output half of a round comes from one input
// vector, its lanes paired as the 16-lane shuffles pair them.
inline f32x16 lane_sums16(const f32x16 (&v)[16]) {
  // Round 1: w[i] = [v[2i] (l + l+8) | v[2i+1] (l + l+8)].
  f32x16 w[8];
  for (int i = 0; i < 8; ++i) w[i] = {v[2 * i].lo + v[2 * i].hi, v[2 * i + 1].lo + v[2 * i + 1].hi};
  // Round 2: per half, lanes l + l+4 of each 8-lane group: [lo 0-3 + lo 4-7, hi 0-3 + hi 4-7].
  auto fours = [](f32x16 a) {
    return __builtin_shufflevector(a.lo, a.hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a.lo, a.hi, 4, 5, 6, 7, 12, 13, 14, 15);
  };
  f32x16 x[4];
  for (int i = 0; i < 4; ++i) x[i] = {fours(w[2 * i]), fours(w[2 * i + 1])};
  // Round 3: lanes l + l+2 of each group of 4.
  auto twos = [](f32x16 a) {
    return __builtin_shufflevector(a.lo, a.hi, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a.lo, a.hi, 2, 3, 6, 7, 10, 11, 14, 15);
  };
  f32x16 y[2];
  for (int i = 0; i < 2; ++i) y[i] = {twos(x[2 * i]), twos(x[2 * i + 1])};
  // Round 4: lane 0 + lane 1 of each pair.
  auto ones = [](f32x16 a) {
    return __builtin_shufflevector(a.lo, a.hi, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a.lo, a.hi, 1, 3, 5, 7, 9, 11, 13, 15);
  };
  return {ones(y[0]), ones(y[1])};
}

inline bool any_lane(i32x16 m) {
  i32x8 h = m.lo | m.hi;
  h |= __builtin_shufflevector(h, h, 4, 5, 6, 7, 4, 5, 6, 7);
  h |= __builtin_shufflevector(h, h, 2, 3, 2, 3, 2, 3, 2, 3);
  h |= __builtin_shufflevector(h, h, 1, 1, 1, 1, 1, 1, 1, 1);
  return h[0] != 0;
}

}  // namespace fiberserve
