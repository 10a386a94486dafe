// The decoder layers' loop in C++: the same kernels, in the same order, as LlamaModel._layers_fused, without a
// Python frame and a dispatcher call per kernel.  Per layer: add + RMSNorm, qkv product, RoPE + KV write, paged
// attention, o product, add + RMSNorm, gate/up product, SiLU x up, down product (9 kernels; 270 for 30 layers).
//
// Each linear layer is one of the two kernels of this extension: quant_linear when its scales are given (Q4_1 or
// Q8_0 blocks), bf16_linear otherwise.  The o and down products return float32, added to the float32 residual
// unrounded, exactly as the Python loop does (so both loops give the same bits).

#include <ATen/ATen.h>

#include "ops.h"

namespace fiberserve {
namespace {

// Linear layer `index` of the flat lists: weight, its optional block scales and mins, optional bias.
struct Linears {
  const std::vector<at::Tensor>& weights;
  const c10::List<std::optional<at::Tensor>>& scales;
  const c10::List<std::optional<at::Tensor>>& mins;
  const c10::List<std::optional<at::Tensor>>& biases;

  at::Tensor operator()(const at::Tensor& x, size_t index, at::ScalarType out_dtype) const {
    const std::optional<at::Tensor> scale = scales.get(index), bias = biases.get(index);
    if (scale) return quant_linear(x, weights[index], *scale, *mins.get(index), bias, out_dtype);
    return bf16_linear(x, weights[index], bias, out_dtype);
  }
};

}  // namespace

void decoder_layers(at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& write_slots, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& pages,
                    const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale,
                    int64_t heads, double eps, at::ScalarType dtype, const std::vector<at::Tensor>& norms,
                    const std::vector<at::Tensor>& weights, const c10::List<std::optional<at::Tensor>>& scales,
                    const c10::List<std::optional<at::Tensor>>& mins,
                    const c10::List<std::optional<at::Tensor>>& biases) {
  const size_t layers = norms.size() / 2;
  TORCH_CHECK(norms.size() == 2 * layers && weights.size() == 4 * layers && scales.size() == weights.size() &&
                  mins.size() == weights.size() && biases.size() == weights.size(),
              "decoder_layers: 2 norms and 4 linear layers (weight, scales, mins, bias) per layer");
  TORCH_CHECK(k_cache.dim() == 4 && static_cast<size_t>(k_cache.size(0)) == layers && v_cache.sizes() == k_cache.sizes(),
              "decoder_layers: the cache must be [layers, slots, kv_heads, head_dim]");
  const Linears linear{weights, scales, mins, biases};
  std::optional<at::Tensor> delta;  // the previous layer's MLP output, added to h by the next norm
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor k = k_cache.select(0, static_cast<int64_t>(i)), v = v_cache.select(0, static_cast<int64_t>(i));
    at::Tensor x = add_rms_norm(h, delta, norms[2 * i], eps, dtype);
    const at::Tensor q = rope_store(linear(x, 4 * i, dtype), positions, cos, sin, write_slots, k, v, heads);
    const at::Tensor attention = paged_attention(q, k, v, pages, row_span, row_keys, page_size, scale);
    x = add_rms_norm(h, linear(attention, 4 * i + 1, at::kFloat), norms[2 * i + 1], eps, dtype);
    delta = linear(silu_mul(linear(x, 4 * i + 2, dtype)), 4 * i + 3, at::kFloat);
  }
  if (delta) h.add_(*delta);
}

}  // namespace fiberserve
