// Block-quantized weights x Q8 activations for linear layers: llama.cpp's arithmetic for its block formats.
// out[M, N] = x[M, K] . W[N, K]^T (+ bias), with W in blocks of 32 inputs and each row of x quantized per block of
// 32 to int8 (x ~ dx * xq, dx = max|x| / 127).  A block's weights are w = d * q + m, with a scale d and a min m per
// scale group (the block, or each half of it); the formats (`Format` below) differ in how q is stored:
//   4 bits (Q4_0, Q4_1, Q4_K): q in 0..15, two per byte; a group's dot product is  d * dx * sum(q * xq) + m * sx,
//                  sx = dx * sum(xq); Q4_0's m is -8 d, computed from d rather than stored (the same value);
//   8 bits, signed (Q8_0, Q5_0, IQ4_NL): w = d * (q - 128), q stored as a byte; a group's dot product is
//                  d * dx * (sum(q * xq) - 128 * sum(xq)), no min;
//   6 bits, signed (Q6_K): w = d * (q - 32), q in 0..63 as a 4-bit part and a 2-bit part, a scale per 16 inputs;
//   3 bits, signed (Q3_K: w = d * (q - 4), q in 0..7), and 2 bits with mins (Q2_K: q in 0..3), a scale per 16
//                  inputs: planes of 2 bits (and 1 for Q3_K), walked a half block at a time as the 6 bits are;
//   8 bits with mins (Q5_1, Q5_K and blocks of mixed formats): q a byte, the 4-bit arithmetic,
// i.e. exactly the dot product of the dequantized weights and the quantized activations.  The sums are integer
// arithmetic: AVX512-VNNI vpdpbusd multiplies 4 unsigned q by 4 signed xq per lane, 64 products an instruction
// (twice vdpbf16ps's 32).  The scaling takes some of vpdpbusd's issue slots (the convert runs on other pipes): for
// 4 bits a multiply and two multiply-adds per 16 outputs, 3 per 8 vpdpbusd, so 8/11 = 72% of its rate is this
// arithmetic's ceiling (`fiberserve bench peak`, "int8 in Q4_1 blocks"); the 6 x 2 tile runs at it with its data
// in L1.  For signed bytes the integer sums start at -128 * sum(xq) (a broadcast, free) instead of 0, which leaves
// a multiply and one multiply-add: 8/10.
//
// Layout, per 16 output features: 8 bits as [N / 16][K / 4][16][4] bytes (one 64-byte load is a 4-input step of
// 16 outputs); 4 bits as [N / 16][K / 32][4][16][4] bytes, the low nibble for inputs 4j..4j+3 of a block and the
// high nibble for inputs 16+4j..16+4j+3 (one load holds two steps); 6 bits as the 4 bits' 4 loads of a block and
// then 2 more, each byte of those holding the 2 high bits of the same byte of 4 of the nibble loads' steps (load
// 2i + l, nibble n at bits 2 (2l + n)): a shift and a mask put them above the nibbles; 2 bits as those 2 loads
// alone, holding q; 3 bits as the 2 bits' loads and one more, its byte holding the third bit of 8 steps (load j,
// half h at bit 2j + h), so a block of a column block is `bits` loads (quant_pack.cpp).  d and m: [N / 16][K / group][16], in float16
// where the format's values are float16 (a quarter of the bytes of 4-bit weights, where float32 would be half),
// else float32.  The K formats' d (and m) is a super-block's float16 times a group's small integer (exact in
// float32 only), which the tiles compute from the file's own factors (SuperFactors): int8 [N / 16][K / 256][32 +
// 16 x groups] bytes, per column block and super-block the 16 outputs' float16 factor, then every group's 16
// integer steps (Q4_K then reads 4.6 bits a weight, not the 6 of float32 scales and mins).
// Every row tile unpacks the nibbles in registers (a mask, a shift and a mask per load: integer operations that
// run beside vpdpbusd at no cost), rather than once per column group into a byte buffer: that would add stores
// and read twice the bytes back.
//
// Weights arrive from memory (a decode step reads every layer's once, more than the caches hold), so each thread
// prefetches its next column group's weights, scales and mins a few lines per row tile, and the group's first
// tile does not wait for them.  A single row (one sequence decoding) has too little arithmetic to hide memory
// behind: its tile takes kOneRowGroups column groups at once, that many column blocks' weights read side by side,
// which the hardware prefetchers follow as separate streams (one core draws more bandwidth from several streams
// than from two).
//
// Batch invariance: a row is quantized on its own, and each output is accumulated group by group in order in its
// own lane, so a row gets the same bits alone, in any batch, at any row count.
//
// Where the build targets AMX-INT8 and Linux grants the tiles, a product in a format with a scale per 32 inputs runs
// its whole 16-row tiles on AMX (amx/linear_quant.h: tdpbsud for the integer sums of a scale group, then the vector
// tile's scaling, so the same bits) and the rows left over on the vector tiles.
//
// Compiled where the compiler targets AVX512-VNNI, or AVX2 (avx2/linear_quant.h); quant_gemm_available() says whether it was.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd/prefetch.h"
#include "row_tiles.h"
#include "race.h"
#include "simd/vec16.h"

