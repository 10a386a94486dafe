// Block-quantized weights' q into quant_linear's packed layout (see linear_quant.cpp), the work of loading a file:
// a pass over the bytes in plain loops, where tensor permutes of 4-byte runs take many times as long.
//   4 bits: [N / 16][K / 32][4][16][4]: load j of a block holds inputs 4j..4j+3 in the low nibbles and 16+4j..
//           16+4j+3 in the high ones, for each of the 16 outputs;
//   6 bits: the 4 bits' loads of q's low nibbles, then per block 2 loads whose byte p holds the 2 high bits of byte p
//           of loads 2i (bits 0-1 low inputs, 2-3 high) and 2i + 1 (bits 4-5, 6-7);
//   8 bits: [N / 16][K / 4][16][4], a byte each.

#include <ATen/ATen.h>

#include "ops.h"

namespace fiberserve {

at::Tensor quant_pack_q(const at::Tensor& q_in, int64_t bits) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kByte, "quant_pack_q: q must be uint8 [N, K]");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "quant_pack_q: bits must be 4, 6 or 8");
  const at::Tensor q = q_in.contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "quant_pack_q: N must be a multiple of 16 and K of 32");
  const int64_t column_blocks = N / 16, blocks = K / 32;
  const uint8_t* src = q.data_ptr<uint8_t>();
  if (bits == 8) {
    at::Tensor packed = at::empty({column_blocks, K / 4, 16, 4}, q.options());
    uint8_t* out = packed.data_ptr<uint8_t>();
    for (int64_t cb = 0; cb < column_blocks; ++cb)
      for (int64_t o = 0; o < 16; ++o) {
        const uint8_t* row = src + (cb * 16 + o) * K;
        uint8_t* dst = out + cb * K * 16 + o * 4;
        for (int64_t s = 0; s < K / 4; ++s)
          for (int i = 0; i < 4; ++i) dst[s * 64 + i] = row[4 * s + i];
      }
    return packed;
  }
  const int64_t loads = bits == 4 ? 4 : 6;
  at::Tensor packed = at::empty({column_blocks, blocks, loads, 16, 4}, q.options());
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t cb = 0; cb < column_blocks; ++cb)
    for (int64_t o = 0; o < 16; ++o) {
      const uint8_t* row = src + (cb * 16 + o) * K;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* in = row + b * 32;
        uint8_t* dst = out + ((cb * blocks + b) * loads) * 64 + o * 4;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) dst[j * 64 + i] = (in[4 * j + i] & 0x0F) | ((in[16 + 4 * j + i] & 0x0F) << 4);
        if (bits == 6)
          for (int pair_load = 0; pair_load < 2; ++pair_load)
            for (int i = 0; i < 4; ++i) {
              uint8_t high = 0;
              for (int pair = 0; pair < 2; ++pair)
                for (int half = 0; half < 2; ++half)
                  high |= (in[16 * half + 4 * (2 * pair_load + pair) + i] >> 4) << (2 * (2 * pair + half));
              dst[(4 + pair_load) * 64 + i] = high;
            }
      }
    }
  return packed;
}

}  // namespace fiberserve
