// bf16 matrix product for linear layers: out[M, N] = x[M, K] . W[N, K]^T (+ bias), float32 accumulation with
// AVX512-BF16 dot products (vdpbf16ps), W prepacked once as [N / 16][K / 2][16][2] so one 64-byte load holds
// two k steps of 16 output features.
//
// Batch invariance: every output is accumulated over k-pairs in order, in its own register lane; the rows
// around it change which tile it is computed in, never its arithmetic.  So a row gets the same bits alone, in
// any batch and at any row count (no one-row special path, unlike oneDNN's matrix-vector kernel).
//
// Speed (2 cores, SmolLM2-135M's 120 decoder products per step, bf16): see fiberserve/model/linear.py.
// The row tiles: AMX's (amx/linear_bf16.h, tdpbf16ps on 16-row tiles) where the CPU has them and Linux grants them,
// else AVX512-BF16's (avx512/linear_bf16.h), or AVX2's (avx2/linear_bf16.h, vdpbf16ps's arithmetic by
// multiply-adds); the rest of the file serves all three.  bf16_gemm_available() says whether any was compiled,
// bf16_amx() whether AMX runs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd/prefetch.h"
#include "row_tiles.h"
#include "race.h"
#include "simd/vec16.h"

#if defined(__AVX512BF16__)
#define FIBERSERVE_BF16_TILES 512
#include "avx512/linear_bf16.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define FIBERSERVE_BF16_TILES 256
#include "avx2/linear_bf16.h"
#endif