// The row tiles: AVX512-VNNI's (avx512/linear_quant.h), or AVX2's (avx2/linear_quant.h, the same bits); the rest of the file serves both.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FIBERSERVE_QUANT_TILES 512
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FIBERSERVE_QUANT_TILES 256
#endif

namespace fiberserve {

#if defined(FIBERSERVE_QUANT_TILES)
namespace {

constexpr int kBlock = 16;   // output features per packed column block (one zmm of int32 / float32 sums)
constexpr int kGroup = 32;   // inputs per quantization block
constexpr int kSteps = 8;    // 4-input steps per quantization block
constexpr int64_t kCols = 2;  // column blocks per tile: 32 output features
constexpr int kRows = 6;     // rows per tile: 6 x 2 int32 sums + 6 x 2 float sums
constexpr int kAmxRows = 16;  // rows per AMX tile (amx/linear_quant.h)
#if FIBERSERVE_QUANT_TILES == 512
constexpr int64_t kOneRowGroups = 2;  // column groups a one-row tile takes at once: 4 column blocks, 4 streams
#else
constexpr int64_t kOneRowGroups = 1;  // the AVX2 tile walks its column blocks one at a time
#endif

// The rows of x, quantized: xq int8 [M, K]; per block of 32, dx, sx = dx * sum(xq) and -128 * sum(xq); the same
// two sums per half block, for formats whose scales cover 16 inputs.
struct QuantizedRows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* offset;  // where a signed format's integer sums start
  const float* half_s;
  const int32_t* half_offset;
  int64_t K;
  int64_t blocks;

  // sx of scale group g (of kScaleGroup inputs) of row r.
  template <int kScaleGroup>
  float sum(int64_t r, int64_t g) const {
    return kScaleGroup == kGroup ? s[r * blocks + g] : half_s[r * 2 * blocks + g];
  }

