// linear_quant.cpp's row quantization and row tile for CPUs with AVX2 but no AVX512-VNNI: the same
// packed layout and the same arithmetic, giving the same bits as the AVX-512 tile.
//
// There is no vpdpbusd.  vpmaddubsw multiplies 32 unsigned weight bytes by 32 signed activation bytes and adds
// adjacent pairs into 16 int16 lanes; vpmaddwd by ones adds those pairs into 8 int32 lanes: the 4-input dot
// products vpdpbusd gives, for 8 outputs (a 64-byte step of 16 outputs is two 32-byte halves).
//   4 bits: q <= 15, so a pair is at most 2 * 15 * 127 and a block's 8 steps add up in int16 without overflow
//           (30480 < 2^15): one vpmaddwd per block and half, not per step.
//   6 bits: q <= 63, so a step's pairs fit int16 (2 * 63 * 127) but not 4 steps' sum: one vpmaddwd per step; the
//           sums start at -32 * sum(xq), the AVX-512 tile's integers;
//   8 bits: a byte q up to 255, which vpmaddubsw's pairs could overflow; the tile runs q - 128 (its magnitude as
//           the unsigned byte, its sign moved onto the activation: |q - 128| <= 128, pairs < 2^15), one vpmaddwd
//           per step.  For signed formats sum((q - 128) * xq) is the integer the AVX-512 tile reaches from its
//           start of -128 * sum(xq); with mins, 128 * sum(xq) is added back to give its sum(q * xq).
// The block's scaling is the AVX-512 tile's, in the same order (fused multiply-adds are exact to one rounding on
// both), so each output has the same bits on either CPU.
//
// Registers: 16 ymm.  A column block's two halves for 2 rows take 4 float sums, 4 int16 sums, 4 unpacked weight
// vectors and 2 broadcasts, so the tile walks its rows 2 at a time and its column blocks one at a time (the group's
// weights stay in L1 between the passes), into a buffer the epilogue reads (with 4 rows a pass the float sums
// would not fit in registers).

#pragma once

#include <immintrin.h>

#include "avx2/store.h"

namespace fiberserve {
namespace {

inline __m256 load_scales8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }

// Half h (8 outputs) of the scales (or mins) of scale group g of a column block whose first is at p: stored, or a
// K format's factor times its step, as the AVX-512 tile's group_scales.
template <typename F>
[[gnu::always_inline]] inline __m256 group_scales8(const typename F::scale_t* p, int64_t g, int h) {
  if constexpr (F::kSuper) {
    const SuperFactors<F> at(p, g);
    const __m128i steps = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at.steps + 8 * h));
    return _mm256_mul_ps(load_scales8(at.factors + 8 * h), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(steps)));
  } else {
    return load_scales8(p + g * kBlock + 8 * h);
  }
}

// An empty asm that takes v in a register and may change it: the compiler must finish each step's sum before the
// next instead of reassociating the integer adds (GCC computed all 32 of a block's products first and spilled them
// to the stack, then added them up: a third of the tile's instructions were stores and reloads).
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }

[[gnu::always_inline]] inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi32(four);
}

// As the AVX-512 quantize_rows: xq = round-to-nearest-even(x * 127 / max|x|) per block of 32, saturated to int8,
// dx, dx * sum(xq) and -128 * sum(xq), and the two sums per half block.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* offset,
                   float* half_sx, int32_t* half_offset) {
  const int64_t blocks = K / kGroup;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    // packs_epi32 and packs_epi16 work within 128-bit lanes; this puts the 32 bytes back in order.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* p = x + r * K + b * kGroup;
        alignas(32) float values[kGroup];  // as float32 (a bf16 x widened)
        store16(values, load16(p));
        store16(values + kBlock, load16(p + kBlock));
        __m256 part[4];
        for (int i = 0; i < 4; ++i) part[i] = _mm256_load_ps(values + 8 * i);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, part[0]), _mm256_andnot_ps(sign, part[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, part[2]), _mm256_andnot_ps(sign, part[3])));
        a = _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 1));
        a = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, 0x4E));
        a = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, 0xB1));
        const float amax = _mm256_cvtss_f32(a), d = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inv));  // nearest even
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + b * kGroup),
                            _mm256_permutevar8x32_epi32(bytes, order));
        // The sums of the unsaturated values, as the AVX-512 path takes them.
        alignas(32) int32_t lanes[2][8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), _mm256_add_epi32(q[0], q[1]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), _mm256_add_epi32(q[2], q[3]));
        int32_t half[2] = {0, 0};
        for (int h = 0; h < 2; ++h)
          for (int l = 0; l < 8; ++l) half[h] += lanes[h][l];
        const int32_t sum = half[0] + half[1];
        dx[r * blocks + b] = d;
        sx[r * blocks + b] = d * static_cast<float>(sum);
        offset[r * blocks + b] = -128 * sum;
        for (int h = 0; h < 2; ++h) {
          half_sx[(r * blocks + b) * 2 + h] = d * static_cast<float>(half[h]);
          half_offset[(r * blocks + b) * 2 + h] = -128 * half[h];
        }
      }
    }
  });
}

