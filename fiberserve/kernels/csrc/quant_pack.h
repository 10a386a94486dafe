// One column block of quant_linear's packed layout (the layouts: quant_pack.cpp), from its 16 rows of q.
#pragma once

#include <cstdint>
#include <vector>

namespace fiberserve {

// Bytes of one column block (16 outputs by K inputs) of the packed layout for q of `bits` bits.
inline int64_t packed_column_block_bytes(int64_t K, int64_t bits) { return K * 16 * bits / 8; }

// rows: q uint8 [16, K] (values below 2^bits; bits 4, 6 or 8, K % 32 == 0); out: the column block's
// packed_column_block_bytes(K, bits) bytes.
inline void pack_column_block(const uint8_t* rows, int64_t K, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    for (int64_t o = 0; o < 16; ++o) {
      const uint8_t* row = rows + o * K;
      uint8_t* dst = out + o * 4;
      for (int64_t s = 0; s < K / 4; ++s)
        for (int i = 0; i < 4; ++i) dst[s * 64 + i] = row[4 * s + i];
    }
    return;
  }
  const int64_t loads = bits == 4 ? 4 : 6, blocks = K / 32;
  for (int64_t o = 0; o < 16; ++o) {
    const uint8_t* row = rows + o * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* in = row + b * 32;
      uint8_t* dst = out + b * loads * 64 + o * 4;
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
}

// The packed tensor's shape for N outputs (N % 16 == 0) and K inputs.
inline std::vector<int64_t> packed_shape(int64_t N, int64_t K, int64_t bits) {
  if (bits == 8) return {N / 16, K / 4, 16, 4};
  return {N / 16, K / 32, bits == 4 ? 4 : 6, 16, 4};
}

}  // namespace fiberserve
