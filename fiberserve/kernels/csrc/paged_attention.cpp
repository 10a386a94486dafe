// Paged attention for CPU: every query row attends to its own sequence's keys, read in place from the
// KV cache through the sequence's page table.
//
// Contract (see fiberserve/kernels/__init__.py for the Python side):
//   q        [T, H, D]          float32 / bfloat16 / float16; rows may be strided, heads and dims packed
//   k, v     [slots, KVH, W]    one layer of the cache, contiguous: in q's dtype (W = D), or quantized, float8
//                               e4m3fn or q8_0 (kv_rows.h), dequantized as they are read
//   pages    int32 [S, P]       page table of each sequence (span); slot = page * page_size + offset
//   row_span int32 [T]          the span of each row, or -1 for a padding row (output zero)
//   row_keys int32 [T]          how many keys the row sees (its position + 1: causal)
//   window                      > 0: the row sees only the last `window` of them (sliding-window layers)
//   softcap                     > 0: scores are softcap * tanh(score / softcap) (Gemma 2)
//   returns  [T, H * D]         query head qh reads kv head qh / (H / KVH)
//
// Batch invariance: a row's result depends only on its query and its keys.  Each row has a fixed order of
// operations (float32 dot products with 16 fixed partial sums, a two-pass softmax, a float32 weighted sum in key
// order) whatever rows share its tile (see Attend), so a row computes the same bits alone, inside any batch, as a
// decode token or inside a prefill chunk of any length.
//
// bfloat16 with head_dim 64 or 128 on AVX512-BF16 (kPairs): both products run on vdpbf16ps, two exact bf16
// products per lane and instruction.  Scores take q and k as they are, keys transposed in blocks of 16 so that a
// score is one lane's sum over the dim pairs in order (a span's keys are transposed once per call where it has
// several tiles, a prefill chunk's; a decode row's tile transposes its own); the weighted sums take the probabilities
// rounded to bfloat16 (as flash attention does on GPUs) against two keys' values interleaved dim by dim, and
// divide by the sum of the rounded probabilities.  Results differ from the float32 path in the last bits.
//
// A quantized cache takes the float32 path, its rows dequantized (exactly) as they are loaded: the same bits as
// the float32 path over the dequantized rows, at a half (q8_0: 17/32) of bfloat16's bytes read per key.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kv_rows.h"
#include "ops.h"
#include "simd/vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace fiberserve {
namespace {

constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kMaxChunks = 16;  // head_dim / 16
constexpr int32_t kShareHeadsKeys = 96;  // fewest keys for which the threads share a row's kv heads (see attend)

template <typename scalar_t>
// Into L2 (prefetcht1): L1's few miss buffers fill up with prefetcht0 and stall the loop.
inline void prefetch(const scalar_t* first, int64_t count) {
  for (int64_t byte = 0; byte < count * static_cast<int64_t>(sizeof(scalar_t)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(first) + byte, 0, 2);
}

// bfloat16 rows on CPUs with AVX512-BF16, head_dim a multiple of 32: scores by vdpbf16ps straight from the
// bf16 query and key (16 lanes x 2 products per instruction, no widening), weighted sums by vdpbf16ps over pairs
// of keys (see weighted_pairs).
// Row: how the cache stores a row (kv_rows.h); only bfloat16 rows are paired.
template <typename scalar_t, int kChunks, typename Row = ModelRow<scalar_t>>
constexpr bool kPairs =
#if defined(__AVX512BF16__)
    std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<Row, ModelRow<scalar_t>> && kChunks > 0 &&
    kChunks % 2 == 0;
#else
    false;
#endif

// The first key a row sees: 0, or with a sliding window the first of its last `window` keys.
inline int64_t first_key(int64_t keys, int64_t window) { return window > 0 ? std::max<int64_t>(0, keys - window) : 0; }

#if defined(__AVX512BF16__)
// Keys as the bf16 score products read them: a block of 16 keys of one kv head as head_dim / 2 vectors, vector p
// lane j holding key j's dims 2p and 2p + 1.  One vdpbf16ps then adds a dim pair's products to 16 keys' scores at
// once, and each score is its own lane's chain over the pairs in order: no sums across lanes.

// Transposes a 16 x 16 matrix of 32-bit elements held in 16 registers (row i becomes column i).
inline void transpose16(__m512i (&r)[kLanes]) {
  __m512i t[kLanes];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: 2 x 2 blocks of rows 2i, 2i + 1
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: r[4i + c] holds column 4 lane + c of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather the 128-bit lanes: column 4 lane + c from r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i a0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), a1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i b0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i b1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
  for (int i = 0; i < kLanes; ++i) r[i] = t[i];
}

// Writes the block of keys rows[0..15] (a key's head row; nullptr: no key, zeros) as `pairs` vectors to out.
inline void transpose_keys(const c10::BFloat16* const (&rows)[kLanes], int64_t pairs, uint32_t* out) {
  for (int64_t column = 0; column < pairs; column += kLanes) {
    __m512i r[kLanes];
    for (int j = 0; j < kLanes; ++j) r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 2 * column) : _mm512_setzero_si512();
    transpose16(r);
    for (int j = 0; j < kLanes; ++j) _mm512_storeu_si512(out + (column + j) * kLanes, r[j]);
  }
}
#endif

