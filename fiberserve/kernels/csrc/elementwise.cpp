// Fused CPU ops for a decoder layer: each replaces a chain of small PyTorch ops (one dispatch and one pass over
// memory instead of 3 to 9), and each computes a row from that row alone (see simd/vec16.h).
//
//   add_rms_norm  residual += delta (float32, in place; delta in the model dtype or float32); returns
//                 rms_norm(residual) * weight in the model dtype
//   rope_store    rotary embedding of q and k from the fused qkv rows; writes k and v into the cache slots (in
//                 the cache's format, kv_rows.h);
//                 returns q
//   silu_mul      silu(gate) * up from the fused gate|up rows

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <optional>

#include "kv_rows.h"
#include "ops.h"
#include "simd/vec16.h"

namespace fiberserve {
namespace {

// Rows per parallel task: about 32k values, so a decode step's few rows stay on the calling thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

template <typename scalar_t, typename delta_t>
void add_rms_norm_rows(float* residual, const delta_t* delta, const float* weight, scalar_t* out, int64_t rows,
                       int64_t width, float eps) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* r = residual + row * width;
      f32x16 squares = {};
      for (int64_t c = 0; c < width; c += kLanes) {
        f32x16 x = load16(r + c);
        if (delta) x += load16(delta + row * width + c);
        store16(r + c, x);
        squares += x * x;
      }
      const float inv = 1.0f / std::sqrt(lane_sum(squares) / static_cast<float>(width) + eps);
      for (int64_t c = 0; c < width; c += kLanes) store16(out + row * width + c, load16(r + c) * inv * load16(weight + c));
    }
  });
}

// x * cos + rotate_half(x) * sin for one head, where rotate_half(x) = [-x2, x1] and sin carries the minus sign.
template <typename scalar_t>
inline void rope_head(const scalar_t* x, const float* cos, const float* sin, float* wide, float* turned,
                      scalar_t* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t c = 0; c < dim; c += kLanes) store16(wide + c, load16(x + c));
  for (int64_t d = 0; d < half; ++d) turned[d] = wide[d + half];
  for (int64_t d = half; d < dim; ++d) turned[d] = wide[d - half];
  for (int64_t c = 0; c < dim; c += kLanes)
    store16(out + c, load16(wide + c) * load16(cos + c) + load16(turned + c) * load16(sin + c));
}

template <typename scalar_t>
void rope_store_rows(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& write_slots, at::Tensor& k_cache, at::Tensor& v_cache, int64_t heads,
                     KvFormat format, at::Tensor& q) {
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(1), dim = cos.size(1);
  const int64_t stride = qkv.stride(0), written = write_slots.size(0), row_bytes = k_cache.size(2) * k_cache.element_size();
  const scalar_t* src = qkv.data_ptr<scalar_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = write_slots.data_ptr<int64_t>();
  const float *cos_table = cos.data_ptr<float>(), *sin_table = sin.data_ptr<float>();
  auto *k_out = static_cast<char*>(k_cache.data_ptr()), *v_out = static_cast<char*>(v_cache.data_ptr());
  scalar_t* q_out = q.data_ptr<scalar_t>();
  at::parallel_for(0, rows, grain(stride), [&](int64_t begin, int64_t end) {
    std::vector<float> wide(dim), turned(dim);
    std::vector<scalar_t> rotated(dim);
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* x = src + row * stride;
      const float *c = cos_table + pos[row] * dim, *s = sin_table + pos[row] * dim;
      for (int64_t h = 0; h < heads; ++h)
        rope_head(x + h * dim, c, s, wide.data(), turned.data(), q_out + (row * heads + h) * dim, dim);
      if (row >= written) continue;  // a padding row: no cache slot
      char *k_slot = k_out + slots[row] * kv_heads * row_bytes, *v_slot = v_out + slots[row] * kv_heads * row_bytes;
      const scalar_t* value = x + (heads + kv_heads) * dim;
      if (format == KvFormat::kModel) {
        for (int64_t h = 0; h < kv_heads; ++h)
          rope_head(x + (heads + h) * dim, c, s, wide.data(), turned.data(),
                    reinterpret_cast<scalar_t*>(k_slot) + h * dim, dim);
        std::memcpy(v_slot, value, kv_heads * dim * sizeof(scalar_t));
        continue;
      }
      // A quantized cache: each row as the model's dtype holds it, then quantized (kv_rows.h).
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope_head(x + (heads + h) * dim, c, s, wide.data(), turned.data(), rotated.data(), dim);
        for (int64_t d = 0; d < dim; ++d) wide[d] = static_cast<float>(rotated[d]);
        store_kv_row(format, wide.data(), dim, k_slot + h * row_bytes);
        for (int64_t d = 0; d < dim; ++d) wide[d] = static_cast<float>(value[h * dim + d]);
        store_kv_row(format, wide.data(), dim, v_slot + h * row_bytes);
      }
    }
  });
}

