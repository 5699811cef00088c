// The index of each row's maximum over the last axis, in one pass over the row: greedy
// verification takes the target's argmax of every verified node over the whole vocabulary,
// which XLA:CPU computes as three operations (a max, a select and a min over indices).
//
// x [R,V] float32 -> out [R] int32: the first index of the maximum, or of the first NaN where
// the row has one (jnp.argmax's answer); 0 for an empty row.

#include <cstdint>
#include <cstring>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

int32_t first_nan(const float* x, int64_t V) {
  for (int64_t k = 0; k < V; ++k) {
    if (x[k] != x[k]) return static_cast<int32_t>(k);
  }
  return -1;
}

int32_t row_argmax(const float* x, int64_t V) {
  if (V == 0) return 0;
  Vec top = load_broadcast(x[0]);
  Vec unordered = {};  // lanes that met a NaN: x != x
  int64_t k = 0;
  for (; k + kLanes <= V; k += kLanes) {
    const Vec v = load(x + k);
    top = v > top ? v : top;
    unordered += v != v ? load_broadcast(1.0f) : Vec{};
  }
  float best = x[0];
  for (int i = 0; i < kLanes; ++i) best = top[i] > best ? top[i] : best;
  bool nan = lane_sum(unordered) > 0.0f;
  for (int64_t j = k; j < V; ++j) {
    nan = nan || x[j] != x[j];
    best = x[j] > best ? x[j] : best;
  }
  if (nan) return first_nan(x, V);
  for (int64_t j = 0; j < V; ++j) {
    if (x[j] == best) return static_cast<int32_t>(j);
  }
  return 0;
}

ffi::Error argmax_rows(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || out->element_count() != xd[0]) {
    return ffi::Error::InvalidArgument("row_argmax: expected x [R,V] and out [R]");
  }
  for (int64_t r = 0; r < xd[0]; ++r) {
    out->typed_data()[r] = row_argmax(x.typed_data() + r * xd[1], xd[1]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxRowArgmax, argmax_rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
