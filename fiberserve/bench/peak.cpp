// Peak rates of the CPU's dot-product instructions, on every core at once: the ceiling a matrix product can
// reach here.  Each thread runs 12 independent accumulator chains (enough to hide the latency), so the loop is
// bound by issue throughput alone; the accumulators stay in registers (checked in the disassembly).
//
//   fp32  vfmadd231ps zmm:  16 lanes x 1 multiply-add   =  32 FLOP per instruction (ymm on AVX2 CPUs: 16)
//   bf16  vdpbf16ps   zmm:  16 lanes x 2 multiply-adds  =  64 FLOP
//   int8  vpdpbusd    zmm:  16 lanes x 4 multiply-adds  = 128 integer ops
//   amx_bf16  tdpbf16ps:  16 x 16 outputs x 32 multiply-adds = 16384 FLOP (AMX tiles; 6 accumulator tiles)
//
// And the rate llama.cpp's block arithmetic allows (Q4_1 weights x Q8_1 activations, as linear_quant.cpp runs it):
//
//   q4_1  per 32 inputs of a 16-output accumulator: 8 vpdpbusd, then the block's scaling: convert the int32
//         sums, multiply the weight scale by the activation scale, and two multiply-adds.  Counted as the
//         vpdpbusd's 128 ops each, so q4_1 / int8 is the share of the int8 peak the arithmetic leaves.
//
// Returns operations per second for all threads together, or 0 where the compiler does not target the
// instruction.
//
// And the memory's read bandwidth: every thread sums its share of one buffer far larger than the last-level cache
// (each pass a barrier apart, so all threads read at once), the best of several passes: the rate at which a
// memory-bound product can stream its weights.  Plain C++ with a C entry point, loaded by peak.py through ctypes: no PyTorch headers (they made
// its build ~40 s; this one takes ~2 s), so `fiberserve bench` needs no PyTorch at all.

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int kChains = 12;

template <typename Vec, typename Step>
double chains_per_second(Step step, Vec init, int64_t iterations) {
  Vec acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = init;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile char sink = 0;  // keep the results alive
  for (int i = 0; i < kChains; ++i) sink = sink + reinterpret_cast<const char*>(&acc[i])[0];
  return iterations * kChains / seconds;
}

#if defined(__AVX512VNNI__)
// kChains accumulators (6 rows x 2 column blocks, like linear_quant.cpp's tile), one block of 32 inputs per
// iteration.  The scales are loaded from memory every block, as the kernel does, so nothing is hoisted.
double q4_1_ops_per_second(int64_t iterations) {
  alignas(64) float weight_scale[2][16], weight_min[2][16], row_scale[6], row_sum[6];
  for (int c = 0; c < 2; ++c)
    for (int l = 0; l < 16; ++l) weight_scale[c][l] = 1e-3f, weight_min[c][l] = -1e-3f;
  for (int r = 0; r < 6; ++r) row_scale[r] = 0.5f, row_sum[r] = 0.25f;
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1);
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_setzero_ps();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iterations; ++n) {
    asm volatile("" : "+v"(w), "+v"(x) : : "memory");  // new weights and activations, scales loaded again
    __m512i sums[kChains];
    for (int i = 0; i < kChains; ++i) sums[i] = _mm512_set1_epi32(i);  // distinct, or the compiler merges them
#pragma GCC unroll 8
    for (int step = 0; step < 8; ++step) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) sums[i] = _mm512_dpbusd_epi32(sums[i], w, x);
    }
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) {
      const int r = i / 2, c = i % 2;
      const __m512 d = _mm512_load_ps(weight_scale[c]), m = _mm512_load_ps(weight_min[c]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(row_sum[r]), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(d, _mm512_set1_ps(row_scale[r])), acc[i]);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float total = 0;  // keep the results alive, and in registers while the loop runs
  for (int i = 0; i < kChains; ++i) total += _mm512_reduce_add_ps(acc[i]);
  volatile float sink = total;
  (void)sink;
  return iterations * kChains * 8 * 128.0 / seconds;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// tdpbf16ps into 6 accumulator tiles (enough to cover its latency), from one A and one B tile loaded once.  0 where
// Linux does not grant the tile registers.  An instruction takes ~16 cycles, so iterations / 16 of them.
double amx_bf16_flop_per_second(int64_t iterations) {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return 0.0;
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  };
  static const Config config = [] {  // a constant: GCC's ldtilecfg reads memory the compiler may not have written
    Config c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.bytes_per_row[t] = 64, c.rows[t] = 16;
    return c;
  }();
  alignas(64) static const uint16_t ones[16 * 32] = {};
  _tile_loadconfig(&config);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  const int64_t steps = iterations / 16;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < steps; ++n) {
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
  }
  alignas(64) float sink[16 * 16];
  _tile_stored(0, sink, 64);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  _tile_release();
  volatile float keep = sink[0];
  (void)keep;
  return steps * 6 * 16384.0 / seconds;
}
#endif

