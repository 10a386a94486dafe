// linear_quant.cpp's row tile for CPUs with AVX512-VNNI: vpdpbusd's 4-input dot products of unsigned weight
// bytes and signed activation bytes into int32, 16 output features a register, each block's sums scaled into
// float32 in the order avx2/linear_quant.h repeats, so either tile gives the same bits.

#pragma once

#include <immintrin.h>

namespace fiberserve {
namespace {

inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load_f32(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }

// The 16 scales (or mins) of scale group g of a column block whose first is at p: stored, or a K format's factor
// times its step (the float32 product is exact).
template <typename F>
[[gnu::always_inline]] inline __m512 group_scales(const typename F::scale_t* p, int64_t g) {
  if constexpr (F::kSuper) {
    const SuperFactors<F> at(p, g);
    const __m512i steps = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at.steps)));
    return _mm512_mul_ps(load_scales(at.factors), _mm512_cvtepi32_ps(steps));
  } else {
    return load_scales(p + g * kBlock);
  }
}

inline void store(c10::BFloat16* out, __m512 y) {  // round to nearest even, like PyTorch
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(y));
#else
  alignas(64) float tmp[kBlock];
  _mm512_store_ps(tmp, y);
  for (int i = 0; i < kBlock; ++i) out[i] = c10::BFloat16(tmp[i]);
#endif
}

inline void store(float* out, __m512 y) { _mm512_storeu_ps(out, y); }

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* offset,
                   float* half_sx, int32_t* half_offset) {
  const int64_t blocks = K / kGroup;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* p = x + r * K + b * kGroup;
        const __m512 v0 = load_f32(p), v1 = load_f32(p + kBlock);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        const float d = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // round to nearest even
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        int8_t* o = xq + r * K + b * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + kBlock), _mm512_cvtsepi32_epi8(q1));
        dx[r * blocks + b] = d;
        const int32_t first = _mm512_reduce_add_epi32(q0), second = _mm512_reduce_add_epi32(q1);
        const int32_t sum = first + second;
        sx[r * blocks + b] = d * static_cast<float>(sum);
        offset[r * blocks + b] = -128 * sum;
        half_sx[(r * blocks + b) * 2] = d * static_cast<float>(first);
        half_sx[(r * blocks + b) * 2 + 1] = d * static_cast<float>(second);
        half_offset[(r * blocks + b) * 2] = -128 * first;
        half_offset[(r * blocks + b) * 2 + 1] = -128 * second;
      }
    }
  });
}

// The tile's helpers are always inlined: called out of line, the sums and accumulators they take by reference
// would pass through memory at every call.
template <int MR, int NR>
[[gnu::always_inline]] inline void step(const QuantizedRows& x, int64_t row0, int64_t input, const __m512i* wv,
                                        __m512i (&sums)[MR][NR]) {
  for (int r = 0; r < MR; ++r) {
    int32_t four;
    std::memcpy(&four, x.q + (row0 + r) * x.K + input, sizeof four);
    const __m512i xv = _mm512_set1_epi32(four);
    for (int c = 0; c < NR; ++c) sums[r][c] = _mm512_dpbusd_epi32(sums[r][c], wv[c], xv);
  }
}

// sums[0] += every other chain's partial sums.
template <int kChains, int MR, int NR>
[[gnu::always_inline]] inline void join_chains(__m512i (&sums)[kChains][MR][NR]) {
  for (int k = 1; k < kChains; ++k)
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) sums[0][r][c] = _mm512_add_epi32(sums[0][r][c], sums[k][r][c]);
}

// The value `store` writes, read back: what a product rounded to out_t hands the next kernel.
inline __m512 stored(__m512 y, const c10::BFloat16*) {
  alignas(64) c10::BFloat16 rounded[kBlock];
  store(rounded, y);
  return load_f32(rounded);
}

inline __m512 stored(__m512 y, const float*) { return y; }

// The float sums of scale group g (of block b) from its integer sums: acc += m * sx + sums * (d * dx).
template <int MR, int NR, typename F>
[[gnu::always_inline]] inline void scale_group(const QuantizedRows& x, int64_t row0, int64_t b, int64_t g,
                                               const __m512i (&sums)[MR][NR], const ColumnBlocks<F>& cols,
                                               __m512 (&acc)[MR][NR]) {
  __m512 dv[NR], mv[NR];
  for (int c = 0; c < NR; ++c) {
    dv[c] = group_scales<F>(cols.d + c * cols.dm_stride, g);
    if constexpr (F::kStoredMins) mv[c] = group_scales<F>(cols.m + c * cols.dm_stride, g);
    else if constexpr (F::kMins) mv[c] = _mm512_mul_ps(dv[c], _mm512_set1_ps(static_cast<float>(F::kMinSteps)));
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 dx = _mm512_set1_ps(x.d[(row0 + r) * x.blocks + b]);
    for (int c = 0; c < NR; ++c) {
      if constexpr (F::kMins)
        acc[r][c] = _mm512_fmadd_ps(mv[c], _mm512_set1_ps(x.sum<F::kScaleGroup>(row0 + r, g)), acc[r][c]);
      acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c]), _mm512_mul_ps(dv[c], dx), acc[r][c]);
    }
  }
}