// The float sums of scale group g (of block b) from its integer sums, into result: acc += m * sx + sums * (d * dx),
// for half h of the column block whose scales and mins start at d and m.
template <int MR, typename F>
[[gnu::always_inline]] inline void scale_group8(const QuantizedRows& x, int64_t row0, int64_t b, int64_t g,
                                                const __m256i (&sums)[MR], const typename F::scale_t* d,
                                                const typename F::scale_t* m, int h, float* result, int64_t ldr) {
  const __m256 dv = group_scales8<F>(d, g, h);
  __m256 mv = _mm256_setzero_ps();
  if constexpr (F::kStoredMins) mv = group_scales8<F>(m, g, h);
  else if constexpr (F::kMins) mv = _mm256_mul_ps(dv, _mm256_set1_ps(static_cast<float>(F::kMinSteps)));
  for (int r = 0; r < MR; ++r) {
    __m256 acc = _mm256_load_ps(result + r * ldr);
    if constexpr (F::kMins) acc = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.sum<F::kScaleGroup>(row0 + r, g)), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(dv, _mm256_set1_ps(x.d[(row0 + r) * x.blocks + b])), acc);
    _mm256_store_ps(result + r * ldr, acc);
  }
}

// As the AVX-512 tile's pair_field: the 2 bits at bits 2 * field of each byte, moved to bits kTo and kTo + 1.
template <int kField, int kTo>
[[gnu::always_inline]] inline __m256i pair_field8(__m256i pairs) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(3 << kTo));
  if constexpr (2 * kField <= kTo) return _mm256_and_si256(_mm256_slli_epi16(pairs, kTo - 2 * kField), mask);
  else return _mm256_and_si256(_mm256_srli_epi16(pairs, 2 * kField - kTo), mask);
}

