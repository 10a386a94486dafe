// quant_gemm.cpp's row quantization and row tile for CPUs with AVX2 but no AVX512-VNNI (e.g. AMD Zen 3): the same
// packed layout and the same arithmetic, giving the same bits as the AVX-512 tile.
//
// There is no vpdpbusd.  vpmaddubsw multiplies 32 unsigned weight bytes by 32 signed activation bytes and adds
// adjacent pairs into 16 int16 lanes; vpmaddwd by ones adds those pairs into 8 int32 lanes: the 4-input dot
// products vpdpbusd gives, for 8 outputs (a 64-byte step of 16 outputs is two 32-byte halves).
//   4 bits: q <= 15, so a pair is at most 2 * 15 * 127 and a block's 8 steps add up in int16 without overflow
//           (30480 < 2^15): one vpmaddwd per block and half, not per step.
//   8 bits: stored as q + 128, which vpmaddubsw's pairs could overflow; the tile runs the signed q (its magnitude
//           as the unsigned byte, its sign moved onto the activation: |q| <= 128, pairs < 2^15), one vpmaddwd per
//           step.  sum(q * xq) is the integer the AVX-512 tile reaches as sum((q + 128) * xq) - 128 * sum(xq).
// The block's scaling is the AVX-512 tile's, in the same order (fused multiply-adds are exact to one rounding on
// both), so each output has the same bits on either CPU.
//
// Registers: 16 ymm.  A column block's two halves for 2 rows take 4 float sums, 4 int16 sums, 4 unpacked weight
// vectors and 2 broadcasts, so the tile walks its rows 2 at a time and its column blocks one at a time (the group's
// weights stay in L1 between the passes), into a buffer the epilogue reads.  4 rows a pass (the float sums on the
// stack) measured no faster for 4 bits and slower for 8 (the output head at 64 rows: 30 against 23-26 ms).

#pragma once

#include <immintrin.h>

namespace fiberserve {
namespace {

inline __m256 cvt_half8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256i broadcast4(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi32(four);
}

// As the AVX-512 quantize_rows: xq = round-to-nearest-even(x * 127 / max|x|) per block of 32, saturated to int8,
// dx, dx * sum(xq), and -128 * sum(xq) (unused here, kept so that QuantizedRows means the same on both).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* offset) {
  const int64_t blocks = K / kGroup;
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    // packs_epi32 and packs_epi16 work within 128-bit lanes; this puts the 32 bytes back in order.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* p = x + r * K + b * kGroup;
        const f32x16 v0 = load16(p), v1 = load16(p + kBlock);
        const f32x16 a0 = v0 < 0 ? -v0 : v0, a1 = v1 < 0 ? -v1 : v1;
        const f32x16 a = a0 > a1 ? a0 : a1;
        float amax = a[0];
        for (int l = 1; l < kBlock; ++l) amax = a[l] > amax ? a[l] : amax;
        const float d = amax / 127.0f;
        alignas(64) float scaled[kGroup];
        store16(scaled, v0 * (amax > 0.0f ? 127.0f / amax : 0.0f));
        store16(scaled + kBlock, v1 * (amax > 0.0f ? 127.0f / amax : 0.0f));
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_load_ps(scaled + 8 * i));  // nearest even
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + b * kGroup),
                            _mm256_permutevar8x32_epi32(bytes, order));
        // The sum of the unsaturated values, as the AVX-512 path takes it.
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                           _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        int32_t sum = 0;
        for (int l = 0; l < 8; ++l) sum += lanes[l];
        dx[r * blocks + b] = d;
        sx[r * blocks + b] = d * static_cast<float>(sum);
        offset[r * blocks + b] = -128 * sum;
      }
    }
  });
}

