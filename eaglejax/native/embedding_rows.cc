// Rows of a bfloat16 embedding table widened to float32: y[n, :] = table[tokens[n], :].
//
// XLA:CPU gathers 16-bit floats through a float32 copy of the whole table, which it hoists
// out of a decoding loop as invariant: one 113 MB copy per program call for SmolLM2. This
// reads only the rows asked for. Token ids outside the table are clamped to it, as XLA's
// gather clamps its start indices.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error embedding_rows(ffi::Buffer<ffi::BF16> table, ffi::Buffer<ffi::S32> tokens,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto td = table.dimensions();
  if (td.size() != 2) {
    return ffi::Error::InvalidArgument("embedding_rows: expected a table [V,H]");
  }
  const int64_t vocab = td[0], hidden = td[1], count = tokens.element_count();
  const auto* rows = reinterpret_cast<const uint16_t*>(table.untyped_data());
  const int32_t* ids = tokens.typed_data();
  float* out = y->typed_data();
  for (int64_t n = 0; n < count; ++n) {
    const int64_t id = std::clamp<int64_t>(ids[n], 0, vocab - 1);
    const uint16_t* row = rows + id * hidden;
    float* dst = out + n * hidden;
    for (int64_t h = 0; h < hidden; ++h) {
      const uint32_t bits = static_cast<uint32_t>(row[h]) << 16;  // bfloat16: float32's top half
      std::memcpy(dst + h, &bits, sizeof(float));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxEmbeddingRowsBf16, embedding_rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
