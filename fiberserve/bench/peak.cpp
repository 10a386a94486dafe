// Peak rates of the CPU's dot-product instructions, on every core at once: the ceiling a matrix product can
// reach here.  Each thread runs 12 independent accumulator chains (enough to hide the latency), so the loop is
// bound by issue throughput alone; the accumulators stay in registers (checked in the disassembly).
//
//   fp32  vfmadd231ps zmm:  16 lanes x 1 multiply-add   =  32 FLOP per instruction
//   bf16  vdpbf16ps   zmm:  16 lanes x 2 multiply-adds  =  64 FLOP
//   int8  vpdpbusd    zmm:  16 lanes x 4 multiply-adds  = 128 integer ops
//
// Returns operations per second for all threads together, or 0 where the compiler does not target the
// instruction.

#include <torch/extension.h>

#include <chrono>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
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

double instruction_rate(const std::string& kind, int64_t iterations) {
#if defined(__AVX512F__)
  if (kind == "fp32") {
    const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(1e-7f);
    return chains_per_second([&](__m512 x) { return _mm512_fmadd_ps(x, a, b); }, a, iterations) * 32;
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
#endif
  return 0.0;
}

// Operations per second of ``kind`` ("fp32", "bf16", "int8") with ``threads`` threads running at once.
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("peak_ops_per_second", &peak_ops_per_second, "operations/s of one dot-product instruction on all threads");
}
