// float32 vectors of one register for the native kernels (GCC/Clang vector extensions),
// with unaligned loads and stores, a fixed-order lane sum and e^x for x <= 0.

#pragma once

#include <cstdint>
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

inline Vec load_broadcast(float x) { return Vec{} + x; }

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

// e^x lane by lane for x <= 0 (softmax weights), exactly 0 below -87 (and for -inf):
// x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error
// about 2e-7), times 2^n built in the exponent bits.
inline Vec exp_nonpositive(Vec x) {
  const Vec zero = {};
  const auto underflow = x < (zero - 87.0f);
  x = underflow ? zero : x;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (x * 1.44269504088896341f + kRound) - kRound;
  const Vec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  Vec p = zero + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  typedef int32_t Int __attribute__((vector_size(kLanes * sizeof(int32_t))));
  const Int bits = (__builtin_convertvector(n, Int) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const Vec e = p * scale;
  return underflow ? zero : e;
}

}  // namespace