inline __m256i load8(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// As the AVX-512 tile's half_block_q: load j's q of inputs half `part` of a 2-, 3-, 4- or 6-bit block at w, for
// the 8 outputs of the 32 bytes at w.
template <int kBits, int kPart, int kLoad>
[[gnu::always_inline]] inline __m256i half_block_q8(const uint8_t* w) {
  constexpr int kField = 2 * (kLoad % 2) + kPart;  // in a pair load
  if constexpr (kBits <= 3) {
    const __m256i low = pair_field8<kField, 0>(load8(w + (kLoad / 2) * 64));
    if constexpr (kBits == 2) return low;
    constexpr int kBit = 2 * kLoad + kPart;  // in the third bits' load
    const __m256i third = load8(w + 2 * 64), mask = _mm256_set1_epi8(4);
    if constexpr (kBit <= 2) return _mm256_or_si256(low, _mm256_and_si256(_mm256_slli_epi16(third, 2 - kBit), mask));
    else return _mm256_or_si256(low, _mm256_and_si256(_mm256_srli_epi16(third, kBit - 2), mask));
  } else {
    const __m256i v = load8(w + kLoad * 64), low = _mm256_set1_epi8(0x0F);
    const __m256i nibbles = _mm256_and_si256(kPart ? _mm256_srli_epi16(v, 4) : v, low);
    if constexpr (kBits == 4) return nibbles;
    else return _mm256_or_si256(nibbles, pair_field8<kField, 4>(load8(w + (4 + kLoad / 2) * 64)));
  }
}

// The tile's MR rows of half h (8 outputs) of a column block: the float sums, group after group, into
// result[r][0..8).  Walking a half with every row of the tile unpacks each weight load once for MR rows.
template <int MR, typename F>
inline void half_tile(const QuantizedRows& x, int64_t row0, const uint8_t* w, const typename F::scale_t* d,
                      const typename F::scale_t* m, int h, float* result, int64_t ldr) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  for (int r = 0; r < MR; ++r) _mm256_store_ps(result + r * ldr, _mm256_setzero_ps());
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i sums[MR];
    const int8_t* xb = x.q + row0 * x.K + b * kGroup;
    if constexpr (F::kBits == 4 && !F::kHalves) {
      __m256i s16[MR];
      for (int r = 0; r < MR; ++r) s16[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 4 + j) * 64));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < MR; ++r) {
          const __m256i xl = broadcast4(xb + r * x.K + 4 * j), xh = broadcast4(xb + r * x.K + 16 + 4 * j);
          s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
          in_register(s16[r]);
        }
      }
      for (int r = 0; r < MR; ++r) sums[r] = _mm256_madd_epi16(s16[r], ones);
      scale_group8<MR, F>(x, row0, b, b, sums, d, m, h, result, ldr);
    } else if constexpr (F::kHalves) {
      const auto part = [&](auto half) {
        constexpr int kPart = decltype(half)::value;
        const int64_t g = 2 * b + kPart;
        for (int r = 0; r < MR; ++r)  // signed: from -zero * sum(xq); with mins from 0
          sums[r] = _mm256_set1_epi32(F::kMins ? 0 : x.offset_of<16>(row0 + r, g) / (128 / F::kZero));
        const auto load = [&](auto j) {
          constexpr int kLoad = decltype(j)::value;
          const __m256i q = half_block_q8<F::kBits, kPart, kLoad>(w + b * F::kBlockBytes);
          for (int r = 0; r < MR; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(q, broadcast4(xb + r * x.K + 16 * kPart + 4 * kLoad));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));
            in_register(sums[r]);
          }
        };
        load(std::integral_constant<int, 0>{});
        load(std::integral_constant<int, 1>{});
        load(std::integral_constant<int, 2>{});
        load(std::integral_constant<int, 3>{});
        scale_group8<MR, F>(x, row0, b, g, sums, d, m, h, result, ldr);
      };
      part(std::integral_constant<int, 0>{});
      part(std::integral_constant<int, 1>{});
    } else {
      constexpr int kGroupSteps = kSteps / F::kScalesPerBlock;
      for (int part = 0; part < F::kScalesPerBlock; ++part) {
        const int64_t g = b * F::kScalesPerBlock + part;
        for (int r = 0; r < MR; ++r)  // with mins: sum(q * xq) = sum((q - 128) * xq) - (-128 * sum(xq))
          sums[r] = F::kMins ? _mm256_set1_epi32(-x.offset_of<F::kScaleGroup>(row0 + r, g)) : _mm256_setzero_si256();
        for (int s = part * kGroupSteps; s < (part + 1) * kGroupSteps; ++s) {
          const __m256i sign = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * kSteps + s) * 64)), flip);
          const __m256i mag = _mm256_abs_epi8(sign);  // |q - 128|, read unsigned: 128 for q = 0
          for (int r = 0; r < MR; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(broadcast4(xb + r * x.K + 4 * s), sign));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, ones));
            in_register(sums[r]);
          }
        }
        scale_group8<MR, F>(x, row0, b, g, sums, d, m, h, result, ldr);
      }
    }
  }
}

// The AVX-512 tile's contract (see linear_quant.cpp): MR rows x NR column blocks of the product, plus bias, to out.
template <int MR, int NR, typename F, bool kGated, typename out_t>
[[gnu::noinline]] void tile(const QuantizedRows& x, int64_t row0, const ColumnBlocks<F>& cols, const float* bias,
                            out_t* out, int64_t ldo, const GatedAdd& add = {}) {
  alignas(64) float result[MR][NR][kBlock];
  for (int c = 0; c < NR; ++c)
    for (int h = 0; h < 2; ++h)
      half_tile<MR, F>(x, row0, cols.w + c * cols.w_stride + 32 * h, cols.d + c * cols.dm_stride,
                       F::kStoredMins ? cols.m + c * cols.dm_stride : nullptr, h, result[0][c] + 8 * h, NR * kBlock);
  static_assert(!kGated || NR == 2, "a gated tile is one gate block and its up block");
  store_tile<MR, NR, kGated>(result, bias, out, ldo, add);
}

}  // namespace
}  // namespace fiberserve