// silu(g) * u (simd/vec16.h: silu_times).
template <typename scalar_t>
void silu_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t *gate = gate_up + row * 2 * width, *up = gate + width;
      for (int64_t c = 0; c < width; c += kLanes)
        store16(out + row * width + c, silu_times(load16(gate + c), load16(up + c)));
    }
  });
}

template <typename F>
void dispatch(at::ScalarType type, const char* op, F&& run) {
  switch (type) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, not ", type);
  }
}

}  // namespace

at::Tensor add_rms_norm(at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps, at::ScalarType dtype) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 2,
              "add_rms_norm: the residual must be a contiguous float32 [rows, width]");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(width % kLanes == 0, "add_rms_norm: width must be a multiple of 16");
  at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor d = delta ? delta->contiguous() : at::Tensor();
  TORCH_CHECK(!delta || ((d.scalar_type() == dtype || d.scalar_type() == at::kFloat) && d.sizes() == residual.sizes()),
              "add_rms_norm: delta must be [rows, width] in dtype or float32");
  at::Tensor out = at::empty({rows, width}, residual.options().dtype(dtype));
  dispatch(dtype, "add_rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    if (delta && d.scalar_type() == at::kFloat) {
      add_rms_norm_rows<scalar_t, float>(residual.data_ptr<float>(), d.data_ptr<float>(), w.data_ptr<float>(),
                                         out.data_ptr<scalar_t>(), rows, width, static_cast<float>(eps));
    } else {
      add_rms_norm_rows<scalar_t, scalar_t>(residual.data_ptr<float>(), delta ? d.data_ptr<scalar_t>() : nullptr,
                                            w.data_ptr<float>(), out.data_ptr<scalar_t>(), rows, width,
                                            static_cast<float>(eps));
    }
  });
  return out;
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& write_slots, at::Tensor& k_cache, at::Tensor& v_cache, int64_t heads) {
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(1), dim = cos.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (heads + 2 * kv_heads) * dim,
              "rope_store: qkv must be [rows, (heads + 2 kv_heads) * head_dim] with packed rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.sizes() == v_cache.sizes(), "rope_store: the K and V caches must be contiguous, alike");
  const KvFormat format = kv_format(k_cache, qkv.scalar_type(), dim);  // checks the rows' width
  TORCH_CHECK(dim % kLanes == 0, "rope_store: head_dim must be a multiple of 16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "rope_store: cos/sin must be contiguous float32 [positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && write_slots.scalar_type() == at::kLong &&
                  positions.size(0) == rows && write_slots.size(0) <= rows, "rope_store: bad positions or slots");
  at::Tensor pos = positions.contiguous(), slots = write_slots.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "rope_store: position ", p[r], " is past the cos/sin tables' ", cos.size(0));
  at::Tensor q = at::empty({rows, heads, dim}, qkv.options());
  dispatch(qkv.scalar_type(), "rope_store", [&](auto zero) {
    rope_store_rows<decltype(zero)>(qkv, pos, cos, sin, slots, k_cache, v_cache, heads, format, q);
  });
  return q;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % (2 * kLanes) == 0, "silu_mul: [rows, 2 * width], width % 16 == 0");
  at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  dispatch(x.scalar_type(), "silu_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, width);
  });
  return out;
}

}  // namespace fiberserve