// A span's keys transposed once for all of its tiles (a prefill chunk's rows), block b of kv head h at
// data + ((h * blocks) + b - first_block) * head_dim / 2 * 16; data null: the tiles transpose their own.
struct TransposedKeys {
  const uint32_t* data = nullptr;
  int64_t first_block = 0, blocks = 0;
};
constexpr int64_t kTransposeOnceTiles = 4;  // fewest tiles of a span for which its keys are transposed once

// The work of row tiles: up to kTileRows consecutive rows of one span (a prefill chunk's; a decode row is a tile of
// its own), for each kv head the G query heads sharing it against the rows' keys, read in place through the page
// table.  Each key and value is loaded once for the tile's rows, not once per row: a long prefill's rows read the
// whole sequence's keys and values each, more than the caches hold, so loads bound a row at a time.  kChunks =
// head_dim / 16 and kGroup = G when fixed at compile time, else 0.
//
// A row's arithmetic does not depend on its tile: each score is its own 16 partial sums reduced by lane_sums16
// (whose every output is its own lanes', in lane_sum's order; kPairs: one lane's sum over the dim pairs in order),
// the softmax runs over the row's own keys in blocks of 16 from its first, and the weighted sum adds the row's own
// keys (kPairs: pairs of keys) in order; so a row computes the same bits alone, inside any batch, as a decode token
// or inside a prefill chunk of any length.
constexpr int kTileRows = 2;  // with G x head_dim / 16 sums per row in registers, 2 rows fill them

// Vector registers the weighted sums' accumulators may take (of 32 zmm, or of 16 ymm where a 16-lane vector is two
// halves), and the registers one 16-lane vector takes.
constexpr int kRegistersPerVector = kIsHalves<f32x16> ? 2 : 1;
constexpr int kSumRegisters = kIsHalves<f32x16> ? 12 : 24;

template <typename scalar_t, int kChunks, int kGroup = 0, typename Row = ModelRow<scalar_t>>
struct Attend {
  using cache_t = typename Row::element;
  static constexpr bool kPaired = kPairs<scalar_t, kChunks, Row>;
  const scalar_t* q;
  const cache_t *k, *v;
  const int32_t *pages, *span_of, *keys_of;
  scalar_t* out;
  int64_t q_row_stride, heads, kv_heads, dim, max_pages, page_size, window;
  float scale, softcap;
  const int64_t* tiles;  // tile t is rows tiles[t] .. tiles[t + 1] - 1
  const TransposedKeys* transposed;  // per span (kPairs only)
  int64_t row_width;                 // elements of a cache row: Row::width(dim)

  static constexpr int kG = kGroup ? kGroup : kMaxGroup, kC = kChunks ? kChunks : kMaxChunks;  // array sizes

  // The keys of a tile: row r sees keys first[r] .. last[r] - 1, the tile begin .. hi - 1; scores are formed from
  // lo (begin rounded down to a block of 16) and slots[i] is where key lo + i starts in k and v (slot * kv_heads *
  // D; keys before begin read key begin's, whose scores no row uses).
  struct Keys {
    std::vector<int64_t> slots;
    int64_t first[kTileRows], last[kTileRows], begin, lo, hi;
    int32_t span;
  };

  // softcap * tanh(s / softcap), tanh from exp of a non-positive argument (sign restored).
  f32x16 capped(f32x16 s) const {
    const f32x16 x = s * (1.0f / softcap), e = exp_nonpositive(select(x < 0.0f, x, -x) * 2.0f);
    const f32x16 t = (1.0f - e) / (1.0f + e);
    return select(x < 0.0f, -t, t) * softcap;
  }