// How far ahead of its reads a one-row 4- or 6-bit tile of one column group prefetches its weights: it has little
// arithmetic per byte, so the loads it has in flight alone leave memory idle between them (docs/performance.md has
// the figures; the 8-bit tile, with more bytes per block in flight, gains nothing measurable from it, and a tile of
// kOneRowGroups groups, whose streams the hardware prefetchers follow, loses by it).
constexpr int64_t kOneRowAhead = 2048;

// Prefetch the cache lines kOneRowAhead bytes past `offset` into each column block's weights, for one block of
// inputs (past a column block's end, the lines are the next one's: its thread's next group).
template <int NR, typename F>
inline void prefetch_ahead(const ColumnBlocks<F>& cols, int64_t offset) {
  for (int c = 0; c < NR; ++c)
    for (int64_t line = 0; line < F::kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cols.w + c * cols.w_stride + offset + line + kOneRowAhead), _MM_HINT_T0);
}

// The 2 bits that a pair load (6 bits' high bits, 2 and 3 bits' planes) holds at bits 2 * field of each byte, moved
// to bits kTo and kTo + 1 (16-bit shifts: no bits cross into those of another byte).
template <int kField, int kTo>
[[gnu::always_inline]] inline __m512i pair_field(__m512i pairs) {
  const __m512i mask = _mm512_set1_epi8(static_cast<char>(3 << kTo));
  if constexpr (2 * kField <= kTo) return _mm512_and_si512(_mm512_slli_epi16(pairs, kTo - 2 * kField), mask);
  else return _mm512_and_si512(_mm512_srli_epi16(pairs, 2 * kField - kTo), mask);
}

// Load j's (of a block's 4) 64 q of half h of a 2-, 3-, 4- or 6-bit block at w (quant_pack.cpp's layouts).
template <int kBits, int kHalf, int kLoad>
[[gnu::always_inline]] inline __m512i half_block_q(const uint8_t* w) {
  constexpr int kField = 2 * (kLoad % 2) + kHalf;  // in a pair load
  if constexpr (kBits <= 3) {
    const __m512i low = pair_field<kField, 0>(_mm512_loadu_si512(w + (kLoad / 2) * 64));
    if constexpr (kBits == 2) return low;
    constexpr int kBit = 2 * kLoad + kHalf;  // in the third bits' load
    const __m512i third = _mm512_loadu_si512(w + 2 * 64), mask = _mm512_set1_epi8(4);
    if constexpr (kBit <= 2) return _mm512_or_si512(low, _mm512_and_si512(_mm512_slli_epi16(third, 2 - kBit), mask));
    else return _mm512_or_si512(low, _mm512_and_si512(_mm512_srli_epi16(third, kBit - 2), mask));
  } else {
    const __m512i v = _mm512_loadu_si512(w + kLoad * 64), low = _mm512_set1_epi8(0x0F);
    const __m512i nibbles = _mm512_and_si512(kHalf ? _mm512_srli_epi16(v, 4) : v, low);
    if constexpr (kBits == 4) return nibbles;
    else return _mm512_or_si512(nibbles, pair_field<kField, 4>(_mm512_loadu_si512(w + (4 + kLoad / 2) * 64)));
  }
}

// The integer sums of half h (16 inputs) of block b of a column block walked by halves, its 4 steps.
template <int kHalf, int MR, int NR, int kChains, typename F>
[[gnu::always_inline]] inline void half_block_sums(const QuantizedRows& x, int64_t row0, int64_t b,
                                                   const ColumnBlocks<F>& cols, __m512i (&sums)[kChains][MR][NR]) {
  const int64_t input = b * kGroup + 16 * kHalf;
  const auto load = [&](auto j) {
    __m512i wv[NR];
    for (int c = 0; c < NR; ++c)
      wv[c] = half_block_q<F::kBits, kHalf, decltype(j)::value>(cols.w + c * cols.w_stride + b * F::kBlockBytes);
    step<MR, NR>(x, row0, input + 4 * decltype(j)::value, wv, sums[decltype(j)::value % kChains]);
  };
  load(std::integral_constant<int, 0>{});
  load(std::integral_constant<int, 1>{});
  load(std::integral_constant<int, 2>{});
  load(std::integral_constant<int, 3>{});
}

// A tile's float sums, finished: the bias added, then stored, or for a gated tile silu(gate) * up (see tile).
template <int MR, int NR, bool kGated, typename out_t>
[[gnu::always_inline]] inline void finish_tile(__m512 (&acc)[MR][NR], const float* bias, out_t* out, int64_t ldo,
                                               const GatedAdd& add) {
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      if (bias) acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + c * kBlock));
      if constexpr (!kGated) store(out + r * ldo + c * kBlock, acc[r][c]);
    }
  if constexpr (kGated) {
    static_assert(NR % 2 == 0, "a gated tile is gate blocks, each beside its up block");
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NR / 2; ++p) {
        const f32x16 gate = (f32x16)acc[r][2 * p], up = (f32x16)acc[r][2 * p + 1];
        store16(out + r * ldo + p * kBlock,
                add.adds(r) ? silu_times(gate + load16(add.gate + r * add.ld + p * kBlock),
                                         up + load16(add.up + r * add.ld + p * kBlock))
                            : silu_times((f32x16)stored(acc[r][2 * p], out), (f32x16)stored(acc[r][2 * p + 1], out)));
      }
  }
}