  // -128 * sum(xq) of scale group g of row r.
  template <int kScaleGroup>
  int32_t offset_of(int64_t r, int64_t g) const {
    return kScaleGroup == kGroup ? offset[r * blocks + g] : half_offset[r * 2 * blocks + g];
  }
};

// A weight format of the kernel: the bits of q (4: two per byte; 8: a byte), whether groups have a min (else q is
// signed, stored as q + 128), the type of the scales and mins (int8: a K format's super-block factors and steps),
// the inputs each scale covers, and where nonzero the multiple of d that every min is (then no min is stored: the
// kernel computes it, exactly).
template <int kBits_, bool kMins_, typename scale_t_, int kScaleGroup_, int kMinSteps_ = 0>
struct Format {
  static constexpr int kBits = kBits_;
  static constexpr bool kMins = kMins_;
  static constexpr int kZero = 1 << (kBits_ - 1);  // a signed q's offset
  static constexpr int64_t kBlockBytes = kGroup * kBlock * kBits_ / 8;  // bytes of a block of a column block
  static constexpr int kMinSteps = kMinSteps_;
  static constexpr bool kStoredMins = kMins_ && kMinSteps_ == 0;
  static constexpr int kScaleGroup = kScaleGroup_;
  static constexpr int kScalesPerBlock = kGroup / kScaleGroup_;
  static constexpr bool kSuper = std::is_same_v<scale_t_, int8_t>;
  using scale_t = scale_t_;
  // Whether q is walked a half block at a time (a scale per 16 inputs, 2, 3 or 6 bits).
  static constexpr bool kHalves = kBits_ <= 6 && kScaleGroup_ == kGroup / 2;
  static_assert(kBits == 4 ? kMins && kScaleGroup == kGroup : kBits == 8 || (kHalves && kSuper),
                "4 bits: mins, a scale per block; 2, 3 and 6 bits: K factors per half block");
  static_assert((kBits != 6 && kBits != 3) || !kMins, "3 and 6 bits: signed");
  static_assert(kBits != 2 || kMins, "2 bits: with mins");
  static_assert(!kSuper || !kMins || kScaleGroup == kGroup || kBits == 2, "a K format's mins: per block, or 2 bits' per half");
};

using Q4 = Format<4, true, c10::Half, 32>;           // Q4_1 (and Q4_0 blocks of a mixed matrix)
using Q4Zero8 = Format<4, true, c10::Half, 32, -8>;  // Q4_0: m = -8 d
using Q4Super = Format<4, true, int8_t, 32>;         // Q4_K
using Q4Wide = Format<4, true, float, 32>;           // 4-bit blocks of mixed formats
using Q8 = Format<8, false, c10::Half, 32>;          // Q8_0, Q5_0, IQ4_NL
using Q6Super = Format<6, false, int8_t, 16>;        // Q6_K
using Q3Super = Format<3, false, int8_t, 16>;        // Q3_K
using Q2SuperMins = Format<2, true, int8_t, 16>;     // Q2_K
using Q8SuperMins = Format<8, true, int8_t, 32>;     // Q5_K
using Q8Mins = Format<8, true, float, 32>;           // Q5_1
using Q8HalfMins = Format<8, true, float, 16>;       // blocks of mixed formats

enum class FormatId {
  kQ4, kQ4Zero8, kQ4Super, kQ4Wide, kQ3Super, kQ2SuperMins, kQ6Super, kQ8, kQ8SuperMins, kQ8Mins, kQ8HalfMins
};

// fn(F{}) for the format `id` names.
template <typename Fn>
void with_format(FormatId id, const Fn& fn) {
  switch (id) {
    case FormatId::kQ4: return fn(Q4{});
    case FormatId::kQ4Zero8: return fn(Q4Zero8{});
    case FormatId::kQ4Super: return fn(Q4Super{});
    case FormatId::kQ4Wide: return fn(Q4Wide{});
    case FormatId::kQ3Super: return fn(Q3Super{});
    case FormatId::kQ2SuperMins: return fn(Q2SuperMins{});
    case FormatId::kQ6Super: return fn(Q6Super{});
    case FormatId::kQ8: return fn(Q8{});
    case FormatId::kQ8SuperMins: return fn(Q8SuperMins{});
    case FormatId::kQ8Mins: return fn(Q8Mins{});
    case FormatId::kQ8HalfMins: return fn(Q8HalfMins{});
  }
}

// Where a K format's factors of scale group g lie in a column block's int8 scales (or mins): the super-block's 16
// float16 factors, and the group's 16 steps.
template <typename F>
struct SuperFactors {
  static constexpr int kGroups = 256 / F::kScaleGroup;  // groups per super-block
  static constexpr int64_t kBytes = 32 + 16 * kGroups;  // bytes per super-block
  const c10::Half* factors;
  const int8_t* steps;