  // Work units begin..end-1: unit u is tile u / parts against its kv heads' share u % parts (parts = 1: all of
  // them; parts = kv_heads: one each).  A tile's heads run in turn: the first one's pass fetches the whole slot
  // rows (every head's keys and values, contiguous), so the others find them in cache.  A kv head's result does
  // not depend on which unit computes it, so neither does a row's.
  void run(int64_t begin, int64_t end, int64_t parts) const {
    const int64_t D = (kChunks ? kChunks : dim / kLanes) * kLanes, G = kGroup ? kGroup : heads / kv_heads;
    const int64_t slot_width = kv_heads * row_width;
    Keys keys;
    std::vector<float> scores;  // [tile row][g][width]: the scores of keys lo.., then their probabilities
    for (int64_t unit = begin, tile = -1; unit < end; ++unit) {
      const bool new_tile = unit / parts != tile;
      tile = unit / parts;
      const int64_t part = unit % parts, head_begin = part * kv_heads / parts, head_end = (part + 1) * kv_heads / parts;
      const int64_t row0 = tiles[tile], R = tiles[tile + 1] - row0;
      const int32_t span = span_of[row0];
      if (span < 0) {
        for (int64_t row = row0; row < row0 + R; ++row)
          std::fill(out + (row * heads + head_begin * G) * D, out + (row * heads + head_end * G) * D, scalar_t(0));
        continue;
      }
      if (new_tile) {
        keys.begin = std::numeric_limits<int64_t>::max(), keys.hi = 0, keys.span = span;
        for (int64_t r = 0; r < R; ++r) {
          keys.last[r] = keys_of[row0 + r];
          keys.first[r] = first_key(keys.last[r], window);
          keys.begin = std::min(keys.begin, keys.first[r]), keys.hi = std::max(keys.hi, keys.last[r]);
        }
        keys.lo = keys.begin / kLanes * kLanes;
        const int32_t* table = pages + span * max_pages;
        keys.slots.resize(keys.hi - keys.lo);
        for (int64_t i = 0, page_index = keys.begin / page_size, offset = keys.begin % page_size; i < keys.hi - keys.lo;
             ++i) {
          keys.slots[i] = (static_cast<int64_t>(table[page_index]) * page_size + offset) * slot_width;
          if (keys.lo + i >= keys.begin && ++offset == page_size) ++page_index, offset = 0;
        }
        for (int64_t i = 0; i < std::min<int64_t>(kLanes, keys.hi - keys.lo); ++i) prefetch(k + keys.slots[i], slot_width);
      }
      for (int64_t head = head_begin; head < head_end; ++head) {
        const bool first_pass = new_tile && head == head_begin;
        if (R == kTileRows) attend_tile<kTileRows>(row0, head, first_pass, keys, scores);
        else attend_tile<1>(row0, head, first_pass, keys, scores);
      }
    }
  }

  // kR rows from row0 against kv head `head` and the tile's keys.
  template <int kR>
  void attend_tile(int64_t row0, int64_t head, bool first_pass, const Keys& keys, std::vector<float>& scores) const {
    const int64_t C = kChunks ? kChunks : dim / kLanes, D = C * kLanes, G = kGroup ? kGroup : heads / kv_heads;
    const int64_t slot_width = kv_heads * row_width, lo = keys.lo, hi = keys.hi;
    const int64_t width = (hi - lo + kLanes - 1) / kLanes * kLanes + kLanes;
    scores.resize(kR * G * width);
    auto row_scores = [&](int r, int64_t g) { return scores.data() + (r * G + g) * width; };
    auto query_row = [&](int r, int64_t g) { return q + (row0 + r) * q_row_stride + (head * G + g) * D; };
    f32x16 key[kC];

    // Scores 16 keys at a time, each key loaded once for every row and query head of the tile.
    if constexpr (kPaired) {
      pair_scores<kR>(row0, head, first_pass, keys, scores.data(), width);
    } else {
      // The tile's queries widened to float32 once (exactly), rather than once per key.
      alignas(64) float wide_queries[kR][kG][kC * kLanes];
      for (int r = 0; r < kR; ++r)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t c = 0; c < C; ++c) store16(wide_queries[r][g] + c * kLanes, load16(query_row(r, g) + c * kLanes));
      for (int64_t block = lo; block < hi; block += kLanes) {
        f32x16 partial[kR][kG][kLanes];
        for (int64_t j = 0, count = std::min<int64_t>(kLanes, hi - block); j < count; ++j) {
          const int64_t i = block - lo + j;
          if (first_pass) {  // keys a group ahead, values for the second loop
            if (i + kLanes < hi - lo) prefetch(k + keys.slots[i + kLanes], slot_width);
            prefetch(v + keys.slots[i], slot_width);
          }
          const cache_t* key_row = k + keys.slots[i] + head * row_width;
          for (int64_t c = 0; c < C; ++c) key[c] = Row::load(key_row, D, c * kLanes);
          for (int r = 0; r < kR; ++r)
            for (int64_t g = 0; g < G; ++g) {
              const float* query = wide_queries[r][g];
              f32x16 sum = load16(query) * key[0];
              for (int64_t c = 1; c < C; ++c) sum += load16(query + c * kLanes) * key[c];
              partial[r][g][j] = sum;
            }
        }
        for (int r = 0; r < kR; ++r)
          for (int64_t g = 0; g < G; ++g) {
            const f32x16 score = lane_sums16(partial[r][g]) * scale;
            store16(row_scores(r, g) + (block - lo), softcap > 0.0f ? capped(score) : score);
          }
      }
    }