namespace fiberserve {

#if defined(FIBERSERVE_BF16_TILES)
namespace {

// All rows against NR blocks, a row tile at a time.
template <int NR, bool kGated, typename out_t>
void column_group(const Row* x, int64_t rows, int64_t ldx, const uint16_t* w, int64_t pairs,
                  int64_t block_stride, const float* bias, out_t* out, int64_t ldo, PrefetchCursor& prefetch,
                  const GatedAdd& add = {}) {
  for_each_row_tile<kRows, kBalancedTiles>(
      0, rows,
      [&](auto height, int64_t r) {
        tile<decltype(height)::value, NR, kGated, out_t>(x + r * ldx, ldx, w, pairs, block_stride, bias, out + r * ldo, ldo,
                                                         add.at(r, 0));
      },
      [&] { prefetch.step(); });
}

// Rows [0, rows) against `count` blocks: column groups of up to kCols blocks (gated: whole groups, each writing
// kCols / 2 blocks).
template <bool kGated, typename out_t>
void blocks_of(const Row* x, int64_t rows, int64_t ldx, const uint16_t* w, int64_t K, int64_t count,
               const float* bias, out_t* out, int64_t ldo, PrefetchCursor& prefetch, const GatedAdd& add) {
  const int64_t block_stride = K * kBlock;
  for (int64_t first = 0; first < count; first += kCols) {
    const uint16_t* wg = w + first * block_stride;
    const float* bg = bias ? bias + first * kBlock : nullptr;
    out_t* o = out + (kGated ? first / 2 : first) * kBlock;
    if constexpr (kGated) {
      column_group<kCols, true>(x, rows, ldx, wg, K / 2, block_stride, bg, o, ldo, prefetch, add.at(0, first / 2 * kBlock));
      continue;
    }
    switch (std::min<int64_t>(kCols, count - first)) {
      case 4: column_group<4, false>(x, rows, ldx, wg, K / 2, block_stride, bg, o, ldo, prefetch); break;
      case 3: column_group<3, false>(x, rows, ldx, wg, K / 2, block_stride, bg, o, ldo, prefetch); break;
      case 2: column_group<2, false>(x, rows, ldx, wg, K / 2, block_stride, bg, o, ldo, prefetch); break;
      default: column_group<1, false>(x, rows, ldx, wg, K / 2, block_stride, bg, o, ldo, prefetch); break;
    }
  }
}

// A product's row tiles: the vdpbf16ps (or AVX2) tiles above, kRows rows each, or AMX's (amx/linear_bf16.h), 16
// rows each.  Scope: what a thread's share of a product holds while it runs (AMX: the tile configuration).
struct VectorTiles {
  static constexpr int64_t kHeight = kRows;
  struct Scope {};
  template <bool kGated, typename out_t>
  static void blocks(const Row* x, int64_t rows, int64_t ldx, const uint16_t* w, int64_t K, int64_t count,
                     const float* bias, out_t* out, int64_t ldo, PrefetchCursor& prefetch, const GatedAdd& add = {}) {
    blocks_of<kGated>(x, rows, ldx, w, K, count, bias, out, ldo, prefetch, add);
  }
};

#if defined(FIBERSERVE_AMX)
struct AmxTiles {
  static constexpr int64_t kHeight = amx::kRows;
  struct Scope {
    Scope() { amx::amx_configure(); }
    ~Scope() { amx::amx_release(); }
  };
  template <bool kGated, typename out_t>
  static void blocks(const Row* x, int64_t rows, int64_t ldx, const uint16_t* w, int64_t K, int64_t count,
                     const float* bias, out_t* out, int64_t ldo, PrefetchCursor& prefetch, const GatedAdd& add = {}) {
    amx_blocks_of<kGated>(x, rows, ldx, w, K, count, bias, out, ldo, prefetch, add);
  }
};
#endif

// The work is split evenly between the threads, so that no thread waits for another's extra column group (9
// groups of 64 outputs for the 576-wide products, 15 for the 960-wide qkv: split by whole groups, one thread
// would have 5 to the other's 4).  One row tile: the column blocks are split (memory
// bound, so a narrower group at the edge costs nothing).  More rows: the (column group, row tile) pairs, in
// group order, are split, so a thread may take part of a group's row tiles.  A row's arithmetic does not depend
// on its tile, so the split changes no bits.
template <typename Tiles, bool kGated, typename out_t>
void product(const Row* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t blocks, const float* bp,
             out_t* op, const PrefetchPlan* plan, const GatedAdd& add = {}) {
  constexpr int64_t H = Tiles::kHeight;
  const int64_t N = (kGated ? blocks / 2 : blocks) * kBlock, block_stride = K * kBlock;
  const int64_t row_tiles = (M + H - 1) / H, groups = (blocks + kCols - 1) / kCols;
  const int64_t unit = kGated ? kCols : 1;  // blocks per unit of the one-row-tile split (gated: whole groups)
  if (row_tiles == 1) {
    at::parallel_for(0, blocks / unit, 1, [&](int64_t begin, int64_t end) {
      typename Tiles::Scope scope;
      PrefetchCursor none;  // one row tile: a decode step of a few sequences, whose keys are few
      begin *= unit, end *= unit;
      Tiles::template blocks<kGated>(xp, M, K, wp + begin * block_stride, K, end - begin,
                                     bp ? bp + begin * kBlock : nullptr, op + (begin / (kGated ? 2 : 1)) * kBlock, N,
                                     none, add.at(0, begin / 2 * kBlock));
    });
    return;
  }
  at::parallel_for(0, groups * row_tiles, 1, [&](int64_t begin, int64_t end) {
    typename Tiles::Scope scope;
    PrefetchCursor prefetch = PrefetchCursor::thread_share(plan, end - begin);
    for (int64_t unit = begin; unit < end;) {
      const int64_t g = unit / row_tiles, tile0 = unit % row_tiles;
      const int64_t tile1 = std::min(row_tiles, tile0 + (end - unit));
      const int64_t r0 = tile0 * H, r1 = std::min(M, tile1 * H), first = g * kCols;
      Tiles::template blocks<kGated>(xp + r0 * K, r1 - r0, K, wp + first * block_stride, K,
                                     std::min<int64_t>(kCols, blocks - first), bp ? bp + first * kBlock : nullptr,
                                     op + r0 * N + (kGated ? first / 2 : first) * kBlock, N, prefetch,
                                     add.at(r0, first / 2 * kBlock));
      unit += tile1 - tile0;
    }
  });
}

// The product's k largest outputs per row, as top_k_rows of the float32 product would find them, and a sampled
// row's race (RowCandidates), without writing the product (see quant_linear_race): the same (column group, row
// tile) units as product(), each computed into a thread's scratch of [rows, 64] and offered to the rows' lists.
// For a row, one thread's units all lie below the next thread's in column order, so merging the lists in thread
// order keeps ties in index order.
template <typename Tiles>
void product_candidates(const Row* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t blocks, Candidates& out) {
  constexpr int64_t H = Tiles::kHeight;
  const int64_t block_stride = K * kBlock, row_tiles = (M + H - 1) / H, groups = (blocks + kCols - 1) / kCols;
  const int64_t threads = at::get_num_threads();
  std::vector<RowCandidates> lists = out.lists(threads, M);
  at::parallel_for(0, groups * row_tiles, 1, [&](int64_t begin, int64_t end) {
    typename Tiles::Scope scope;
    RowCandidates* mine = lists.data() + at::get_thread_num() * M;
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(M * kCols * kBlock)) scratch.resize(static_cast<size_t>(M * kCols * kBlock));
    PrefetchCursor none;
    for (int64_t unit = begin; unit < end;) {
      const int64_t g = unit / row_tiles, tile0 = unit % row_tiles;
      const int64_t tile1 = std::min(row_tiles, tile0 + (end - unit));
      const int64_t r0 = tile0 * H, r1 = std::min(M, tile1 * H), first = g * kCols;
      const int64_t count = std::min<int64_t>(kCols, blocks - first);
      Tiles::template blocks<false>(xp + r0 * K, r1 - r0, K, wp + first * block_stride, K, count, nullptr,
                                    scratch.data(), kCols * kBlock, none);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < count; ++c)
          mine[r].offer16(load16(scratch.data() + (r - r0) * kCols * kBlock + c * kBlock), (first + c) * kBlock);
      unit += tile1 - tile0;
    }
  });
  out.merge(lists, M);
}

