// The decoder layers' loop in C++: the same kernels, in the same order, as LlamaModel._layers_fused, without a
// Python frame and a dispatcher call per kernel.  Per layer: add + RMSNorm, qkv product, RoPE + KV write, paged
// attention, o product, add + RMSNorm, gate/up product with SiLU x up in its epilogue (gated: the gate/up weights'
// rows are interleaved, see GateUp in linear.py), down product (8 kernels; 240 for 30 layers).
//
// Each linear layer is one or more products of the two kernels of this extension, their outputs side by side (a qkv
// whose parts the file stores in different block formats: each in its own): quant_linear where scales are given
// (weights in blocks, see linear_quant.cpp), bf16_linear otherwise.  The o and down products return float32, added to the float32 residual
// unrounded, exactly as the Python loop does (so both loops give the same bits).
//
// LoRA adapters (model/lora.py) add their low-rank products to the rows of their groups after each base product
// ran over every row; a row in no group keeps the base model's bits.

#include <ATen/ATen.h>

#include <algorithm>

#include "ops.h"
#include "simd/prefetch.h"

namespace fiberserve {
namespace {

// The linear layers' products, in flat lists (weight, its optional block scales and mins, optional bias), and
// where each linear layer's products start in them (`first`, one more entry than linear layers).
struct Linears {
  const std::vector<at::Tensor>& weights;
  const c10::List<std::optional<at::Tensor>>& scales;
  const c10::List<std::optional<at::Tensor>>& mins;
  const c10::List<std::optional<at::Tensor>>& biases;
  std::vector<size_t> first;

  // Product `index` (`add`: a gated product's additions before its activation, gated_add.h).
  at::Tensor product(const at::Tensor& x, size_t index, at::ScalarType out_dtype, bool gated,
                     const PrefetchPlan* prefetch, const GatedAdd& add = {}) const {
    const std::optional<at::Tensor> scale = scales.get(index), bias = biases.get(index);
    if (scale)
      return quant_linear_prefetching(x, weights[index], *scale, *mins.get(index), bias, out_dtype, gated, prefetch,
                                      add);
    return bf16_linear_prefetching(x, weights[index], bias, out_dtype, gated, prefetch, add);
  }

  // The outputs of linear layer `slot`'s gated product: half its weight's rows.
  int64_t gated_features(size_t slot) const {
    const size_t index = first[slot];
    return (scales.get(index) ? quant_linear_outputs(weights[index]) : bf16_linear_outputs(weights[index])) / 2;
  }

  // Linear layer `slot` (4 per decoder layer): its one product, or its products' outputs side by side.
  at::Tensor operator()(const at::Tensor& x, size_t slot, at::ScalarType out_dtype, bool gated = false,
                        const PrefetchPlan* prefetch = nullptr) const {
    if (first[slot + 1] == first[slot] + 1) return product(x, first[slot], out_dtype, gated, prefetch);
    std::vector<at::Tensor> parts;
    for (size_t i = first[slot]; i < first[slot + 1]; ++i) parts.push_back(product(x, i, out_dtype, gated, prefetch));
    return at::cat(parts, 1);
  }
};

// Each LoRA adapter's additions to its rows, from flat lists: the rows of every group one after another (`rows`,
// `groups` the count of each), and per group, layer and linear layer (4 per layer) an entry of `layout`: its count
// of parts, then (start, end, first, last, offset) per part; an entry with parts takes 2 tensors, A and the parts'
// B transposed, as lora_add takes them (lora.cpp).
class LoraAdditions {
 public:
  LoraAdditions(const std::optional<at::Tensor>& rows, c10::IntArrayRef groups, const std::vector<at::Tensor>& tensors,
                c10::IntArrayRef layout, size_t linears)
      : tensors_(tensors), layout_(layout) {
    if (!rows) return;
    int64_t start = 0;
    size_t ints = 0, weights = 0;
    for (const int64_t count : groups) {
      Group group{rows->narrow(0, start, count), {}};
      start += count;
      for (size_t slot = 0; slot < linears; ++slot) {
        TORCH_CHECK(ints < layout.size(), "decoder_layers: the LoRA layout is shorter than its groups need");
        group.entries.push_back({ints, weights});
        const int64_t parts = layout[ints];
        ints += 1 + 5 * static_cast<size_t>(parts);
        weights += parts ? 2 : 0;
      }
      groups_.push_back(std::move(group));
    }
    TORCH_CHECK(start == rows->size(0) && ints == layout.size() && weights == tensors.size(),
                "decoder_layers: the LoRA rows, layout and tensors must agree");
  }