double instruction_rate(const std::string& kind, int64_t iterations) {
#if defined(__AVX512F__)
  if (kind == "fp32") {
    const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(1e-7f);
    return chains_per_second([&](__m512 x) { return _mm512_fmadd_ps(x, a, b); }, a, iterations) * 32;
  }
#elif defined(__FMA__)
  if (kind == "fp32") {  // AVX2 CPUs: 8 lanes
    const __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(1e-7f);
    return chains_per_second([&](__m256 x) { return _mm256_fmadd_ps(x, a, b); }, a, iterations) * 16;
  }
#endif
#if defined(__AVX512BF16__)
  if (kind == "bf16") {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
    return chains_per_second([&](__m512 x) { return _mm512_dpbf16_ps(x, a, a); }, _mm512_setzero_ps(), iterations) * 64;
  }
#endif
#if defined(__AVX512VNNI__)
  if (kind == "int8") {
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(1);
    return chains_per_second([&](__m512i x) { return _mm512_dpbusd_epi32(x, a, b); }, _mm512_setzero_si512(),
                             iterations) * 128;
  }
  if (kind == "q4_1") return q4_1_ops_per_second(iterations / 8);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (kind == "amx_bf16") return amx_bf16_flop_per_second(iterations);
#endif
  return 0.0;
}

// Operations per second of ``kind`` ("fp32", "bf16", "int8", "q4_1", "amx_bf16") with ``threads`` threads running at once.
double peak_ops_per_second(const std::string& kind, int64_t threads, int64_t iterations) {
  std::vector<double> rates(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { rates[static_cast<size_t>(t)] = instruction_rate(kind, iterations); });
  for (auto& thread : pool) thread.join();
  double total = 0;
  for (double r : rates) total += r;
  return total;
}

// Sums 64-bit words of [begin, end) in eight independent chains (the loads, not the adds, bound the loop).
uint64_t sum_words(const uint64_t* begin, const uint64_t* end) {
  uint64_t acc[8] = {};
  for (const uint64_t* p = begin; p + 8 <= end; p += 8)
    for (int i = 0; i < 8; ++i) acc[i] += p[i];
  uint64_t total = 0;
  for (uint64_t a : acc) total += a;
  return total;
}

// Bytes per second that ``threads`` threads read from a ``bytes`` buffer together: the best of ``passes`` passes.
double read_bytes_per_second(int64_t threads, int64_t bytes, int passes) {
  const size_t words = static_cast<size_t>(bytes) / sizeof(uint64_t);
  std::vector<uint64_t> buffer(words);
  std::memset(buffer.data(), 1, words * sizeof(uint64_t));  // touched: every page is backed before timing
  std::vector<uint64_t> sinks(static_cast<size_t>(threads));
  std::barrier sync(threads + 1);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const uint64_t* first = buffer.data() + words * t / threads;
      const uint64_t* last = buffer.data() + words * (t + 1) / threads;
      for (int pass = 0; pass < passes; ++pass) {
        sync.arrive_and_wait();
        sinks[static_cast<size_t>(t)] += sum_words(first, last);
        sync.arrive_and_wait();
      }
    });
  double best = 0;
  for (int pass = 0; pass < passes; ++pass) {
    sync.arrive_and_wait();
    const auto start = std::chrono::steady_clock::now();
    sync.arrive_and_wait();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(words * sizeof(uint64_t)) / seconds);
  }
  for (auto& thread : pool) thread.join();
  volatile uint64_t keep = 0;
  for (uint64_t s : sinks) keep = keep + s;
  return best;
}

}  // namespace

extern "C" double fiberserve_peak_read_bytes_per_second(int64_t threads, int64_t bytes, int64_t passes) {
  return read_bytes_per_second(threads, bytes, static_cast<int>(passes));
}

extern "C" double fiberserve_peak_ops_per_second(const char* kind, int64_t threads, int64_t iterations) {
  return peak_ops_per_second(kind, threads, iterations);
}