// RR rows (1 to kSubRows) of one column block: float sums for its two halves of 8 outputs, block after block.
template <int RR, bool kNibbles>
inline void sub_tile(const QuantizedRows& x, int64_t row0, const uint8_t* w, const c10::Half* d, const c10::Half* m,
                     __m256 (&acc)[RR][2]) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  for (int r = 0; r < RR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i sums[RR][2];
    const int8_t* xb[RR];
    for (int r = 0; r < RR; ++r) xb[r] = x.q + (row0 + r) * x.K + b * kGroup;
    if constexpr (kNibbles) {
      __m256i s16[RR][2];
      for (int r = 0; r < RR; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const uint8_t* wj = w + (b * 4 + j) * 64;
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32 * h));
          lo[h] = _mm256_and_si256(v, low);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < RR; ++r) {
          const __m256i xl = broadcast4(xb[r] + 4 * j), xh = broadcast4(xb[r] + 16 + 4 * j);
          for (int h = 0; h < 2; ++h)
            s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                      _mm256_maddubs_epi16(hi[h], xh)));
        }
      }
      for (int r = 0; r < RR; ++r)
        for (int h = 0; h < 2; ++h) sums[r][h] = _mm256_madd_epi16(s16[r][h], ones);
    } else {
      for (int r = 0; r < RR; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
      for (int s = 0; s < kSteps; ++s) {
        const uint8_t* ws = w + (b * kSteps + s) * 64;
        __m256i mag[2], sign[2];
        for (int h = 0; h < 2; ++h) {
          sign[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + 32 * h)), flip);
          mag[h] = _mm256_abs_epi8(sign[h]);  // |q|, read unsigned: 128 for q = -128
        }
        for (int r = 0; r < RR; ++r) {
          const __m256i xv = broadcast4(xb[r] + 4 * s);
          for (int h = 0; h < 2; ++h) {
            const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(xv, sign[h]));
            sums[r][h] = _mm256_add_epi32(sums[r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = cvt_half8(d + b * kBlock + 8 * h);
      const __m256 mv = kNibbles ? cvt_half8(m + b * kBlock + 8 * h) : _mm256_setzero_ps();
      for (int r = 0; r < RR; ++r) {
        const int64_t at = (row0 + r) * x.blocks + b;
        if constexpr (kNibbles) acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.s[at]), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), _mm256_mul_ps(dv, _mm256_set1_ps(x.d[at])), acc[r][h]);
      }
    }
  }
}

constexpr int kSubRows = 2;  // rows per pass over a column block (see the registers note above)

// The tile's rows [first, MR) of column block c into result, RR rows a pass, then fewer for what is left.
template <int RR, bool kNibbles, int MR, int NR>
inline void rows_by(const QuantizedRows& x, int64_t row0, int first, const uint8_t* w, const c10::Half* d,
                    const c10::Half* m, float (&result)[MR][NR][kBlock], int c) {
  int r = first;
  for (; r + RR <= MR; r += RR) {
    __m256 acc[RR][2];
    sub_tile<RR, kNibbles>(x, row0 + r, w, d, m, acc);
    for (int i = 0; i < RR; ++i)
      for (int h = 0; h < 2; ++h) _mm256_store_ps(result[r + i][c] + 8 * h, acc[i][h]);
  }
  if constexpr (RR > 1) {
    if (r < MR) rows_by<RR - 1, kNibbles>(x, row0, r, w, d, m, result, c);
  }
}

// What a product rounded to out_t hands the next kernel, read back as float32.
inline f32x16 stored16(f32x16 y, const c10::BFloat16*) {
  c10::BFloat16 rounded[kBlock];
  store16(rounded, y);
  return load16(rounded);
}

inline f32x16 stored16(f32x16 y, const float*) { return y; }

// The AVX-512 tile's contract (see quant_gemm.cpp): MR rows x NR column blocks of the product, plus bias, to out.
template <int MR, int NR, bool kNibbles, bool kGated, typename out_t>
[[gnu::noinline]] void tile(const QuantizedRows& x, int64_t row0, const uint8_t* w, int64_t w_stride, const c10::Half* d,
                            const c10::Half* m, int64_t dm_stride, const float* bias, out_t* out, int64_t ldo) {
  alignas(64) float result[MR][NR][kBlock];
  for (int c = 0; c < NR; ++c) {
    const uint8_t* wc = w + c * w_stride;
    const c10::Half* dc = d + c * dm_stride;
    const c10::Half* mc = kNibbles ? m + c * dm_stride : nullptr;
    rows_by<kSubRows, kNibbles>(x, row0, 0, wc, dc, mc, result, c);
  }
  for (int r = 0; r < MR; ++r) {
    f32x16 y[NR];
    for (int c = 0; c < NR; ++c) {
      y[c] = load16(result[r][c]);
      if (bias) y[c] += load16(bias + c * kBlock);
      if constexpr (!kGated) store16(out + r * ldo + c * kBlock, y[c]);
    }
    if constexpr (kGated) {
      static_assert(NR == 2, "a gated tile is one gate block and its up block");
      store16(out + r * ldo, silu_times(stored16(y[0], out), stored16(y[1], out)));
    }
  }
}

}  // namespace
}  // namespace fiberserve