// Whether a product over K runs on AMX tiles: built with them, granted by the OS, and K in whole tile steps (32).  The answer is the same for every row count, as batch invariance needs.
bool runs_on_amx(int64_t K) {
#if defined(FIBERSERVE_AMX)
  return K % (2 * amx::kPairs) == 0 && amx::amx_ready();
#else
  (void)K;
  return false;
#endif
}

// x's rows for AMX tiles: zero rows added up to a whole tile.
at::Tensor padded_rows(const at::Tensor& rows) {
#if defined(FIBERSERVE_AMX)
  const int64_t tail = rows.size(0) % amx::kRows;
  if (tail) return at::cat({rows, rows.new_zeros({amx::kRows - tail, rows.size(1)})});
#endif
  return rows;
}

// f(Tiles{}) with the tiles a product over K runs on.
template <typename F>
void with_tiles(int64_t K, const F& f) {
#if defined(FIBERSERVE_AMX)
  if (runs_on_amx(K)) return f(AmxTiles{});
#endif
  f(VectorTiles{});
}

}  // namespace

bool bf16_gemm_available() { return true; }

bool bf16_amx() { return runs_on_amx(32); }

at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack: weight must be bf16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kBlock == 0 && K % 2 == 0, "bf16_pack: N must be a multiple of 16 and K even");
  return weight.contiguous().view({N / kBlock, kBlock, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype, bool gated) {
  return bf16_linear_prefetching(x, packed, bias, out_dtype, gated, nullptr);
}

at::Tensor bf16_linear_prefetching(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                   at::ScalarType out_dtype, bool gated, const PrefetchPlan* plan,
                                   const GatedAdd& add) {
  TORCH_CHECK(add.rows == nullptr || gated, "bf16_linear: additions go to a gated product only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear: x must be bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1), "bf16_linear: weight not packed for this K");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "bf16_linear: output is bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(!gated || blocks % kCols == 0, "bf16_linear: gated needs output features in multiples of ",
              kCols * kBlock);
  const bool amx = runs_on_amx(K);
  const at::Tensor rows = amx ? padded_rows(tile_rows(x)) : tile_rows(x);
  at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, (gated ? blocks / 2 : blocks) * kBlock}, x.options().dtype(out_dtype));
  const Row* xp = row_data(rows);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  with_tiles(K, [&](auto tiles) {
    using Tiles = decltype(tiles);
    auto run = [&](auto* op) {
      if (gated) product<Tiles, true>(xp, M, K, wp, blocks, bp, op, plan, add);
      else product<Tiles, false>(xp, M, K, wp, blocks, bp, op, plan);
    };
    if (out_dtype == at::kFloat) run(out.data_ptr<float>());
    else run(out.data_ptr<c10::BFloat16>());
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bf16_linear_race(const at::Tensor& x,
                                                                             const at::Tensor& packed, int64_t k,
                                                                             const at::Tensor& inv_temperature,
                                                                             const at::Tensor& seeds) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear_race: x must be bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1), "bf16_linear_race: weight not packed for this K");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(k >= 1 && k <= TopK::kMax && k <= blocks * kBlock, "bf16_linear_race: k must be in [1, min(64, N)]");
  const at::Tensor rows = runs_on_amx(K) ? padded_rows(tile_rows(x)) : tile_rows(x);
  Candidates out(x, M, k, inv_temperature, seeds);
  with_tiles(K, [&](auto tiles) {
    product_candidates<decltype(tiles)>(row_data(rows), M, K,
                                        reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), blocks, out);
  });
  return {out.values, out.indices, out.race_values, out.race_indices};
}

#else

bool bf16_gemm_available() { return false; }

bool bf16_amx() { return false; }

at::Tensor bf16_pack(const at::Tensor&) { TORCH_CHECK(false, "bf16_pack: built without AVX2 or AVX512-BF16"); }

at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::ScalarType, bool) {
  TORCH_CHECK(false, "bf16_linear: built without AVX2 or AVX512-BF16");
}

at::Tensor bf16_linear_prefetching(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   at::ScalarType, bool, const PrefetchPlan*, const GatedAdd&) {
  TORCH_CHECK(false, "bf16_linear: built without AVX2 or AVX512-BF16");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bf16_linear_race(const at::Tensor&, const at::Tensor&,
                                                                             int64_t, const at::Tensor&,
                                                                             const at::Tensor&) {
  TORCH_CHECK(false, "bf16_linear: built without AVX2 or AVX512-BF16");
}

#endif

// packed: [blocks, K / 2, block, 2].
int64_t bf16_linear_outputs(const at::Tensor& packed) { return packed.size(0) * packed.size(2); }

}  // namespace fiberserve