  SuperFactors(const int8_t* column_block, int64_t g) {
    const int8_t* super = column_block + (g / kGroups) * kBytes;
    factors = reinterpret_cast<const c10::Half*>(super);
    steps = super + 32 + (g % kGroups) * 16;
  }
};

// A tile's column blocks: the first one's weights, scales and mins (null without), and the strides between blocks.
template <typename F>
struct ColumnBlocks {
  const uint8_t* w;
  const typename F::scale_t* d;
  const typename F::scale_t* m;
  int64_t w_stride, dm_stride;
};

}  // namespace
#endif

}  // namespace fiberserve

#if FIBERSERVE_QUANT_TILES == 512
#include "avx512/linear_quant.h"
#include "amx/linear_quant.h"
#elif FIBERSERVE_QUANT_TILES == 256
#include "avx2/linear_quant.h"
#endif

namespace fiberserve {

#if defined(FIBERSERVE_QUANT_TILES)
namespace {

// Whether a product of M rows in format F runs its whole kAmxRows-row tiles on AMX (amx/linear_quant.h).
template <typename F>
inline bool amx_tiles_run(int64_t M) {
#if defined(FIBERSERVE_AMX_INT8)
  return amx_int8_runs<F>(M);
#else
  (void)M;
  return false;
#endif
}

// How many times M rows' tiles of format F over K inputs step a prefetch cursor: amx_steps per AMX tile (kAmxRows
// rows, where they run), then once per full vector tile of kRows rows.
template <typename F>
inline int64_t prefetch_steps(int64_t M, int64_t K) {
  const int64_t amx_tiles = amx_tiles_run<F>(M) ? M / kAmxRows : 0;
  int64_t steps = (M - amx_tiles * kAmxRows) / kRows;
#if defined(FIBERSERVE_AMX_INT8)
  steps += amx_tiles * amx_steps(K);
#else
  (void)K;
#endif
  return steps;
}

// Rows [0, M) as row tiles: tile(std::integral_constant<int, height>{}, first_row) for each, kAmxRows-row tiles on
// AMX first where they run, then tiles of at most kRows rows, and after_full() after each full one of those.
template <typename F, typename Tile, typename AfterFull>
void for_each_quant_row_tile(int64_t M, const Tile& tile, const AfterFull& after_full) {
  int64_t r = 0;
  if (amx_tiles_run<F>(M))
    for (; r + kAmxRows <= M; r += kAmxRows) tile(std::integral_constant<int, kAmxRows>{}, r);
  for_each_row_tile<kRows>(r, M, tile, after_full);
}

// MR rows from row0 against NR column blocks: on AMX for a kAmxRows-row tile (which calls between() as it goes),
// else on the vector units.  (Groups of more than kCols column blocks serve a single row: for_each_group.)
template <int MR, int NR, typename F, bool kGated, typename out_t, typename Between>
void row_tile(const QuantizedRows& x, int64_t row0, const ColumnBlocks<F>& cols, const float* bias, out_t* out,
              int64_t ldo, const GatedAdd& add, const Between& between) {
  static_assert(MR <= kRows || MR == kAmxRows, "row tiles are the vector tiles' or AMX's");
#if defined(FIBERSERVE_AMX_INT8)
  if constexpr (MR == kAmxRows && NR <= kCols && kOnAmx<F>)
    amx_tile<NR, F, kGated, out_t>(x, row0, cols, bias, out, ldo, add, between);
#else
  (void)between;
#endif
  if constexpr (MR <= kRows) tile<MR, NR, F, kGated, out_t>(x, row0, cols, bias, out, ldo, add);
}

// All rows against NR column blocks, a row tile at a time (`add`: a gated product's additions, gated_add.h).
template <int NR, typename F, bool kGated, typename out_t>
void column_group(const QuantizedRows& x, int64_t M, const ColumnBlocks<F>& cols, const float* bias, out_t* out,
                  int64_t ldo, PrefetchCursor& prefetch, PrefetchCursor& next_group, const GatedAdd& add) {
  const auto step = [&] { prefetch.step(), next_group.step(); };
  for_each_quant_row_tile<F>(
      M,
      [&](auto height, int64_t r) {
        row_tile<decltype(height)::value, NR, F, kGated, out_t>(x, r, cols, bias, out + r * ldo, ldo, add.at(r, 0),
                                                                 step);
      },
      step);
}

// The packed weights of a product: every column block's weights, scales and mins, in one format.
struct Weights {
  const uint8_t* packed;
  FormatId format;
  const char* d;
  const char* m;  // null for signed formats
  int64_t column_blocks;
  int64_t stride, dm_stride, dm_bytes;  // per column block: weight bytes, scales (or mins), their bytes

