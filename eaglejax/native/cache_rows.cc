// Writes chosen new K/V rows of every layer into the cache slots after each row's valid
// prefix, in place, in one call: a speculative round commits its accepted path this way.
//
// XLA would run one gather and one scatter per buffer (60 of each for a 30-layer model, a few
// microseconds of launch each, for a few kilobytes moved). Here: picks [B,P] int32 (which new
// row goes to slot lengths[b] + p), lengths [B] int32, then the 2L cache buffers
// [B',H,S,D] (B' >= B: rows past B are left alone), then the 2L new-row blocks [B,N,H,D] of
// the same dtype; the results are the cache buffers (aliased to the inputs). Slots past the
// capacity are dropped, as the scatter's mode="drop" drops them; picks outside [0, N) write
// nothing.
//
// The paged entry takes block tables [B,W] int32 after lengths and pools [blocks,H,BS,D] for
// buffers: slot s of row b is row s % BS of block tables[b, s / BS]; slots past W * BS or
// through a table entry outside [0, blocks) are dropped. The contiguous cache is the case
// W = 1, BS = S, block b.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// cache_rows, into caches or (tables) pools.
ffi::Error write_rows(ffi::Buffer<ffi::S32>& picks, ffi::Buffer<ffi::S32>& lengths,
                      const ffi::Buffer<ffi::S32>* tables, ffi::RemainingArgs& args,
                      ffi::RemainingRets& rets) {
  const size_t buffers = rets.size();
  const auto pd = picks.dimensions();
  if (args.size() != 2 * buffers || pd.size() != 2 || lengths.element_count() != pd[0] ||
      (tables && (tables->dimensions().size() != 2 || tables->dimensions()[0] != pd[0]))) {
    return ffi::Error::InvalidArgument(
        "cache_rows: expected picks [B,P], lengths [B], (paged) tables [B,W], n cache "
        "buffers, n new-row blocks and n results");
  }
  const int64_t B = pd[0], P = pd[1], W = tables ? tables->dimensions()[1] : 1;
  for (size_t i = 0; i < buffers; ++i) {
    auto cache = args.get<ffi::AnyBuffer>(i);
    auto fresh = args.get<ffi::AnyBuffer>(buffers + i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!cache.has_value() || !fresh.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("cache_rows: every operand must be an array");
    }
    const auto cd = cache->dimensions(), nd = fresh->dimensions();
    if (cd.size() != 4 || nd.size() != 4 || (!tables && cd[0] < B) || nd[0] != B ||
        nd[2] != cd[1] || nd[3] != cd[3] || cache->element_type() != fresh->element_type()) {
      return ffi::Error::InvalidArgument(
          "cache_rows: expected caches [B',H,S,D] (B' >= B) or pools [blocks,H,BS,D], and new "
          "rows [B,N,H,D] of the same dtype");
    }
    const int64_t H = cd[1], BS = cd[2], D = cd[3], N = nd[1];
    const int64_t row_bytes = cache->size_bytes() / cache->element_count() * D;
    auto* dst = static_cast<char*>((*out)->untyped_data());
    if (dst != cache->untyped_data()) std::memcpy(dst, cache->untyped_data(), cache->size_bytes());
    const auto* src = static_cast<const char*>(fresh->untyped_data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t length = lengths.typed_data()[b];
      for (int64_t p = 0; p < P; ++p) {
        const int64_t slot = length + p, pick = picks.typed_data()[b * P + p];
        if (slot < 0 || slot >= W * BS || pick < 0 || pick >= N) continue;
        const int64_t block = tables ? tables->typed_data()[b * W + slot / BS] : b;
        if (block < 0 || block >= cd[0]) continue;
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(dst + ((block * H + h) * BS + slot % BS) * row_bytes,
                      src + ((b * N + pick) * H + h) * row_bytes, row_bytes);
        }
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error cache_rows(ffi::Buffer<ffi::S32> picks, ffi::Buffer<ffi::S32> lengths,
                      ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return write_rows(picks, lengths, nullptr, args, rets);
}

ffi::Error paged_cache_rows(ffi::Buffer<ffi::S32> picks, ffi::Buffer<ffi::S32> lengths,
                            ffi::Buffer<ffi::S32> tables, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  return write_rows(picks, lengths, &tables, args, rets);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxCacheRows, cache_rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxPagedCacheRows, paged_cache_rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
