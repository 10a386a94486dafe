// Block-quantized weights' q into quant_linear's packed layout (see linear_quant.cpp), the work of loading a file:
// a pass over the bytes in plain loops, where tensor permutes of 4-byte runs take many times as long.
//   4 bits: [N / 16][K / 32][4][16][4]: load j of a block holds inputs 4j..4j+3 in the low nibbles and 16+4j..
//           16+4j+3 in the high ones, for each of the 16 outputs;
//   6 bits: the 4 bits' loads of q's low nibbles, then per block 2 loads whose byte p holds the 2 high bits of byte p
//           of loads 2i (bits 0-1 low inputs, 2-3 high) and 2i + 1 (bits 4-5, 6-7);
//   2 bits: per block 2 loads laid out as 6 bits' high-bit loads, holding q's 2 bits;
//   3 bits: the 2 bits' loads of q's low 2 bits, then per block 1 load whose byte p holds at bit 2j + half the
//           third bit of q for input 16 half + 4j + p % 4 (the block's 4 steps of each half);
//   8 bits: [N / 16][K / 4][16][4], a byte each.

#include <ATen/ATen.h>

#include "ops.h"
#include "quant_pack.h"

namespace fiberserve {

at::Tensor quant_pack_q(const at::Tensor& q_in, int64_t bits) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kByte, "quant_pack_q: q must be uint8 [N, K]");
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 6 || bits == 8, "quant_pack_q: bits must be 2, 3, 4, 6 or 8");
  const at::Tensor q = q_in.contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "quant_pack_q: N must be a multiple of 16 and K of 32");
  at::Tensor packed = at::empty(packed_shape(N, K, bits), q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  const int64_t block_bytes = packed_column_block_bytes(K, bits);
  for (int64_t cb = 0; cb < N / 16; ++cb) pack_column_block(src + cb * 16 * K, K, bits, out + cb * block_bytes);
  return packed;
}

}  // namespace fiberserve