  int64_t groups() const { return (column_blocks + kCols - 1) / kCols; }
  int64_t count(int64_t g) const { return std::min<int64_t>(kCols, column_blocks - g * kCols); }

  // Column block `first` on, as format F.
  template <typename F>
  ColumnBlocks<F> at(int64_t first) const {
    using scale_t = typename F::scale_t;
    return {packed + first * stride, reinterpret_cast<const scale_t*>(d + first * dm_bytes),
            m ? reinterpret_cast<const scale_t*>(m + first * dm_bytes) : nullptr, stride, dm_stride};
  }

  // Column blocks in the n column groups from g.
  int64_t count(int64_t g, int64_t n) const { return std::min<int64_t>(n * kCols, column_blocks - g * kCols); }

  // body(g, n, prefetch, next_group) for every step of n column groups from g (kCols column blocks each), the
  // groups split evenly between the threads.  A single row steps kOneRowGroups full groups at a time where its
  // thread's share has them, else (and for more rows) one.  Each thread pulls its next step's groups into cache
  // during the current one's row tiles, and its share of `plan` over all its row tiles (a single row has no full
  // row tile: it prefetches in its tile, see prefetch_ahead).
  template <typename F, typename Body>
  void for_each_group(int64_t M, int64_t K, const PrefetchPlan* plan, const Body& body) const {
    const int64_t per_step = M == 1 ? kOneRowGroups : 1, steps = prefetch_steps<F>(M, K);
    at::parallel_for(0, groups(), 1, [&](int64_t begin, int64_t end) {
#if defined(FIBERSERVE_AMX_INT8)
      const AmxInt8Scope scope(amx_tiles_run<F>(M));
#endif
      PrefetchCursor prefetch = PrefetchCursor::thread_share(plan, (end - begin) * steps);
      for (int64_t g = begin, n; g < end; g += n) {
        n = g + per_step <= end && count(g, per_step) == per_step * kCols ? per_step : 1;
        const int64_t next = (g + n) * kCols, next_count = g + n == end ? 0 : count(g + n, std::min(n, end - g - n));
        const ByteRange ahead[3] = {{reinterpret_cast<const char*>(packed + next * stride), next_count * stride},
                                    {d + next * dm_bytes, next_count * dm_bytes},
                                    {m + next * dm_bytes, next_count * dm_bytes}};
        PrefetchCursor next_group(ahead, ahead + (next_count == 0 ? 0 : m ? 3 : 2), steps);
        body(g, n, prefetch, next_group);
      }
    });
  }
};

template <bool kGated, typename out_t>
void product(const QuantizedRows& x, int64_t M, const Weights& weights, const float* bias, out_t* out,
             const PrefetchPlan* plan, const GatedAdd& add) {
  const int64_t N = (kGated ? weights.column_blocks / 2 : weights.column_blocks) * kBlock;
  with_format(weights.format, [&](auto format) {
    using F = decltype(format);
    const auto group = [&](int64_t g, int64_t n, PrefetchCursor& prefetch, PrefetchCursor& next_group) {
      const int64_t first = g * kCols, blocks = weights.count(g, n);
      const ColumnBlocks<F> cols = weights.at<F>(first);
      const float* bg = bias ? bias + first * kBlock : nullptr;
      const int64_t output = (kGated ? g : first) * kBlock;
      out_t* o = out + output;
      const GatedAdd a = add.at(0, output);
      if (blocks == kOneRowGroups * kCols)
        column_group<kOneRowGroups * kCols, F, kGated>(x, M, cols, bg, o, N, prefetch, next_group, a);
      else if (kGated || blocks == kCols) column_group<kCols, F, kGated>(x, M, cols, bg, o, N, prefetch, next_group, a);
      else if constexpr (!kGated) column_group<1, F, false>(x, M, cols, bg, o, N, prefetch, next_group, a);
    };
    weights.template for_each_group<F>(M, x.K, plan, group);
  });
}

// The product's k largest outputs per row, as top_k_rows of the float32 product would find them, without writing
// the product: each tile's outputs go to a small buffer in L1 and on to the row's running lists (RowCandidates,
// with its race where it has one) of the thread, and the threads' lists are merged at the end.  For the output
// head, whose [rows, vocabulary] float32 logits would otherwise be written and read back (a top-k pass, then the
// argmax or the sampler).
template <int NR, typename F>
void column_group_candidates(const QuantizedRows& x, int64_t M, const ColumnBlocks<F>& cols, int64_t first_output,
                             RowCandidates* lists, PrefetchCursor& prefetch, PrefetchCursor& next_group) {
  float buffer[kAmxRows * NR * kBlock];
  constexpr int64_t ldo = NR * kBlock;
  const auto step = [&] { prefetch.step(), next_group.step(); };
  for_each_quant_row_tile<F>(
      M,
      [&](auto height, int64_t r) {
        constexpr int kHeight = decltype(height)::value;
        row_tile<kHeight, NR, F, false, float>(x, r, cols, nullptr, buffer, ldo, {}, step);
        for (int i = 0; i < kHeight; ++i)
          for (int c = 0; c < NR; ++c)
            lists[r + i].offer16(load16(buffer + i * ldo + c * kBlock), first_output + c * kBlock);
      },
      step);
}

void product_candidates(const QuantizedRows& x, int64_t M, const Weights& weights, Candidates& out) {
  const int64_t threads = at::get_num_threads();
  std::vector<RowCandidates> lists = out.lists(threads, M);
  with_format(weights.format, [&](auto format) {
    using F = decltype(format);
    const auto group = [&](int64_t g, int64_t n, PrefetchCursor& prefetch, PrefetchCursor& next_group) {
      RowCandidates* mine = lists.data() + at::get_thread_num() * M;
      const ColumnBlocks<F> cols = weights.at<F>(g * kCols);
      const int64_t first = g * kCols * kBlock, blocks = weights.count(g, n);
      if (blocks == kOneRowGroups * kCols)
        column_group_candidates<kOneRowGroups * kCols, F>(x, M, cols, first, mine, prefetch, next_group);
      else if (blocks == kCols) column_group_candidates<kCols, F>(x, M, cols, first, mine, prefetch, next_group);
      else column_group_candidates<1, F>(x, M, cols, first, mine, prefetch, next_group);
    };
    weights.template for_each_group<F>(M, x.K, nullptr, group);
  });
  // The threads took the groups in order (thread t a range below thread t + 1's).
  out.merge(lists, M);
}

}  // namespace

bool quant_gemm_available() { return true; }

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                     const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool gated) {
  return quant_linear_prefetching(x, packed, scales, mins, bias, out_dtype, gated, nullptr);
}

