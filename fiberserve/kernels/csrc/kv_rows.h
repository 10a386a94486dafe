// How the KV cache stores one head's key or value row (one layer, one slot, one kv head), and the loads and
// stores of such rows.  The cache tensor's dtype names its format (fiberserve/model/kv_format.py is the Python
// side, bit for bit):
//
//   the model's dtype        head_dim values as the model computes them;
//   float8_e4m3fn (fp8_e4m3) head_dim values rounded to float8 e4m3 (to nearest even, saturated to +-448);
//   int8 (q8_0)              llama.cpp's q8_0: head_dim int8 values, then one float16 scale per block of 32
//                            (head_dim / 16 bytes); value = scale * q, scale = float16(max |x| / 127), q = x / scale
//                            rounded to nearest even.
//
// A quantized row is quantized from the model-dtype row the model's cache would hold, and every dequantized value
// is exact in float32 (a float8 is, and an int8 times a float16 is), so attention over a quantized cache computes
// the same bits as the float32 path over its dequantized rows.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd/vec16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fiberserve {

constexpr int64_t kQ8Block = 32;       // q8_0: values per scale
constexpr float kFp8Max = 448.0f;      // the largest finite float8 e4m3fn

// 16 bytes from p, sign-extended (int8) to int32 lanes.
inline i32x16 widen_int8(const int8_t* p) {
#if defined(__AVX512F__)
  return (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const auto half = [](const int8_t* q) {
    return (i32x8)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  };
  return {half(p), half(p + 8)};
#else
  int32_t wide[kLanes];
  for (int l = 0; l < kLanes; ++l) wide[l] = p[l];
  return load_vector<i32x16>(wide);
#endif
}

// A row in the model's dtype: head_dim values of T.
template <typename T>
struct ModelRow {
  using element = T;
  static int64_t width(int64_t dim) { return dim; }
  // Dims at .. at + 15 of a row, in float32.
  static f32x16 load(const T* row, int64_t /*dim*/, int64_t at) { return load16(row + at); }
};

// float8 e4m3fn: its bits placed in a float16's (sign to sign; exponent and mantissa to the exponent's low 4 bits
// and the mantissa's top 3), converted by the CPU's float16 conversion (subnormals too, with no denormal
// float32 on the way), then scaled by 2^(15 - 7): exact for every finite value.  The byte sign-extended to 16 bits
// and shifted left by 7 has its sign in bit 15 and its other bits in 13..7.
struct Fp8Row {
  using element = c10::Float8_e4m3fn;
  static int64_t width(int64_t dim) { return dim; }
  static f32x16 load(const element* row, int64_t /*dim*/, int64_t at) {
    const auto* bytes = reinterpret_cast<const __m128i*>(row + at);
#if defined(__AVX512F__)
    const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(bytes)), 7),
                                            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    return (f32x16)_mm512_cvtph_ps(halves) * 256.0f;
#elif defined(__AVX2__)
    const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(bytes)), 7),
                                            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    return f32x16{(f32x8)_mm256_cvtph_ps(_mm256_castsi256_si128(halves)),
                  (f32x8)_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))} * 256.0f;
#else
    float wide[kLanes];
    for (int l = 0; l < kLanes; ++l) wide[l] = static_cast<float>(row[at + l]);
    return load16(wide);
#endif
  }
  static void store(const float* x, int64_t dim, element* row) {
    for (int64_t d = 0; d < dim; ++d) row[d] = c10::Float8_e4m3fn(std::clamp(x[d], -kFp8Max, kFp8Max));
  }
};

// q8_0: head_dim int8 values, then head_dim / 32 float16 scales.
struct Q8Row {
  using element = int8_t;
  static int64_t width(int64_t dim) { return dim + dim / kQ8Block * 2; }
  static float scale(const int8_t* row, int64_t dim, int64_t block) {
    c10::Half d;
    std::memcpy(&d, row + dim + 2 * block, sizeof d);
    return static_cast<float>(d);
  }
  static f32x16 load(const int8_t* row, int64_t dim, int64_t at) {
    return convert<f32x16>(widen_int8(row + at)) * scale(row, dim, at / kQ8Block);
  }
  static void store(const float* x, int64_t dim, int8_t* row) {
    for (int64_t block = 0; block < dim / kQ8Block; ++block) {
      const float* values = x + block * kQ8Block;
      float top = 0.0f;
      for (int64_t i = 0; i < kQ8Block; ++i) top = std::max(top, std::fabs(values[i]));
      const c10::Half d(top / 127.0f);
      const float step = static_cast<float>(d);
      for (int64_t i = 0; i < kQ8Block; ++i)
        row[block * kQ8Block + i] =
            step == 0.0f ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(values[i] / step), -127.0f, 127.0f));
      std::memcpy(row + dim + 2 * block, &d, sizeof d);
    }
  }
};

// Which format a cache tensor holds for queries of dtype `query` and head size `dim` (checked: a q8_0 cache's rows
// are Q8Row::width(dim) bytes wide, any other's dim values).
enum class KvFormat { kModel, kFp8, kQ8 };

inline KvFormat kv_format(const at::Tensor& cache, at::ScalarType query, int64_t dim) {
  const at::ScalarType type = cache.scalar_type();
  const KvFormat format = type == at::kChar              ? KvFormat::kQ8
                          : type == at::kFloat8_e4m3fn ? KvFormat::kFp8
                                                         : KvFormat::kModel;
  TORCH_CHECK(format != KvFormat::kModel || type == query, "the KV cache holds ", type, ", the queries are ", query);
  TORCH_CHECK(format != KvFormat::kQ8 || dim % kQ8Block == 0, "a q8_0 KV cache needs head_dim a multiple of 32");
  const int64_t width = format == KvFormat::kQ8 ? Q8Row::width(dim) : dim;
  TORCH_CHECK(cache.size(-1) == width, "KV cache rows are ", cache.size(-1), " wide, expected ", width);
  return format;
}

// Stores float32 values (the model-dtype row's, widened) as a cache row of `format`.
inline void store_kv_row(KvFormat format, const float* x, int64_t dim, void* row) {
  if (format == KvFormat::kQ8) Q8Row::store(x, dim, static_cast<int8_t*>(row));
  else Fp8Row::store(x, dim, static_cast<Fp8Row::element*>(row));
}

}  // namespace fiberserve