    // Each row's softmax over its own keys, in blocks of 16 from its first.  kPairs: the numerators rounded to
    // bfloat16 (the weighted sums' operands) and summed so, so that the weights sum to one.
    float total[kR][kG];
    for (int r = 0; r < kR; ++r) {
      const int64_t n = keys.last[r] - keys.first[r], padded = (n + kLanes - 1) / kLanes * kLanes;
      for (int64_t g = 0; g < G; ++g) {
        float* s = row_scores(r, g) + (keys.first[r] - lo);
        const float top = max_of(s, n);
        f32x16 sum = {};
        for (int64_t j = 0; j < padded; j += kLanes) {
          f32x16 e = exp_nonpositive(load16(s + j) - top);
          if constexpr (kPaired) e = round_to_bf16(e);
          e = select(lane_index() + static_cast<int32_t>(j) < static_cast<int32_t>(n), e, f32x16{});  // padding: 0
          store16(s + j, e);
          sum += e;
        }
        total[r][g] = lane_sum(sum);
      }
    }
    if constexpr (kPaired) {
      weighted_pairs<kR>(row0, head, keys, scores.data(), width, total);
      return;
    }

    // Each output dim sums p * value over the row's keys in order, in float32, kDimChunks chunks of 16 dims at a
    // time so that their sums stay in registers (the order of each dim's sum does not depend on the blocking).
    constexpr int kDimChunks = std::clamp(kSumRegisters / (kR * kG * kRegistersPerVector), 1, kC);
    for (int64_t c0 = 0; c0 < C; c0 += kDimChunks) {
      const int64_t chunks = std::min<int64_t>(kDimChunks, C - c0);
      f32x16 acc[kR][kG][kDimChunks];
      for (int r = 0; r < kR; ++r)
        for (int64_t g = 0; g < G; ++g)
          for (int c = 0; c < kDimChunks; ++c) acc[r][g][c] = f32x16{};
      for (int64_t position = keys.begin; position < hi; ++position) {
        const cache_t* value_row = v + keys.slots[position - lo] + head * row_width;
        for (int64_t c = 0; c < chunks; ++c) key[c] = Row::load(value_row, D, (c0 + c) * kLanes);
        for (int r = 0; r < kR; ++r) {
          if (position < keys.first[r] || position >= keys.last[r]) continue;
          for (int64_t g = 0; g < G; ++g) {
            const float p = row_scores(r, g)[position - lo];
            for (int64_t c = 0; c < chunks; ++c) acc[r][g][c] += p * key[c];
          }
        }
      }
      for (int r = 0; r < kR; ++r) {
        scalar_t* o = out + ((row0 + r) * heads + head * G) * D + c0 * kLanes;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.0f / total[r][g];
          for (int64_t c = 0; c < chunks; ++c) store16(o + g * D + c * kLanes, acc[r][g][c] * inv);
        }
      }
    }
  }

  // kPairs weighted sums: keys in pairs from even positions, a pair's two bfloat16 probabilities against its two
  // values interleaved dim by dim, one vdpbf16ps per 16 dims; each row sums its own pairs in order, from the pair
  // holding its first key (probabilities outside the row's keys are zero), so its bits do not depend on its tile.
  template <int kR>
  void weighted_pairs(int64_t row0, int64_t head, const Keys& keys, float* scores, int64_t width,
                      const float (&total)[kR][kG]) const {
#if defined(__AVX512BF16__)
    constexpr int kHalves = kChunks / 2;  // 32 dims per 512-bit load of a value row
    const int64_t G = kGroup ? kGroup : heads / kv_heads, D = kChunks * kLanes, lo = keys.lo, hi = keys.hi;
    int64_t pair_first[kR];
    for (int r = 0; r < kR; ++r) {
      pair_first[r] = keys.first[r] / 2 * 2;
      for (int64_t g = 0; g < G; ++g) {  // the other key of the row's first and last pairs weighs nothing
        float* s = scores + (r * G + g) * width;
        if (pair_first[r] < keys.first[r]) s[pair_first[r] - lo] = 0.0f;
        if (keys.last[r] < hi) s[keys.last[r] - lo] = 0.0f;
      }
    }
    __m512 acc[kR][kG][2 * kHalves];
    for (int r = 0; r < kR; ++r)
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < 2 * kHalves; ++c) acc[r][g][c] = _mm512_setzero_ps();
    for (int64_t position = keys.begin / 2 * 2; position < hi; position += 2) {
      // values[2c] lane (l, i) (128-bit lane l) holds dim 32c + 8l + i of both keys, values[2c + 1] dim
      // 32c + 8l + 4 + i
      __m512bh values[2 * kHalves];
      const scalar_t* first_row = v + keys.slots[std::max(position, keys.begin) - lo] + head * D;
      for (int c = 0; c < kHalves; ++c) {
        const __m512i a = position >= keys.begin ? _mm512_loadu_si512(first_row + 32 * c) : _mm512_setzero_si512();
        const __m512i b = position + 1 < hi ? _mm512_loadu_si512(v + keys.slots[position + 1 - lo] + head * D + 32 * c)
                                            : _mm512_setzero_si512();
        values[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        values[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int r = 0; r < kR; ++r) {
        if (position < pair_first[r] || position >= keys.last[r]) continue;
        for (int64_t g = 0; g < G; ++g) {
          const float* p = scores + (r * G + g) * width + (position - lo);
          uint32_t even, odd;
          std::memcpy(&even, p, 4), std::memcpy(&odd, p + 1, 4);
          const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>((even >> 16) | (odd & 0xFFFF0000u)));
          for (int c = 0; c < 2 * kHalves; ++c) acc[r][g][c] = _mm512_dpbf16_ps(acc[r][g][c], weights, values[c]);
        }
      }
    }
    for (int r = 0; r < kR; ++r) {
      scalar_t* o = out + ((row0 + r) * heads + head * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.0f / total[r][g];
        for (int c = 0; c < kHalves; ++c) {
          const f32x16 low = (f32x16)acc[r][g][2 * c], high = (f32x16)acc[r][g][2 * c + 1];  // back in dim order
          const f32x16 first = __builtin_shufflevector(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                                       23);
          const f32x16 second = __builtin_shufflevector(low, high, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                                        30, 31);
          store16(o + g * D + 32 * c, first * inv);
          store16(o + g * D + 32 * c + 16, second * inv);
        }
      }
    }
#endif
  }

  // kPairs scores of a tile: blocks of 16 keys transposed (the span's shared copy, else here), kBlocks at a time so
  // that the tile's kBlocks x kR x G sums are independent chains enough to hide vdpbf16ps's latency.  scores as in
  // attend_tile.
  template <int kR>
  void pair_scores(int64_t row0, int64_t head, bool first_pass, const Keys& keys, float* scores, int64_t width) const {
#if defined(__AVX512BF16__)
    constexpr int64_t D = kChunks * kLanes, kPairCount = D / 2;
    const int64_t G = kGroup ? kGroup : heads / kv_heads, slot_width = kv_heads * D, lo = keys.lo, hi = keys.hi;
    const TransposedKeys& shared = transposed[keys.span];
    alignas(64) __m512i query[kR * kG * kPairCount];  // [r][g][pair]: each query pair in every lane
    float* row_scores[kR][kG];
    for (int r = 0; r < kR; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const auto* pairs = reinterpret_cast<const int32_t*>(q + (row0 + r) * q_row_stride + (head * G + g) * D);
        for (int64_t p = 0; p < kPairCount; ++p) query[(r * G + g) * kPairCount + p] = _mm512_set1_epi32(pairs[p]);
        row_scores[r][g] = scores + (r * G + g) * width;
      }
    constexpr int kBlocks = 4 / kR;
    alignas(64) uint32_t local[kBlocks][kPairCount * kLanes];
    for (int64_t block = lo; block < hi; block += kBlocks * kLanes) {
      const uint32_t* blocks[kBlocks];
      const int count = static_cast<int>(std::min<int64_t>(kBlocks, (hi - block + kLanes - 1) / kLanes));
      for (int b = 0; b < count; ++b) {
        const int64_t start = block + b * kLanes, end = std::min(start + kLanes, hi);
        if (first_pass)  // values for the weighted sums, and keys kBlocks blocks ahead where they are read here
          for (int64_t i = start - lo; i < end - lo; ++i) {
            if (!shared.data && i + kBlocks * kLanes < hi - lo)
              prefetch(k + keys.slots[i + kBlocks * kLanes], slot_width);
            prefetch(v + keys.slots[i], slot_width);
          }
        if (shared.data) {
          blocks[b] = shared.data + (head * shared.blocks + start / kLanes - shared.first_block) * kPairCount * kLanes;
        } else {
          const c10::BFloat16* rows[kLanes];
          for (int64_t j = 0; j < kLanes; ++j)
            rows[j] = start + j < hi ? k + keys.slots[start + j - lo] + head * D : nullptr;
          transpose_keys(rows, kPairCount, local[b]);
          blocks[b] = local[b];
        }
      }
      switch (count) {
        case 4: if constexpr (kBlocks >= 4) block_scores<kR, 4>(query, blocks, G, row_scores, block - lo); break;
        case 3: if constexpr (kBlocks >= 3) block_scores<kR, 3>(query, blocks, G, row_scores, block - lo); break;
        case 2: block_scores<kR, 2>(query, blocks, G, row_scores, block - lo); break;
        default: block_scores<kR, 1>(query, blocks, G, row_scores, block - lo);
      }
    }
#endif
  }