namespace {

// The checked operands of a product: the weights, and the rows of x quantized into the calling thread's scratch
// buffers, which only grow (no allocation per call, and no zeroing of what a shrink and a regrowth would hand
// back: every down product after a qkv product).
struct Operands {
  at::Tensor w, d, m;
  Weights weights;
  QuantizedRows rows;
  int64_t M;
};

// The bits of q of packed weights: 8 are 4-dimensional [N / 16, K / 4, 16, 4]; the others 5-dimensional [N / 16,
// K / 32, bits, 16, 4] (`bits` loads of 64 bytes a block).
int64_t packed_bits(const at::Tensor& packed) { return packed.dim() == 5 ? packed.size(2) : 8; }

// The format of packed weights, from their tensors (see kernels.quant_pack): 4 bits without mins are Q4_0's (-8
// d); signed bytes have no mins; float32 scales hold one per block of 32 or per half block; int8 scales are a K
// format's factors and steps, per block (Q4_K, Q5_K) or per half block (Q2_K, Q3_K, Q6_K), with mins or (signed)
// without.
FormatId format_of(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t blocks) {
  const int64_t column_blocks = packed.size(0), per_block = column_blocks * blocks * kBlock;
  const int64_t bits = packed_bits(packed);
  if (scales.scalar_type() == at::kChar) {
    TORCH_CHECK(blocks % 8 == 0 && (mins.numel() == 0 || mins.scalar_type() == at::kChar),
                "quant_linear: int8 scales are a K format's (K a multiple of 256; int8 mins or none)");
    const int64_t supers = column_blocks * (blocks / 8);
    const bool halves = scales.numel() == supers * SuperFactors<Q6Super>::kBytes;  // a scale per 16 inputs
    TORCH_CHECK((halves || scales.numel() == supers * SuperFactors<Q4Super>::kBytes) &&
                    (mins.numel() == 0 || mins.numel() == scales.numel()),
                "quant_linear: a K format's scales and mins must be [N / 16, K / 256, 32 + 16 x groups]");
    const bool mins_stored = mins.numel() != 0;
    TORCH_CHECK(halves == (bits < 4 || bits == 6) && mins_stored == (bits == 2 || bits == 4 || bits == 8),
                "quant_linear: K factors fit 2 bits with mins, 3 and 6 bits signed, per 16 inputs; 4 bits and bytes "
                "with mins per 32");
    switch (bits) {
      case 2: return FormatId::kQ2SuperMins;
      case 3: return FormatId::kQ3Super;
      case 4: return FormatId::kQ4Super;
      case 6: return FormatId::kQ6Super;
      default: return FormatId::kQ8SuperMins;
    }
  }
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: ", bits, " bits take a K format's int8 scales");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && mins.scalar_type() == scales.scalar_type(),
              "quant_linear: scales and mins must be float16 or float32, alike");
  TORCH_CHECK(mins.numel() == 0 || mins.numel() == scales.numel(), "quant_linear: mins must match the scales");
  if (bits == 4) {
    TORCH_CHECK(scales.numel() == per_block && (mins.numel() == per_block || (half && mins.numel() == 0)),
                "quant_linear: 4 bits need scales and mins [N / 16, K / 32, 16] (float16 scales alone: Q4_0)");
    return mins.numel() == 0 ? FormatId::kQ4Zero8 : half ? FormatId::kQ4 : FormatId::kQ4Wide;
  }
  if (mins.numel() == 0) {
    TORCH_CHECK(half && scales.numel() == per_block, "quant_linear: signed bytes need float16 scales [N / 16, K / 32, 16]");
    return FormatId::kQ8;
  }
  TORCH_CHECK(!half && (scales.numel() == per_block || scales.numel() == 2 * per_block),
              "quant_linear: bytes with mins need float32 scales and mins [N / 16, K / 32 or K / 16, 16]");
  return scales.numel() == per_block ? FormatId::kQ8Mins : FormatId::kQ8HalfMins;
}