  // y (the output of linear layer `slot` for the input x) with each group's rows plus its adapter's addition.
  void add(at::Tensor& y, const at::Tensor& x, size_t slot) const {
    const std::vector<LoraGroup> adding = groups_adding(slot);
    if (!adding.empty()) lora_add_groups(y, x, adding);
  }

  // silu(gate) * up of gate/up linear layer `slot` (one gated product) for x, in dtype: where groups add to it,
  // their additions to gate and up go into a buffer that the gated kernel adds in its epilogue (gated_add.h), so
  // base rows get the gated product's bits either way.
  at::Tensor gate_up(const at::Tensor& x, size_t slot, const Linears& linear, at::ScalarType dtype,
                     const PrefetchPlan* prefetch) const {
    const std::vector<LoraGroup> adding = groups_adding(slot);
    if (adding.empty()) return linear(x, slot, dtype, /*gated=*/true, prefetch);
    const int64_t rows = x.size(0);
    at::Tensor adapted = at::zeros({rows}, x.options().dtype(at::kBool));
    bool* is_adapted = adapted.data_ptr<bool>();
    for (const LoraGroup& group : adding) {
      const int64_t* group_rows = group.rows.data_ptr<int64_t>();
      for (int64_t i = 0; i < group.rows.size(0); ++i) is_adapted[group_rows[i]] = true;
    }
    const int64_t features = linear.gated_features(slot);
    // Gate, then up columns: written without a first zeroing where every group's parts cover both.
    const bool write = std::all_of(adding.begin(), adding.end(),
                                   [&](const LoraGroup& g) { return covers_every_column(g.parts, 2 * features); });
    const at::TensorOptions options = x.options().dtype(at::kFloat);
    at::Tensor added = write ? at::empty({rows, 2 * features}, options) : at::zeros({rows, 2 * features}, options);
    lora_add_groups(added, x, adding, write);
    const float* gate = added.data_ptr<float>();
    const GatedAdd add{gate, gate + features, 2 * features, is_adapted};
    return linear.product(x, linear.first[slot], dtype, /*gated=*/true, prefetch, add);
  }

 private:
  struct Entry {
    size_t ints, weights;  // where the entry starts in layout and in tensors
  };
  struct Group {
    at::Tensor rows;
    std::vector<Entry> entries;  // one per linear layer
  };

  // The groups that add to linear layer `slot`, as lora_add_groups takes them.
  std::vector<LoraGroup> groups_adding(size_t slot) const {
    std::vector<LoraGroup> adding;
    for (const Group& group : groups_) {
      const Entry& entry = group.entries[slot];
      const size_t parts = static_cast<size_t>(layout_[entry.ints]);
      if (parts != 0)
        adding.push_back({group.rows, tensors_[entry.weights], tensors_[entry.weights + 1],
                          layout_.slice(entry.ints + 1, 5 * parts)});
    }
    return adding;
  }

