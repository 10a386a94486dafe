// The ops of the fiberserve extension (registered as torch.ops.fiberserve.* in registration.cpp).

#pragma once

#include <ATen/ATen.h>

#include <ATen/core/List.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "gated_add.h"

namespace fiberserve {

// window > 0: each row sees its last `window` keys only; softcap > 0: scores capped as Gemma 2 caps them.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                           const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale,
                           int64_t window, double softcap);

at::Tensor add_rms_norm(at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps, at::ScalarType dtype);

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& write_slots, at::Tensor& k_cache, at::Tensor& v_cache, int64_t heads);

at::Tensor silu_mul(const at::Tensor& gate_up);

bool bf16_gemm_available();

// Whether bf16_linear runs on AMX tiles (amx/linear_bf16.h) in this process.
bool bf16_amx();

at::Tensor bf16_pack(const at::Tensor& weight);

// gated: the weight's rows interleave gate and up outputs (groups of 64: 32 gate, then the matching 32 up); the
// result is silu(gate) * up, half as wide.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype, bool gated);

bool quant_gemm_available();

// gated: the weight's rows interleave gate and up outputs (groups of 32: 16 gate, then the matching 16 up); the
// result is silu(gate) * up, half as wide.
// A GGUF tensor's blocks, raw uint8 [N, bytes per row] of format `type` (table: IQ4_NL's 16 values), unpacked:
// q uint8 [N, K], scale and min float32 [N, groups], and the K formats' float16 d [N, K / 256], int8 steps
// [N, groups], float16 dmin, int8 negated min steps (empty where the format has none) (gguf_blocks.cpp).
std::vector<at::Tensor> unpack_gguf_blocks(const at::Tensor& raw, const std::string& type,
                                           const std::optional<at::Tensor>& table);

// As unpack_gguf_blocks (N % 16 == 0), with q in quant_linear's packed layout (quant_pack_q's) in place of the
// byte a weight, which is never whole in memory; written into `out` where given (gguf_blocks.cpp).
std::vector<at::Tensor> pack_gguf_blocks(const at::Tensor& raw, const std::string& type,
                                         const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& out);

// q uint8 [N, K] (values below 2^bits, bits 4, 6 or 8) in quant_linear's packed layout (quant_pack.cpp).
at::Tensor quant_pack_q(const at::Tensor& q, int64_t bits);

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                     const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool gated);

struct PrefetchPlan;

// bf16_linear that also pulls `plan`'s memory into cache while its tiles run (see simd/prefetch.h); plan may be null.
at::Tensor bf16_linear_prefetching(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                   at::ScalarType out_dtype, bool gated, const PrefetchPlan* plan,
                                   const GatedAdd& add = {});

// The output features of a product of packed weights (bf16_linear's, quant_linear's).
int64_t bf16_linear_outputs(const at::Tensor& packed);
int64_t quant_linear_outputs(const at::Tensor& packed);

// quant_linear that also pulls `plan`'s memory into cache while its tiles run (see simd/prefetch.h); plan may be null.
at::Tensor quant_linear_prefetching(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                   const at::Tensor& mins, const std::optional<at::Tensor>& bias,
                                   at::ScalarType out_dtype, bool gated, const PrefetchPlan* plan,
                                   const GatedAdd& add = {});

// The k largest outputs of each row of bf16_linear(x, packed, none, float32) (values and indices, as top_k_rows),
// without writing the product, and for each sampled row (inv_temperature > 0) its k largest race entries (see
// race.h): (values, indices, race_values, race_indices), each [M, k].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bf16_linear_race(const at::Tensor& x,
                                                                             const at::Tensor& packed, int64_t k,
                                                                             const at::Tensor& inv_temperature,
                                                                             const at::Tensor& seeds);

// As bf16_linear_race, for the product quant_linear(x, ...) in float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quant_linear_race(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t k,
    const at::Tensor& inv_temperature, const at::Tensor& seeds);

// weight_rows, where given: int64 [rows, k], the row of weight each row's j-th candidate reads (else its token's).
void refine_top_logits(at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight, int64_t k,
                       const std::optional<at::Tensor>& weight_rows);

// Each row's pick after refine_top_logits(k) from a head's race candidates alone (quant_linear_race's, with
// k + 1): for a greedy row (inv_temperature 0) the argmax (first maximum) of the re-scored logits, for a sampled
// row the race's winner over them, exactly as race_rows over the re-scored row would pick.
at::Tensor refined_race(const at::Tensor& values, const at::Tensor& indices, const at::Tensor& race_values,
                        const at::Tensor& race_indices, const at::Tensor& hidden, const at::Tensor& weight,
                        const at::Tensor& inv_temperature, const at::Tensor& seeds,
                        const std::optional<at::Tensor>& weight_rows);

// Each row's winner of the race over its logits (float32 [R, V]; -inf excludes a token) at inv_temperature [R]
// (> 0) with the noise of seeds [R]: a draw from softmax(logits * inv_temperature); -1 for a row with no
// finite logit.
at::Tensor race_rows(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& seeds);

std::tuple<at::Tensor, at::Tensor> top_k_rows(const at::Tensor& x, int64_t k);

// The rows of one adapter and its weights for one product (lora.cpp has the contract).
struct LoraGroup {
  at::Tensor rows, a, bt;
  c10::IntArrayRef parts;  // (start, end, first, last, offset) per part
};

// out[rows] += each group's adapter's low-rank product of x[rows], in place, every group in one parallel pass;
// `write`: out[rows] = the product instead (each group's parts must cover out's columns once, covers_every_column),
// so out's other values are never read.
void lora_add_groups(at::Tensor& out, const at::Tensor& x, const std::vector<LoraGroup>& groups, bool write = false);

// Whether parts (start, end, first, last, offset) cover columns 0 .. `columns` once, end to end.
bool covers_every_column(c10::IntArrayRef parts, int64_t columns);

// lora_add_groups from lists: per group its rows, a and bt, and in `layout` its count of parts, then the parts.
void lora_add(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& rows,
              const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt, c10::IntArrayRef layout);

void decoder_layers(at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& write_slots, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& pages,
                    const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale,
                    int64_t heads, double eps, at::ScalarType dtype, const std::vector<at::Tensor>& norms,
                    const std::vector<at::Tensor>& weights, const c10::List<std::optional<at::Tensor>>& scales,
                    const c10::List<std::optional<at::Tensor>>& mins, const c10::List<std::optional<at::Tensor>>& biases,
                    c10::IntArrayRef parts, const std::optional<at::Tensor>& lora_rows, c10::IntArrayRef lora_groups,
                    const std::vector<at::Tensor>& lora_tensors, c10::IntArrayRef lora_layout);

}  // namespace fiberserve