Operands operands(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "quant_linear: x must be bf16 or float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "quant_linear: K must be a multiple of 32");
  const int64_t bits = packed_bits(packed);
  TORCH_CHECK(packed.scalar_type() == at::kByte && ((packed.dim() == 5 && packed.size(1) == blocks &&
                                                      (bits == 2 || bits == 3 || bits == 4 || bits == 6)) ||
                                                     (packed.dim() == 4 && packed.size(1) * 4 == K)),
              "quant_linear: weight not packed for this K");
  const FormatId format = format_of(packed, scales, mins, blocks);
  const int64_t column_blocks = packed.size(0);
  const at::Tensor a = x.contiguous(), w = packed.contiguous(), d = scales.contiguous(), m = mins.contiguous();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx, sx, half_sx;
  thread_local std::vector<int32_t> offset, half_offset;
  if (xq.size() < static_cast<size_t>(M * K)) xq.resize(static_cast<size_t>(M * K));
  if (dx.size() < static_cast<size_t>(M * blocks)) {
    dx.resize(static_cast<size_t>(M * blocks));
    sx.resize(static_cast<size_t>(M * blocks));
    offset.resize(static_cast<size_t>(M * blocks));
    half_sx.resize(static_cast<size_t>(2 * M * blocks));
    half_offset.resize(static_cast<size_t>(2 * M * blocks));
  }
  auto quantize = [&](const auto* rows) {
    quantize_rows(rows, M, K, xq.data(), dx.data(), sx.data(), offset.data(), half_sx.data(), half_offset.data());
  };
  if (a.scalar_type() == at::kFloat) quantize(a.data_ptr<float>());
  else quantize(a.data_ptr<at::BFloat16>());
  const int64_t dm_stride = scales.numel() / column_blocks;
  const Weights weights{w.data_ptr<uint8_t>(), format, static_cast<const char*>(d.data_ptr()),
                        m.numel() ? static_cast<const char*>(m.data_ptr()) : nullptr, column_blocks,
                        K * kBlock * bits / 8, dm_stride, dm_stride * static_cast<int64_t>(d.element_size())};
  return {w, d, m, weights,
          {xq.data(), dx.data(), sx.data(), offset.data(), half_sx.data(), half_offset.data(), K, blocks}, M};
}

}  // namespace

