// A GGUF tensor's blocks unpacked in one pass over its bytes: each weight's q as a byte, each scale group's scale
// and min in float32 (w = scale * q + min, the values gguf's dequantize computes), and for the K formats the
// file's own factors (a float16 per super-block of 256, an int8 step per group; min steps negated).  The layouts
// are llama.cpp's (ggml-common.h); QuantBlocks.from_gguf documents what each format's q and zero are.

#include <ATen/ATen.h>

#include <cstring>
#include <string>

#include "ops.h"

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

enum class Type { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kIQ4_NL, kQ4_K, kQ5_K, kQ6_K };

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
  if (name == "Q4_0") return {Type::kQ4_0, 32, 18, 1};
  if (name == "IQ4_NL") return {Type::kIQ4_NL, 32, 18, 1};
  if (name == "Q4_1") return {Type::kQ4_1, 32, 20, 1};
  if (name == "Q5_0") return {Type::kQ5_0, 32, 22, 1};
  if (name == "Q5_1") return {Type::kQ5_1, 32, 24, 1};
  if (name == "Q8_0") return {Type::kQ8_0, 32, 34, 1};
  if (name == "Q4_K") return {Type::kQ4_K, 256, 144, 8};
  if (name == "Q5_K") return {Type::kQ5_K, 256, 176, 8};
  if (name == "Q6_K") return {Type::kQ6_K, 256, 210, 16};
  TORCH_CHECK(false, "unpack_gguf_blocks: ", name, " is not a served block format");
}

}  // namespace

std::vector<at::Tensor> unpack_gguf_blocks(const at::Tensor& raw_in, const std::string& type,
                                           const std::optional<at::Tensor>& table_in) {
  TORCH_CHECK(raw_in.dim() == 2 && raw_in.scalar_type() == at::kByte, "unpack_gguf_blocks: raw must be uint8 [N, bytes]");
  const Layout layout = layout_of(type);
  const at::Tensor raw = raw_in.contiguous();
  const int64_t N = raw.size(0), per_row = raw.size(1) / layout.bytes;
  TORCH_CHECK(raw.size(1) % layout.bytes == 0, "unpack_gguf_blocks: a row is not whole ", type, " blocks");
  at::Tensor table;
  if (layout.type == Type::kIQ4_NL) {
    TORCH_CHECK(table_in && table_in->numel() == 16 && table_in->scalar_type() == at::kChar,
                "unpack_gguf_blocks: IQ4_NL needs its int8 table of 16 values");
    table = table_in->contiguous();
  }
  const int64_t K = per_row * layout.inputs, groups = per_row * layout.groups;
  const bool k_format = layout.inputs == 256, mins = layout.type == Type::kQ4_K || layout.type == Type::kQ5_K;
  const auto bytes = raw.options();
  at::Tensor q = at::empty({N, K}, bytes), scale = at::empty({N, groups}, bytes.dtype(at::kFloat)),
             min = at::empty({N, groups}, bytes.dtype(at::kFloat));
  at::Tensor d = at::empty({k_format ? N : 0, per_row}, bytes.dtype(at::kHalf));
  at::Tensor steps = at::empty({k_format ? N : 0, groups}, bytes.dtype(at::kChar));
  at::Tensor dmin = at::empty({mins ? N : 0, per_row}, bytes.dtype(at::kHalf));
  at::Tensor min_steps = at::empty({mins ? N : 0, groups}, bytes.dtype(at::kChar));
  const uint8_t* in = raw.data_ptr<uint8_t>();
  const int8_t* values = table.defined() ? table.data_ptr<int8_t>() : nullptr;
  const Outputs out{q.data_ptr<uint8_t>(),
                    scale.data_ptr<float>(),
                    min.data_ptr<float>(),
                    k_format ? d.data_ptr<c10::Half>() : nullptr,
                    mins ? dmin.data_ptr<c10::Half>() : nullptr,
                    k_format ? steps.data_ptr<int8_t>() : nullptr,
                    mins ? min_steps.data_ptr<int8_t>() : nullptr};
  switch (layout.type) {
    case Type::kQ4_0: unpack_rows<Type::kQ4_0>(in, N, per_row, layout, values, out); break;
    case Type::kIQ4_NL: unpack_rows<Type::kIQ4_NL>(in, N, per_row, layout, values, out); break;
    case Type::kQ4_1: unpack_rows<Type::kQ4_1>(in, N, per_row, layout, values, out); break;
    case Type::kQ5_0: unpack_rows<Type::kQ5_0>(in, N, per_row, layout, values, out); break;
    case Type::kQ5_1: unpack_rows<Type::kQ5_1>(in, N, per_row, layout, values, out); break;
    case Type::kQ8_0: unpack_rows<Type::kQ8_0>(in, N, per_row, layout, values, out); break;
    case Type::kQ4_K: unpack_rows<Type::kQ4_K>(in, N, per_row, layout, values, out); break;
    case Type::kQ5_K: unpack_rows<Type::kQ5_K>(in, N, per_row, layout, values, out); break;
    case Type::kQ6_K: unpack_rows<Type::kQ6_K>(in, N, per_row, layout, values, out); break;
  }
  return {q, scale, min, d, steps, dmin, min_steps};
}

}  // namespace fiberserve
