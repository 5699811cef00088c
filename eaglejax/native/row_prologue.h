// What a row kernel multiplies: x itself, x RMS-normed and scaled, or silu(gate) * up
// (a decoder layer's operations before its products, done in the kernel's call).

#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {  // internal linkage, as in the kernels: each one is a library of its own

enum Prologue : int32_t { kPlain = 0, kRmsNorm = 1, kSiluGate = 2 };

// The rows [M,K] the product multiplies, from x [M,K] (x [M,2K] for kSiluGate): x itself;
// x * rsqrt(mean(x^2) + eps) * scale (squares summed in a fixed order); or silu(gate) * up.
const float* prologue_rows(Prologue prologue, const float* x, int64_t M, int64_t K,
                           const float* scale, float eps, std::vector<float>& rows) {
  if (prologue == kPlain) return x;
  rows.resize(M * K);
  const Vec zero = {};
  for (int64_t m = 0; m < M; ++m) {
    float* out = rows.data() + m * K;
    if (prologue == kRmsNorm) {
      const float* in = x + m * K;
      Vec squares = {};
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes) squares += load(in + k) * load(in + k);
      float sum = lane_sum(squares);
      for (int64_t j = k; j < K; ++j) sum += in[j] * in[j];
      const float r = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
      for (k = 0; k + kLanes <= K; k += kLanes) store(out + k, load(in + k) * r * load(scale + k));
      for (int64_t j = k; j < K; ++j) out[j] = in[j] * r * scale[j];
    } else {
      const float* gate = x + m * 2 * K;
      const float* up = gate + K;
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes) {  // sigmoid(g) from e^-|g| (never overflows)
        const Vec g = load(gate + k);
        const Vec e = exp_nonpositive(g < zero ? g : zero - g);
        const Vec sigmoid = (g < zero ? e : zero + 1.0f) / (e + 1.0f);
        store(out + k, g * sigmoid * load(up + k));
      }
      for (int64_t j = k; j < K; ++j) {
        out[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
      }
    }
  }
  return rows.data();
}

// out[i] += residual[i] for i < count (a product's residual connection).
inline void add_residual(float* out, const float* residual, int64_t count) {
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) store(out + i, load(residual + i) + load(out + i));
  for (; i < count; ++i) out[i] += residual[i];
}

}  // namespace
