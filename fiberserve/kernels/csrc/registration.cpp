// Registers the extension's ops with PyTorch's dispatcher (CPU implementations only).

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(fiberserve, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor pages, Tensor row_span, Tensor row_keys, "
      "int page_size, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps, ScalarType dtype) -> Tensor");
  m.def(
      "rope_store(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor write_slots, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, int heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("bf16_gemm_available() -> bool");
  m.def("bf16_amx() -> bool");
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, ScalarType out_dtype, bool gated=False) -> Tensor");
  m.def("quant_gemm_available() -> bool");
  m.def("quant_pack_q(Tensor q, int bits) -> Tensor");
  m.def("unpack_gguf_blocks(Tensor raw, str type, Tensor? table=None) -> Tensor[]");
  m.def("pack_gguf_blocks(Tensor raw, str type, Tensor? table=None, Tensor(a!)? out=None) -> Tensor[]");
  m.def("top_k_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("refine_top_logits(Tensor(a!) logits, Tensor hidden, Tensor weight, int k, Tensor? weight_rows=None) -> ()");
  m.def(
      "bf16_linear_race(Tensor x, Tensor packed, int k, Tensor inv_temperature, Tensor seeds) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "quant_linear_race(Tensor x, Tensor packed, Tensor scales, Tensor mins, int k, Tensor inv_temperature, "
      "Tensor seeds) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "refined_race(Tensor values, Tensor indices, Tensor race_values, Tensor race_indices, Tensor hidden, "
      "Tensor weight, Tensor inv_temperature, Tensor seeds, Tensor? weight_rows=None) -> Tensor");
  m.def("race_rows(Tensor logits, Tensor inv_temperature, Tensor seeds) -> Tensor");
  m.def(
      "quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor mins, Tensor? bias, ScalarType out_dtype, "
      "bool gated=False) -> Tensor");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor[] rows, Tensor[] a, Tensor[] bt, int[] layout) -> ()");
  m.def(
      "decoder_layers(Tensor(a!) h, Tensor positions, Tensor cos, Tensor sin, Tensor write_slots, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor pages, Tensor row_span, Tensor row_keys, int page_size, float scale, int heads, "
      "float eps, ScalarType dtype, Tensor[] norms, Tensor[] weights, Tensor?[] scales, Tensor?[] mins, "
      "Tensor?[] biases, int[] parts, Tensor? lora_rows, int[] lora_groups, Tensor[] lora_tensors, int[] lora_layout) "
      "-> ()");
}

// Takes no tensor, so it is registered for every dispatch key.
TORCH_LIBRARY_IMPL(fiberserve, CatchAll, m) {
  m.impl("bf16_gemm_available", &fiberserve::bf16_gemm_available);
  m.impl("bf16_amx", &fiberserve::bf16_amx);
  m.impl("quant_gemm_available", &fiberserve::quant_gemm_available);
}

TORCH_LIBRARY_IMPL(fiberserve, CPU, m) {
  m.impl("paged_attention", &fiberserve::paged_attention);
  m.impl("add_rms_norm", &fiberserve::add_rms_norm);
  m.impl("rope_store", &fiberserve::rope_store);
  m.impl("silu_mul", &fiberserve::silu_mul);
  m.impl("bf16_pack", &fiberserve::bf16_pack);
  m.impl("bf16_linear", &fiberserve::bf16_linear);
  m.impl("quant_linear", &fiberserve::quant_linear);
  m.impl("quant_pack_q", &fiberserve::quant_pack_q);
  m.impl("unpack_gguf_blocks", &fiberserve::unpack_gguf_blocks);
  m.impl("pack_gguf_blocks", &fiberserve::pack_gguf_blocks);
  m.impl("top_k_rows", &fiberserve::top_k_rows);
  m.impl("refine_top_logits", &fiberserve::refine_top_logits);
  m.impl("quant_linear_race", &fiberserve::quant_linear_race);
  m.impl("bf16_linear_race", &fiberserve::bf16_linear_race);
  m.impl("refined_race", &fiberserve::refined_race);
  m.impl("race_rows", &fiberserve::race_rows);
  m.impl("lora_add", &fiberserve::lora_add);
  m.impl("decoder_layers", &fiberserve::decoder_layers);
}