int64_t quant_linear_outputs(const at::Tensor& packed) { return packed.size(0) * kBlock; }

at::Tensor quant_linear_prefetching(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                   const at::Tensor& mins, const std::optional<at::Tensor>& bias,
                                   at::ScalarType out_dtype, bool gated, const PrefetchPlan* plan,
                                   const GatedAdd& add) {
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "quant_linear: output is bfloat16 or float32");
  TORCH_CHECK(add.rows == nullptr || gated, "quant_linear: additions go to a gated product only");
  const Operands op = operands(x, packed, scales, mins);
  const int64_t column_blocks = op.weights.column_blocks;
  TORCH_CHECK(!gated || column_blocks % kCols == 0, "quant_linear: gated needs output features in multiples of ",
              kCols * kBlock);
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({op.M, (gated ? column_blocks / 2 : column_blocks) * kBlock}, x.options().dtype(out_dtype));
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  auto run = [&](auto* o) {
    if (gated) product<true>(op.rows, op.M, op.weights, bp, o, plan, add);
    else product<false>(op.rows, op.M, op.weights, bp, o, plan, add);
  };
  if (out_dtype == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quant_linear_race(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t k,
    const at::Tensor& inv_temperature, const at::Tensor& seeds) {
  const Operands op = operands(x, packed, scales, mins);
  TORCH_CHECK(k >= 1 && k <= TopK::kMax && k <= op.weights.column_blocks * kBlock,
              "quant_linear_race: k must be in [1, min(64, N)]");
  Candidates out(x, op.M, k, inv_temperature, seeds);
  product_candidates(op.rows, op.M, op.weights, out);
  return {out.values, out.indices, out.race_values, out.race_indices};
}

#else  // no AVX2

bool quant_gemm_available() { return false; }

int64_t quant_linear_outputs(const at::Tensor&) { TORCH_CHECK(false, "quant_linear: built without AVX2"); }

at::Tensor quant_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const std::optional<at::Tensor>&, at::ScalarType, bool) {
  TORCH_CHECK(false, "quant_linear: built without AVX2");
}

at::Tensor quant_linear_prefetching(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, at::ScalarType, bool, const PrefetchPlan*,
                                   const GatedAdd&) {
  TORCH_CHECK(false, "quant_linear: built without AVX2");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quant_linear_race(const at::Tensor&, const at::Tensor&,
                                                                              const at::Tensor&, const at::Tensor&,
                                                                              int64_t, const at::Tensor&,
                                                                              const at::Tensor&) {
  TORCH_CHECK(false, "quant_linear: built without AVX2");
}

#endif

}  // namespace fiberserve
