// One column block of quant_linear's packed layout (the layouts: quant_pack.cpp), from its 16 rows of q.
#pragma once

#include <cstdint>
#include <vector>

namespace fiberserve {

// Bytes of one column block (16 outputs by K inputs) of the packed layout for q of `bits` bits.
inline int64_t packed_column_block_bytes(int64_t K, int64_t bits) { return K * 16 * bits / 8; }

// Two loads of 2-bit fields of q (a 2- or 3-bit layout's low 2 bits, 6 bits' high 2 bits): byte p of load i holds,
// at bits 2 (2 pair + half), `field` of q for input 16 half + 4 (2i + pair) + p % 4 of the block (the 4 x 2 steps
// of a 64-byte load).
template <typename Field>
inline void pack_pairs(const uint8_t* block, int64_t o, const Field& field, uint8_t* dst) {
  for (int load = 0; load < 2; ++load)
    for (int i = 0; i < 4; ++i) {
      uint8_t packed = 0;
      for (int pair = 0; pair < 2; ++pair)
        for (int half = 0; half < 2; ++half)
          packed |= field(block[16 * half + 4 * (2 * load + pair) + i]) << (2 * (2 * pair + half));
      dst[load * 64 + o * 4 + i] = packed;
    }
}

// rows: q uint8 [16, K] (values below 2^bits; bits 2, 3, 4, 6 or 8, K % 32 == 0); out: the column block's
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
  const int64_t blocks = K / 32;  // each block of the column block is `bits` loads of 64 bytes
  for (int64_t o = 0; o < 16; ++o) {
    const uint8_t* row = rows + o * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* in = row + b * 32;
      uint8_t* dst = out + b * bits * 64;
      if (bits <= 3) {
        pack_pairs(in, o, [](uint8_t q) { return q & 3; }, dst);
        if (bits == 3)
          for (int i = 0; i < 4; ++i) {
            uint8_t high = 0;
            for (int j = 0; j < 4; ++j)
              for (int half = 0; half < 2; ++half) high |= ((in[16 * half + 4 * j + i] >> 2) & 1) << (2 * j + half);
            dst[2 * 64 + o * 4 + i] = high;
          }
        continue;
      }
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          dst[j * 64 + o * 4 + i] = (in[4 * j + i] & 0x0F) | ((in[16 + 4 * j + i] & 0x0F) << 4);
      if (bits == 6) pack_pairs(in, o, [](uint8_t q) { return q >> 4; }, dst + 4 * 64);
    }
  }
}

// The packed tensor's shape for N outputs (N % 16 == 0) and K inputs.
inline std::vector<int64_t> packed_shape(int64_t N, int64_t K, int64_t bits) {
  if (bits == 8) return {N / 16, K / 4, 16, 4};
  return {N / 16, K / 32, bits, 16, 4};
}

}  // namespace fiberserve
