// What the kernels on int8-quantized rows share (int8_matmul.cc, block_matmul.cc): x
// quantized per row and block of 32 as models/quantized.py defines it, and the split of
// output tiles over threads.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {  // internal linkage, as in the kernels: each one is a library of its own

constexpr int64_t kBlock = 32;  // x values per scale
constexpr int64_t kTile = 16;   // output rows per packed tile
constexpr int64_t kGroupsPerBlock = kBlock / 4;
constexpr int64_t kMaxRows = 16;  // rows per pass over the weights (their float sums stay in L1)

// x quantized per row and block: p as int8 (4 per 32-bit word, as vpdpbusd broadcasts
// them), t = max|x| / 127, and each block's sum(p) and the sum of its first 16 p (a
// kernel's integer sums start at offset * sum(p), which removes the offset of unsigned
// stored values exactly; sub-blocks of 16 take the halves).
struct QuantizedX {
  std::vector<int32_t> words;  // [M, K/4]
  std::vector<float> scales;   // [M, K/32]
  std::vector<int32_t> sums;   // [M, K/32]
  std::vector<int32_t> halves;  // [M, K/32]
};

inline QuantizedX quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  QuantizedX q;
  q.words.resize(M * K / 4);
  q.scales.resize(M * blocks);
  q.sums.resize(M * blocks);
  q.halves.resize(M * blocks);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + m * K + b * kBlock;
#if defined(__AVX512F__)
      // The same values 16 lanes at a time: an exact division, rounded to nearest even.
      const __m512 lo = _mm512_loadu_ps(in), hi = _mm512_loadu_ps(in + 16);
      const float t = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) /
                      127.0f;
      const __m512 divisor = _mm512_set1_ps(t == 0.0f ? 1.0f : t);
      const __m512i p_lo = _mm512_cvtps_epi32(_mm512_div_ps(lo, divisor));
      const __m512i p_hi = _mm512_cvtps_epi32(_mm512_div_ps(hi, divisor));
      int8_t* words = reinterpret_cast<int8_t*>(q.words.data() + (m * K + b * kBlock) / 4);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtepi32_epi8(p_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(words + 16), _mm512_cvtepi32_epi8(p_hi));
      q.scales[m * blocks + b] = t;
      q.halves[m * blocks + b] = _mm512_reduce_add_epi32(p_lo);
      q.sums[m * blocks + b] = q.halves[m * blocks + b] + _mm512_reduce_add_epi32(p_hi);
#else
      float most = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) most = std::max(most, std::fabs(in[k]));
      const float t = most / 127.0f;
      const float divisor = t == 0.0f ? 1.0f : t;
      int8_t p[kBlock];
      int32_t sum = 0, half = 0;
      for (int64_t k = 0; k < kBlock; ++k) {
        p[k] = static_cast<int8_t>(std::nearbyint(in[k] / divisor));  // ties to even
        sum += p[k];
        if (k < kBlock / 2) half += p[k];
      }
      std::memcpy(q.words.data() + (m * K + b * kBlock) / 4, p, sizeof p);
      q.scales[m * blocks + b] = t;
      q.sums[m * blocks + b] = sum;
      q.halves[m * blocks + b] = half;
#endif
    }
  }
  return q;
}

// Threads take the tiles in one long run each: a run's first tiles are the ones no earlier
// tile prefetched, and two runs a thread (as few_row_matmul.cc) made the 121 products of a
// SmolLM2 step 2-5% slower at 2-8 rows, the same at one (GGUF blocks; int8 1-3%; a 2-core
// Zen 4, `benchmarks/bench_kernel_variants.py`, BENCHMARKS.md, session 52).
inline int64_t tiles_per_run(int64_t tiles, int64_t threads) {
  const int64_t runs = std::max<int64_t>(threads, 1);
  return std::max<int64_t>(1, (tiles + runs - 1) / runs);
}

}  // namespace