#if defined(__AVX512BF16__)
  // Scores of kB transposed blocks of keys for the tile's rows and query heads, stored at row_scores[r][g] + offset.
  template <int kR, int kB>
  void block_scores(const __m512i* query, const uint32_t* const* blocks, int64_t G,
                    float* const (&row_scores)[kR][kG], int64_t offset) const {
    constexpr int64_t kPairCount = kChunks * kLanes / 2;
    __m512 sums[kB][kR][kG];
    for (int b = 0; b < kB; ++b)
      for (int r = 0; r < kR; ++r)
        for (int64_t g = 0; g < G; ++g) sums[b][r][g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairCount; ++p) {
      __m512bh key_pairs[kB];
      for (int b = 0; b < kB; ++b) key_pairs[b] = (__m512bh)_mm512_loadu_si512(blocks[b] + p * kLanes);
      for (int r = 0; r < kR; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const __m512bh query_pair = (__m512bh)query[(r * G + g) * kPairCount + p];
          for (int b = 0; b < kB; ++b) sums[b][r][g] = _mm512_dpbf16_ps(sums[b][r][g], key_pairs[b], query_pair);
        }
    }
    for (int b = 0; b < kB; ++b)
      for (int r = 0; r < kR; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const f32x16 score = (f32x16)sums[b][r][g] * scale;
          store16(row_scores[r][g] + offset + b * kLanes, softcap > 0.0f ? capped(score) : score);
        }
  }
