// The lookup branch's search (eaglejax/decoding/lookup.py, `continuation`) in one pass per
// row: XLA:CPU ran it as 8 shifted copies of the searched context, each compared whole
// (~0.1 ms a round over an 8-reply history, a fiftieth of a decode step).
//
// context [B,W] int32 (separators: -1), last [B] int32 -> tokens [B,T] int32, found [B]:
// per row, the position i < last followed by a token (not a separator) whose tokens ending
// there equal those ending at `last` longest (up to kMaxMatch; separators match nothing),
// the latest among equally long ones (the latest position when none matches at all); found
// is that length. The tokens are those after i, repeating with period last - i, taken
// through index last, and from a separator on the token at last.

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kSeparator = -1;
constexpr int64_t kMaxMatch = 8;  // lookup.MAX_MATCH

void continue_row(const int32_t* x, int64_t width, int64_t last, int64_t count,
                  int32_t* tokens, int32_t* found) {
  last = std::clamp<int64_t>(last, 0, width - 1);
  // The suffix ending at `last`, up to the first separator (which matches nothing).
  int64_t reach = 0;
  while (reach < kMaxMatch && reach <= last && x[last - reach] != kSeparator) ++reach;
  int64_t start = 0, best = -1;
  for (int64_t i = 0; i < last; ++i) {
    if (x[i + 1] == kSeparator) continue;  // a match right before a separator is none
    int64_t n = 0;
    while (n < reach && n <= i && x[i - n] == x[last - n]) ++n;
    if (n >= best) best = n, start = i;  // the latest of the longest
  }
  *found = static_cast<int32_t>(std::max<int64_t>(best, 0));
  const int64_t period = std::max<int64_t>(last - start, 1);
  bool ended = false;
  for (int64_t t = 0; t < count; ++t) {
    const int32_t token = x[std::min(start + 1 + t % period, last)];
    ended = ended || token == kSeparator;
    tokens[t] = ended ? x[last] : token;
  }
}

ffi::Error continuation(ffi::Buffer<ffi::S32> context, ffi::Buffer<ffi::S32> last,
                        ffi::ResultBuffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::S32> found) {
  const auto cd = context.dimensions();
  const auto td = tokens->dimensions();
  if (cd.size() != 2 || td.size() != 2 || td[0] != cd[0] || last.element_count() != cd[0]
      || found->element_count() != cd[0] || cd[1] == 0) {
    return ffi::Error::InvalidArgument(
        "lookup_match: expected context [B,W] (W > 0), last [B], tokens [B,T], found [B]");
  }
  for (int64_t b = 0; b < cd[0]; ++b) {
    continue_row(context.typed_data() + b * cd[1], cd[1], last.typed_data()[b], td[1],
                 tokens->typed_data() + b * td[1], found->typed_data() + b);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxLookupContinuation, continuation,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
