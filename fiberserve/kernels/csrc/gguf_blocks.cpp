// A GGUF tensor's blocks unpacked in one pass over its bytes: each weight's q as a byte, each scale group's scale
// and min in float32 (w = scale * q + min, the values gguf's dequantize computes), and for the K formats the
// file's own factors (a float16 per super-block of 256, an int8 step per group; min steps negated).  The layouts
// are llama.cpp's (ggml-common.h); QuantBlocks.from_gguf documents what each format's q and zero are.

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quant_pack.h"

namespace fiberserve {
namespace {

float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The 16 nibbles of qs as elements 0..15 (low) and 16..31 (high) of a block of 32.
void nibbles(const uint8_t* qs, uint8_t* q) {
  for (int l = 0; l < 16; ++l) q[l] = qs[l] & 0x0F, q[l + 16] = qs[l] >> 4;
}

// Q4_K's and Q5_K's 6-bit scale and min of block j (0..7) from their 12 packed bytes.
void scale_min_k4(int j, const uint8_t* s, uint8_t& scale, uint8_t& min) {
  if (j < 4) {
    scale = s[j] & 63, min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

enum class Type { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kIQ4_NL, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K };

struct Outputs {
  uint8_t* q;
  float *scale, *min;
  c10::Half *d, *dmin;
  int8_t *steps, *min_steps;
};

// One block (or super-block) of format `type` at `in`; its q at `q`, its groups' values at index g of each output
// (the format is a template argument, so each format's loop over the blocks compiles without branches).
template <Type type>
void unpack_block(const uint8_t* in, const int8_t* table, uint8_t* q, const Outputs& out, int64_t g,
                  int64_t super) {
  if constexpr (type == Type::kQ4_0 || type == Type::kIQ4_NL) {
    const float d = half_at(in);
    nibbles(in + 2, q);
    if constexpr (type == Type::kIQ4_NL)
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(table[q[l]] + 128);
    out.scale[g] = d, out.min[g] = (type == Type::kQ4_0 ? -8.0f : -128.0f) * d;
  } else if constexpr (type == Type::kQ4_1) {
    nibbles(in + 4, q);
    out.scale[g] = half_at(in), out.min[g] = half_at(in + 2);
  } else if constexpr (type == Type::kQ5_0 || type == Type::kQ5_1) {
    constexpr int offset = type == Type::kQ5_0 ? 2 : 4;
    uint32_t high;
    std::memcpy(&high, in + offset, 4);
    nibbles(in + offset + 4, q);
    for (int l = 0; l < 32; ++l) q[l] |= ((high >> l) & 1) << 4;
    const float d = half_at(in);
    if constexpr (type == Type::kQ5_0) {
      for (int l = 0; l < 32; ++l) q[l] += 112;  // d * (q - 16) == d * ((q + 112) - 128)
      out.scale[g] = d, out.min[g] = -128.0f * d;
    } else {
      out.scale[g] = d, out.min[g] = half_at(in + 2);
    }
  } else if constexpr (type == Type::kQ8_0) {
    const float d = half_at(in);
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(static_cast<int8_t>(in[2 + l]) + 128);
    out.scale[g] = d, out.min[g] = -128.0f * d;
  } else if constexpr (type == Type::kQ4_K || type == Type::kQ5_K) {  // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
    const float d = half_at(in), dmin = half_at(in + 2);
    constexpr bool five = type == Type::kQ5_K;
    const uint8_t *qs = in + (five ? 48 : 16), *qh = in + 16;
    for (int j = 0; j < 8; ++j) {  // each 32 bytes of qs: block 2c in the low nibbles, 2c + 1 in the high
      const uint8_t* bytes = qs + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        uint8_t v = j % 2 ? bytes[l] >> 4 : bytes[l] & 0x0F;
        if (five) v |= ((qh[l] >> j) & 1) << 4;
        q[32 * j + l] = v;
      }
      uint8_t scale, min;
      scale_min_k4(j, in + 4, scale, min);
      out.scale[g + j] = d * scale, out.min[g + j] = -(dmin * min);
      out.steps[g + j] = static_cast<int8_t>(scale), out.min_steps[g + j] = static_cast<int8_t>(-min);
    }
    std::memcpy(out.d + super, in, 2);
    std::memcpy(out.dmin + super, in + 2, 2);
  } else if constexpr (type == Type::kQ2_K) {  // scales[16] (scale | min << 4), qs[64], d, dmin
    const float d = half_at(in + 80), dmin = half_at(in + 82);
    for (int e = 0; e < 256; ++e) q[e] = (in[16 + 32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3;
    for (int j = 0; j < 16; ++j) {
      const uint8_t scale = in[j] & 0x0F, min = in[j] >> 4;
      out.scale[g + j] = d * scale, out.min[g + j] = -(dmin * min);
      out.steps[g + j] = static_cast<int8_t>(scale), out.min_steps[g + j] = static_cast<int8_t>(-min);
    }
    std::memcpy(out.d + super, in + 80, 2);
    std::memcpy(out.dmin + super, in + 82, 2);
  } else if constexpr (type == Type::kQ3_K) {  // hmask[32], qs[64], 6-bit scales[12], d
    const float d = half_at(in + 108);
    const uint8_t *hmask = in, *qs = in + 32, *packed = in + 96;
    for (int e = 0; e < 256; ++e) {  // q in -4..3 stored as q + 4: the low 2 bits, minus 4 where the mask bit is 0
      const int low = (qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3;
      const int high = (hmask[e % 32] >> (e / 32)) & 1;
      q[e] = static_cast<uint8_t>(low | (high << 2));
    }
    for (int j = 0; j < 16; ++j) {
      const int low = (packed[j % 8] >> (4 * (j / 8))) & 0x0F, high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
      const int8_t step = static_cast<int8_t>((low | (high << 4)) - 32);
      out.scale[g + j] = d * step, out.min[g + j] = -4.0f * (d * step);
      out.steps[g + j] = step;
    }
    std::memcpy(out.d + super, in + 108, 2);
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], d
    const float d = half_at(in + 208);
    for (int n = 0; n < 2; ++n) {
      const uint8_t *ql = in + 64 * n, *qh = in + 128 + 32 * n;
      uint8_t* o = q + 128 * n;
      for (int l = 0; l < 32; ++l) {
        o[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
        o[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
        o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    for (int j = 0; j < 16; ++j) {
      const int8_t step = static_cast<int8_t>(in[192 + j]);
      out.scale[g + j] = d * step, out.min[g + j] = -32.0f * (d * step);
      out.steps[g + j] = step;
    }
    std::memcpy(out.d + super, in + 208, 2);
  }
}

struct Layout {
  Type type;
  int64_t inputs, bytes, groups;  // per block: inputs, bytes, scale groups
  int64_t bits;                   // of the unpacked q (QuantBlocks.bits)
};

// Every block of a tensor [N rows of per_row blocks] in format `type`, row after row.
template <Type type>
void unpack_rows(const uint8_t* in, int64_t N, int64_t per_row, const Layout& layout, const int8_t* table,
                 const Outputs& out) {
  const int64_t K = per_row * layout.inputs, groups = per_row * layout.groups, row_bytes = per_row * layout.bytes;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t b = 0; b < per_row; ++b)
      unpack_block<type>(in + r * row_bytes + b * layout.bytes, table, out.q + r * K + b * layout.inputs, out,
                         r * groups + b * layout.groups, r * per_row + b);
}

Layout layout_of(const std::string& name) {
  if (name == "Q4_0") return {Type::kQ4_0, 32, 18, 1, 4};
  if (name == "IQ4_NL") return {Type::kIQ4_NL, 32, 18, 1, 8};
  if (name == "Q4_1") return {Type::kQ4_1, 32, 20, 1, 4};
  if (name == "Q5_0") return {Type::kQ5_0, 32, 22, 1, 8};
  if (name == "Q5_1") return {Type::kQ5_1, 32, 24, 1, 8};
  if (name == "Q8_0") return {Type::kQ8_0, 32, 34, 1, 8};
  if (name == "Q2_K") return {Type::kQ2_K, 256, 84, 16, 2};
  if (name == "Q3_K") return {Type::kQ3_K, 256, 110, 16, 3};
  if (name == "Q4_K") return {Type::kQ4_K, 256, 144, 8, 4};
  if (name == "Q5_K") return {Type::kQ5_K, 256, 176, 8, 8};
  if (name == "Q6_K") return {Type::kQ6_K, 256, 210, 16, 6};
  TORCH_CHECK(false, "unpack_gguf_blocks: ", name, " is not a served block format");
}

// f(std::integral_constant<Type, type>) for the runtime `type`: each format's loop compiled on its own.
template <typename F>
void for_format(Type type, F&& f) {
  switch (type) {
    case Type::kQ4_0: f(std::integral_constant<Type, Type::kQ4_0>{}); break;
    case Type::kIQ4_NL: f(std::integral_constant<Type, Type::kIQ4_NL>{}); break;
    case Type::kQ4_1: f(std::integral_constant<Type, Type::kQ4_1>{}); break;
    case Type::kQ5_0: f(std::integral_constant<Type, Type::kQ5_0>{}); break;
    case Type::kQ5_1: f(std::integral_constant<Type, Type::kQ5_1>{}); break;
    case Type::kQ8_0: f(std::integral_constant<Type, Type::kQ8_0>{}); break;
    case Type::kQ2_K: f(std::integral_constant<Type, Type::kQ2_K>{}); break;
    case Type::kQ3_K: f(std::integral_constant<Type, Type::kQ3_K>{}); break;
    case Type::kQ4_K: f(std::integral_constant<Type, Type::kQ4_K>{}); break;
    case Type::kQ5_K: f(std::integral_constant<Type, Type::kQ5_K>{}); break;
    case Type::kQ6_K: f(std::integral_constant<Type, Type::kQ6_K>{}); break;
  }
}

// The outputs of a tensor [N rows] other than q, allocated, and their pointers (q's left null).
struct Factors {
  at::Tensor scale, min, d, steps, dmin, min_steps;
  Outputs out;

  Factors(const at::Tensor& raw, const Layout& layout, int64_t N, int64_t per_row) {
    const int64_t groups = per_row * layout.groups;
    const bool k_format = layout.inputs == 256, mins = layout.type == Type::kQ2_K || layout.type == Type::kQ4_K || layout.type == Type::kQ5_K;
    const auto bytes = raw.options();
    scale = at::empty({N, groups}, bytes.dtype(at::kFloat)), min = at::empty({N, groups}, bytes.dtype(at::kFloat));
    d = at::empty({k_format ? N : 0, per_row}, bytes.dtype(at::kHalf));
    steps = at::empty({k_format ? N : 0, groups}, bytes.dtype(at::kChar));
    dmin = at::empty({mins ? N : 0, per_row}, bytes.dtype(at::kHalf));
    min_steps = at::empty({mins ? N : 0, groups}, bytes.dtype(at::kChar));
    out = Outputs{nullptr,
                  scale.data_ptr<float>(),
                  min.data_ptr<float>(),
                  k_format ? d.data_ptr<c10::Half>() : nullptr,
                  mins ? dmin.data_ptr<c10::Half>() : nullptr,
                  k_format ? steps.data_ptr<int8_t>() : nullptr,
                  mins ? min_steps.data_ptr<int8_t>() : nullptr};
  }

  // The outputs from row r on (r rows of per_row blocks, groups a row, per Layout).
  Outputs from_row(int64_t r, int64_t per_row, const Layout& layout) const {
    const int64_t g = r * per_row * layout.groups, s = r * per_row;
    auto at = [](auto* p, int64_t i) { return p ? p + i : p; };
    return Outputs{nullptr, at(out.scale, g), at(out.min, g), at(out.d, s), at(out.dmin, s), at(out.steps, g),
                   at(out.min_steps, g)};
  }
};

struct Checked {
  Layout layout;
  at::Tensor raw, table;
  int64_t N, per_row;
};

Checked check(const char* op, const at::Tensor& raw_in, const std::string& type,
              const std::optional<at::Tensor>& table_in) {
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte, op, ": raw must be uint8 [N, bytes]");
  Checked c{layout_of(type), raw_in.contiguous(), at::Tensor(), raw_in.size(0), 0};
  c.per_row = c.raw.size(1) / c.layout.bytes;
  TORCH_CHECK(c.raw.size(1) % c.layout.bytes == 0, op, ": a row is not whole ", type, " blocks");
  if (c.layout.type == Type::kIQ4_NL) {
    TORCH_CHECK(table_in && table_in->numel() == 16 && table_in->scalar_type() == at::kChar, op,
                ": IQ4_NL needs its int8 table of 16 values");
    c.table = table_in->contiguous();
  }
  return c;
}

}  // namespace

std::vector<at::Tensor> unpack_gguf_blocks(const at::Tensor& raw_in, const std::string& type,
                                           const std::optional<at::Tensor>& table_in) {
  const Checked c = check("unpack_gguf_blocks", raw_in, type, table_in);
  const Layout& layout = c.layout;
  at::Tensor q = at::empty({c.N, c.per_row * layout.inputs}, c.raw.options());
  Factors factors(c.raw, layout, c.N, c.per_row);
  Outputs out = factors.out;
  out.q = q.data_ptr<uint8_t>();
  const uint8_t* in = c.raw.data_ptr<uint8_t>();
  const int8_t* values = c.table.defined() ? c.table.data_ptr<int8_t>() : nullptr;
  for_format(layout.type, [&](auto format) { unpack_rows<format.value>(in, c.N, c.per_row, layout, values, out); });
  return {q, factors.scale, factors.min, factors.d, factors.steps, factors.dmin, factors.min_steps};
}

std::vector<at::Tensor> pack_gguf_blocks(const at::Tensor& raw_in, const std::string& type,
                                         const std::optional<at::Tensor>& table_in,
                                         const std::optional<at::Tensor>& out_in) {
  const Checked c = check("pack_gguf_blocks", raw_in, type, table_in);
  const Layout& layout = c.layout;
  const int64_t K = c.per_row * layout.inputs, row_bytes = c.per_row * layout.bytes;
  TORCH_CHECK(c.N % 16 == 0, "pack_gguf_blocks: the rows must be a multiple of 16, got ", c.N);
  const std::vector<int64_t> shape = packed_shape(c.N, K, layout.bits);
  at::Tensor packed = out_in ? *out_in : at::empty(shape, c.raw.options());
  TORCH_CHECK(packed.sizes() == at::IntArrayRef(shape) && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "pack_gguf_blocks: out must be contiguous uint8 of the packed shape");
  Factors factors(c.raw, layout, c.N, c.per_row);
  const uint8_t* in = c.raw.data_ptr<uint8_t>();
  const int8_t* values = c.table.defined() ? c.table.data_ptr<int8_t>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t block_bytes = packed_column_block_bytes(K, layout.bits);
  std::vector<uint8_t> rows(16 * K);  // one column block's q, a byte a weight, reused: it stays in cache
  for_format(layout.type, [&](auto format) {
    for (int64_t cb = 0; cb < c.N / 16; ++cb) {
      Outputs out = factors.from_row(cb * 16, c.per_row, layout);
      out.q = rows.data();
      unpack_rows<format.value>(in + cb * 16 * row_bytes, 16, c.per_row, layout, values, out);
      pack_column_block(rows.data(), K, layout.bits, dst + cb * block_bytes);
    }
  });
  return {packed, factors.scale, factors.min, factors.d, factors.steps, factors.dmin, factors.min_steps};
}

}  // namespace fiberserve