#endif
};

// How a row's scores are formed: scaled, capped (softcap > 0), over the last `window` keys (window > 0).
struct Scores {
  float scale, softcap;
  int64_t window;
};

// The shared transposed keys of every span with kTransposeOnceTiles tiles or more (kPairs only; otherwise all
// empty): the blocks of 16 keys from its rows' first key to their last, in a buffer of the calling thread's that
// is kept between calls (no fresh pages per layer).  It holds one layer's keys of those spans at most: a bound of
// the KV cache's size / (2 x layers).
template <typename scalar_t, int kChunks, typename Row>
std::vector<TransposedKeys> transpose_spans(const at::Tensor& k, const at::Tensor& pages, const at::Tensor& row_span,
                                            const at::Tensor& row_keys, int64_t page_size, int64_t window,
                                            const std::vector<int64_t>& tiles) {
  std::vector<TransposedKeys> spans(pages.size(0));
#if defined(__AVX512BF16__)
  if constexpr (kPairs<scalar_t, kChunks, Row>) {
    constexpr int64_t D = kChunks * kLanes, kBlockSize = D / 2 * kLanes;
    const int32_t *span_of = row_span.data_ptr<int32_t>(), *keys_of = row_keys.data_ptr<int32_t>();
    std::vector<int64_t> tile_count(spans.size()), first(spans.size(), std::numeric_limits<int64_t>::max()),
        last(spans.size());
    for (size_t t = 0; t + 1 < tiles.size(); ++t)
      if (span_of[tiles[t]] >= 0) ++tile_count[span_of[tiles[t]]];
    for (int64_t row = 0; row < row_span.size(0); ++row) {
      if (span_of[row] < 0 || tile_count[span_of[row]] < kTransposeOnceTiles) continue;
      const int64_t span = span_of[row];
      first[span] = std::min(first[span], first_key(keys_of[row], window));
      last[span] = std::max<int64_t>(last[span], keys_of[row]);
    }
    const int64_t kv_heads = k.size(1);
    std::vector<std::pair<int64_t, int64_t>> jobs;  // (span, block)
    int64_t size = 0;
    std::vector<int64_t> offsets(spans.size());
    for (size_t span = 0; span < spans.size(); ++span) {
      if (tile_count[span] < kTransposeOnceTiles) continue;
      spans[span].first_block = first[span] / kLanes;
      spans[span].blocks = (last[span] + kLanes - 1) / kLanes - spans[span].first_block;
      offsets[span] = size;
      size += kv_heads * spans[span].blocks * kBlockSize;
      for (int64_t b = 0; b < spans[span].blocks; ++b) jobs.emplace_back(span, spans[span].first_block + b);
    }
    if (jobs.empty()) return spans;
    thread_local std::vector<uint32_t> buffer;
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    for (size_t span = 0; span < spans.size(); ++span)
      if (tile_count[span] >= kTransposeOnceTiles) spans[span].data = buffer.data() + offsets[span];
    const auto* cache = k.data_ptr<scalar_t>();
    const int32_t* table = pages.data_ptr<int32_t>();
    const int64_t max_pages = pages.size(1), slot_width = kv_heads * D;
    at::parallel_for(0, static_cast<int64_t>(jobs.size()), 8, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const auto [span, block] = jobs[job];
        const TransposedKeys& keys = spans[span];
        for (int64_t head = 0; head < kv_heads; ++head) {
          const c10::BFloat16* rows[kLanes];
          for (int64_t j = 0; j < kLanes; ++j) {
            const int64_t position = block * kLanes + j;
            rows[j] = position >= first[span] && position < last[span]
                          ? cache + (static_cast<int64_t>(table[span * max_pages + position / page_size]) * page_size +
                                     position % page_size) * slot_width + head * D
                          : nullptr;
          }
          transpose_keys(rows, D / 2, const_cast<uint32_t*>(keys.data) +
                                          (head * keys.blocks + block - keys.first_block) * kBlockSize);
        }
      }
    });
  }