// MR rows x NR column blocks of weights in format F.
// kGated (NR even): blocks 2p hold gate outputs and blocks 2p + 1 the matching up outputs (see GateUp in
// linear.py); the tile writes silu(gate) * up, NR / 2 blocks, each input rounded to out_t first as a separate
// product and silu_mul would see it, or where `add` adds to the row, the sums plus its additions (gated_add.h).
// Kept out of line: inlined into its column loop, the compiler allocates the 24 accumulators worse.
template <int MR, int NR, typename F, bool kGated, typename out_t>
[[gnu::noinline]] void tile(const QuantizedRows& x, int64_t row0, const ColumnBlocks<F>& cols, const float* bias,
                            out_t* out, int64_t ldo, const GatedAdd& add = {}) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  // A tile of few rows has too few integer sums to hide vpdpbusd's latency: each sum is kept as kChains partial
  // sums, added before scaling (integer addition: the same bits in any order).
  constexpr int kChains = MR <= 2 ? 2 : 1;
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i sums[kChains][MR][NR];
    if constexpr (F::kBits == 4 && !F::kHalves) {
      for (int k = 0; k < kChains; ++k)
        for (int r = 0; r < MR; ++r)
          for (int c = 0; c < NR; ++c) sums[k][r][c] = _mm512_setzero_si512();
      if constexpr (MR == 1 && NR <= kCols) prefetch_ahead<NR, F>(cols, b * F::kBlockBytes);
      for (int j = 0; j < 4; ++j) {
        __m512i lo[NR], hi[NR];
        for (int c = 0; c < NR; ++c) {
          const __m512i v = _mm512_loadu_si512(cols.w + c * cols.w_stride + (b * 4 + j) * 64);
          lo[c] = _mm512_and_si512(v, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        step<MR, NR>(x, row0, b * kGroup + 4 * j, lo, sums[0]);
        step<MR, NR>(x, row0, b * kGroup + 16 + 4 * j, hi, sums[kChains - 1]);
      }
      join_chains(sums);
      scale_group<MR, NR, F>(x, row0, b, b, sums[0], cols, acc);
    } else if constexpr (F::kHalves) {
      if constexpr (MR == 1 && NR <= kCols) prefetch_ahead<NR, F>(cols, b * F::kBlockBytes);
      const auto half = [&](auto h) {
        constexpr int kHalf = decltype(h)::value;
        for (int r = 0; r < MR; ++r) {  // signed: from -zero * sum(xq); with mins from 0
          const int32_t start = F::kMins ? 0 : x.offset_of<16>(row0 + r, 2 * b + kHalf) / (128 / F::kZero);
          for (int c = 0; c < NR; ++c) sums[0][r][c] = _mm512_set1_epi32(start);
          for (int k = 1; k < kChains; ++k)
            for (int c = 0; c < NR; ++c) sums[k][r][c] = _mm512_setzero_si512();
        }
        half_block_sums<kHalf>(x, row0, b, cols, sums);
        join_chains(sums);
        scale_group<MR, NR, F>(x, row0, b, 2 * b + kHalf, sums[0], cols, acc);
      };
      half(std::integral_constant<int, 0>{});
      half(std::integral_constant<int, 1>{});
    } else {
      constexpr int kGroupSteps = kSteps / F::kScalesPerBlock;
      for (int h = 0; h < F::kScalesPerBlock; ++h) {
        for (int r = 0; r < MR; ++r) {
          const __m512i start = F::kMins ? _mm512_setzero_si512()
                                         : _mm512_set1_epi32(x.offset_of<F::kScaleGroup>(row0 + r, b * F::kScalesPerBlock + h));
          for (int c = 0; c < NR; ++c) sums[0][r][c] = start;
          for (int k = 1; k < kChains; ++k)
            for (int c = 0; c < NR; ++c) sums[k][r][c] = _mm512_setzero_si512();
        }
        for (int s = h * kGroupSteps; s < (h + 1) * kGroupSteps; ++s) {
          __m512i wv[NR];
          for (int c = 0; c < NR; ++c) wv[c] = _mm512_loadu_si512(cols.w + c * cols.w_stride + (b * kSteps + s) * 64);
          step<MR, NR>(x, row0, b * kGroup + 4 * s, wv, sums[s % kChains]);
        }
        join_chains(sums);
        scale_group<MR, NR, F>(x, row0, b, b * F::kScalesPerBlock + h, sums[0], cols, acc);
      }
    }
  }
  finish_tile<MR, NR, kGated>(acc, bias, out, ldo, add);
}

}  // namespace
}  // namespace fiberserve
