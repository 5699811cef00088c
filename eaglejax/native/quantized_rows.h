// What the kernels on int8-quantized rows share (int8_matmul.cc, block_matmul.cc): x
// quantized per row and block of 32 as models/quantized.py defines it, and the split of
// output tiles over threads.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {  // internal linkage, as in the kernels: each one is a library of its own

constexpr int64_t kBlock = 32;  // x values per scale
constexpr int64_t kTile = 16;   // output rows per packed tile
constexpr int64_t kGroupsPerBlock = kBlock / 4;
constexpr int64_t kMaxRows = 16;  // rows per pass over the weights (their float sums stay in L1)

// x quantized per row and block: p as int8 (4 per 32-bit word, as vpdpbusd broadcasts
// them), t = max|x| / 127, and each block's sum(p) (a kernel's integer sums start at
// offset * sum(p), which removes the offset of unsigned stored values exactly).
struct QuantizedX {
  std::vector<int32_t> words;  // [M, K/4]
  std::vector<float> scales;   // [M, K/32]
  std::vector<int32_t> sums;   // [M, K/32]
};

inline QuantizedX quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  QuantizedX q;
  q.words.resize(M * K / 4);
  q.scales.resize(M * blocks);
  q.sums.resize(M * blocks);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + m * K + b * kBlock;
      float most = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) most = std::max(most, std::fabs(in[k]));
      const float t = most / 127.0f;
      const float divisor = t == 0.0f ? 1.0f : t;
      int8_t p[kBlock];
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock; ++k) {
        p[k] = static_cast<int8_t>(std::nearbyint(in[k] / divisor));  // ties to even
        sum += p[k];
      }
      std::memcpy(q.words.data() + (m * K + b * kBlock) / 4, p, sizeof p);
      q.scales[m * blocks + b] = t;
      q.sums[m * blocks + b] = sum;
    }
  }
  return q;
}

// Threads take the tiles in two long runs each (as few_row_matmul.cc: warm streams).
inline int64_t tiles_per_run(int64_t tiles, int64_t threads) {
  const int64_t runs = 2 * std::max<int64_t>(threads, 1);
  return std::max<int64_t>(1, (tiles + runs - 1) / runs);
}

}  // namespace