#endif
  return spans;
}

template <typename scalar_t, int kChunks, int kGroup = 0, typename Row = ModelRow<scalar_t>>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
            const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, const Scores& scores,
            at::Tensor& out) {
  // Row tiles: up to kTileRows consecutive rows of one span; a padding row (span -1) is a tile of its own.
  const int64_t rows = q.size(0);
  const int32_t *span_of = row_span.data_ptr<int32_t>(), *keys = row_keys.data_ptr<int32_t>();
  std::vector<int64_t> tiles;
  for (int64_t row = 0; row < rows; ++row)
    if (tiles.empty() || row - tiles.back() == kTileRows || span_of[row] < 0 || span_of[row] != span_of[row - 1])
      tiles.push_back(row);
  const int64_t count = static_cast<int64_t>(tiles.size());
  tiles.push_back(rows);
  const std::vector<TransposedKeys> transposed = transpose_spans<scalar_t, kChunks, Row>(
      k, pages, row_span, row_keys, page_size, scores.window, tiles);
  using cache_t = typename Row::element;
  const Attend<scalar_t, kChunks, kGroup, Row> work{q.data_ptr<scalar_t>(),
                                               static_cast<const cache_t*>(k.data_ptr()),
                                               static_cast<const cache_t*>(v.data_ptr()),
                                               pages.data_ptr<int32_t>(),
                                               span_of,                  keys,
                                               out.data_ptr<scalar_t>(), q.stride(0),
                                               q.size(1),                k.size(1),
                                               q.size(2),                pages.size(1),
                                               page_size,                scores.window,
                                               scores.scale,             scores.softcap,
                                               tiles.data(),             transposed.data(),
                                               Row::width(q.size(2))};
  // Tiles are the work items, unless there are fewer of them than threads (decoding one sequence on two cores)
  // and they have keys enough to be worth sharing: then each (tile, kv head) is one, so that the threads share a
  // tile's heads rather than one attending alone while the others wait (below kShareHeadsKeys, waking the other
  // threads costs more than it saves).
  const bool share_heads =
      rows > 0 && count < at::get_num_threads() && *std::max_element(keys, keys + rows) >= kShareHeadsKeys;
  const int64_t parts = share_heads ? k.size(1) : 1;
  // Each thread takes a contiguous run of units of about equal cost (keys x rows): a causal chunk's last rows see
  // the most keys, so equal counts of units would leave one thread working while the other waits.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count * parts);
  std::vector<int64_t> cost(count * parts + 1);
  for (int64_t unit = 0; unit < count * parts; ++unit) {
    int64_t keys_seen = kLanes;  // a unit's fixed cost, padding tiles' too
    for (int64_t row = tiles[unit / parts]; row < tiles[unit / parts + 1]; ++row)
      if (span_of[row] >= 0) keys_seen += keys[row] - first_key(keys[row], scores.window);
    cost[unit + 1] = cost[unit] + keys_seen;
  }
  std::vector<int64_t> bounds(threads + 1, count * parts);
  for (int64_t t = 0, unit = 0; t < threads; ++t) {
    while (unit < count * parts && cost[unit] * threads < cost.back() * t) ++unit;
    bounds[t] = unit;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) work.run(bounds[t], bounds[t + 1], parts);
  });
}

