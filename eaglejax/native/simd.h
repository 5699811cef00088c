// float32 vectors of one register for the native kernels (GCC/Clang vector extensions),
// with unaligned loads and stores and a fixed-order lane sum.

#pragma once

#include <cstring>

namespace {  // internal linkage, as in the kernels: each one is a library of its own

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one zmm register
#else
constexpr int kLanes = 8;   // one ymm register (AVX2) or two xmm registers
#endif

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// Pairwise: halves added until one lane is left (a fixed order).
inline float lane_sum(Vec v) {
#if defined(__AVX512F__)
  auto h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  auto h8 = v;
#endif
  auto h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  auto h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  return h2[0] + h2[1];
}

}  // namespace