  const std::vector<at::Tensor>& tensors_;
  c10::IntArrayRef layout_;
  std::vector<Group> groups_;
};

// The pages of one layer's keys and values that the rows will read: each span's pages once, in row order.
void plan_kv_reads(const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages, const at::Tensor& row_span,
                   const at::Tensor& row_keys, int64_t page_size, PrefetchPlan& plan) {
  plan.ranges.clear();
  const int64_t rows = row_span.size(0), max_pages = pages.size(1);
  const int64_t slot_bytes = k.stride(0) * k.element_size();
  const int32_t *span_of = row_span.data_ptr<int32_t>(), *keys_of = row_keys.data_ptr<int32_t>();
  const int32_t* table = pages.data_ptr<int32_t>();
  const char *k0 = static_cast<const char*>(k.data_ptr()), *v0 = static_cast<const char*>(v.data_ptr());
  for (int64_t row = 0; row < rows; ++row) {
    const int32_t span = span_of[row];
    if (span < 0 || (row + 1 < rows && span_of[row + 1] == span)) continue;  // a span's last row sees all its keys
    const int64_t keys = keys_of[row];
    for (int64_t first = 0, page = 0; first < keys; first += page_size, ++page) {
      const int64_t slot = static_cast<int64_t>(table[span * max_pages + page]) * page_size;
      const int64_t bytes = std::min(page_size, keys - first) * slot_bytes;
      plan.ranges.emplace_back(k0 + slot * slot_bytes, bytes);
      plan.ranges.emplace_back(v0 + slot * slot_bytes, bytes);
    }
  }
}

}  // namespace

void decoder_layers(at::Tensor& h, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& write_slots, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& pages,
                    const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale,
                    int64_t heads, double eps, at::ScalarType dtype, const std::vector<at::Tensor>& norms,
                    const std::vector<at::Tensor>& weights, const c10::List<std::optional<at::Tensor>>& scales,
                    const c10::List<std::optional<at::Tensor>>& mins,
                    const c10::List<std::optional<at::Tensor>>& biases, c10::IntArrayRef parts,
                    const std::optional<at::Tensor>& lora_rows, c10::IntArrayRef lora_groups,
                    const std::vector<at::Tensor>& lora_tensors, c10::IntArrayRef lora_layout) {
  const size_t layers = norms.size() / 2;
  TORCH_CHECK(norms.size() == 2 * layers && parts.size() == 4 * layers && scales.size() == weights.size() &&
                  mins.size() == weights.size() && biases.size() == weights.size(),
              "decoder_layers: 2 norms and 4 linear layers (each of `parts` products: weight, scales, mins, bias) "
              "per layer");
  std::vector<size_t> first{0};
  for (size_t slot = 0; slot < parts.size(); ++slot) {
    const int64_t n = parts[slot];
    TORCH_CHECK(n >= 1 && (slot % 4 != 2 || n == 1),
                "decoder_layers: a linear layer has at least one product, gate/up exactly one (gated)");
    first.push_back(first.back() + static_cast<size_t>(n));
  }
  TORCH_CHECK(first.back() == weights.size(), "decoder_layers: the parts must add up to the products given");
  TORCH_CHECK(k_cache.dim() == 4 && static_cast<size_t>(k_cache.size(0)) == layers && v_cache.sizes() == k_cache.sizes(),
              "decoder_layers: the cache must be [layers, slots, kv_heads, head_dim]");
  const Linears linear{weights, scales, mins, biases, std::move(first)};
  const LoraAdditions lora(lora_rows, lora_groups, lora_tensors, lora_layout, 4 * layers);
  std::optional<at::Tensor> delta;  // the previous layer's MLP output, added to h by the next norm
  PrefetchPlan next_kv;  // the next layer's keys and values, pulled into cache during this layer's gate/up product
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor k = k_cache.select(0, static_cast<int64_t>(i)), v = v_cache.select(0, static_cast<int64_t>(i));
    at::Tensor x = add_rms_norm(h, delta, norms[2 * i], eps, dtype);
    at::Tensor qkv = linear(x, 4 * i, dtype);
    lora.add(qkv, x, 4 * i);
    const at::Tensor q = rope_store(qkv, positions, cos, sin, write_slots, k, v, heads);
    const at::Tensor attention = paged_attention(q, k, v, pages, row_span, row_keys, page_size, scale, 0, 0.0);
    at::Tensor o = linear(attention, 4 * i + 1, at::kFloat);
    lora.add(o, attention, 4 * i + 1);
    x = add_rms_norm(h, o, norms[2 * i + 1], eps, dtype);
    if (i + 1 < layers)
      plan_kv_reads(k_cache.select(0, static_cast<int64_t>(i + 1)), v_cache.select(0, static_cast<int64_t>(i + 1)),
                    pages, row_span, row_keys, page_size, next_kv);
    else
      next_kv.ranges.clear();
    const at::Tensor gated = lora.gate_up(x, 4 * i + 2, linear, dtype, &next_kv);
    at::Tensor down = linear(gated, 4 * i + 3, at::kFloat);
    lora.add(down, gated, 4 * i + 3);
    delta = down;
  }
  if (delta) h.add_(*delta);
}

}  // namespace fiberserve