// attend with the query heads per kv head fixed at compile time for the common groups (bfloat16, and float32,
// which CPUs without AVX-512 run), else at run time.
template <typename scalar_t, int kChunks, typename Row>
void attend_grouped(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                    const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, const Scores& scores,
                    at::Tensor& out) {
  if constexpr (!std::is_same_v<scalar_t, c10::Half>) {
    switch (q.size(1) / k.size(1)) {
      case 1: return attend<scalar_t, kChunks, 1, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
      case 2: return attend<scalar_t, kChunks, 2, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
      case 3: return attend<scalar_t, kChunks, 3, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
      case 4: return attend<scalar_t, kChunks, 4, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
      case 8: return attend<scalar_t, kChunks, 8, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
      default: break;
    }
  }
  attend<scalar_t, kChunks, 0, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
}

// attend_grouped with head_dim / 16 fixed at compile time for the common head sizes (64, 128), else at run time.
template <typename scalar_t, typename Row>
void attend_sized(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                  const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, const Scores& scores,
                  at::Tensor& out) {
  switch (q.size(2) / kLanes) {
    case 4: return attend_grouped<scalar_t, 4, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
    case 8: return attend_grouped<scalar_t, 8, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
    default: return attend<scalar_t, 0, 0, Row>(q, k, v, pages, row_span, row_keys, page_size, scores, out);
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pages,
                           const at::Tensor& row_span, const at::Tensor& row_keys, int64_t page_size, double scale,
                           int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention runs on CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [rows, heads, dim]");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.sizes() == v.sizes(), "the K and V caches differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "head counts do not match");
  TORCH_CHECK(q.size(1) / k.size(1) <= kMaxGroup, "at most ", kMaxGroup, " query heads per kv head");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kLanes * kMaxChunks, "head_dim must be a multiple of 16, <= 256");
  const KvFormat format = kv_format(k, q.scalar_type(), q.size(2));  // checks the rows' width
  TORCH_CHECK(pages.scalar_type() == at::kInt && row_span.scalar_type() == at::kInt &&
                  row_keys.scalar_type() == at::kInt, "index tensors must be int32");
  // rows may be strided (q is usually a slice of the fused qkv output); heads and dims must be packed
  at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  at::Tensor table = pages.contiguous(), spans = row_span.contiguous(), keys = row_keys.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const Scores scores{static_cast<float>(scale), static_cast<float>(softcap), window};
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    switch (format) {
      case KvFormat::kModel:
        return attend_sized<scalar_t, ModelRow<scalar_t>>(qc, k, v, table, spans, keys, page_size, scores, out);
      case KvFormat::kFp8: return attend_sized<scalar_t, Fp8Row>(qc, k, v, table, spans, keys, page_size, scores, out);
      case KvFormat::kQ8: return attend_sized<scalar_t, Q8Row>(qc, k, v, table, spans, keys, page_size, scores, out);
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace fiberserve
