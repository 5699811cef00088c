// Attention of a few new queries over a per-row KV cache prefix plus the new tokens, in
// float32, reading only each row's valid cache prefix.
//
// Decode steps and verification blocks ask T <= 16 queries per row. XLA:CPU computes them
// as batched matrix products over the whole cache capacity, far from memory bandwidth; with
// many rows (continuous batching) that cost rivals the weights'. Here one task takes one
// (row, KV head, vector of up to 16 of its T x G queries): its keys are read once for those
// queries, then its values once per few queries (from cache). A query's keys are the cache positions and then the
// new tokens in order (hidden ones weigh exactly 0), its dot products run over d in order
// and its sums over keys in order, so its result does not depend on T or on the other
// queries (a verify block reproduces the single-token step). Tasks are spread over XLA's intra-op
// thread pool (parallel_tasks.h).
//
// q [B,T,Hq,D], k_cache/v_cache [B',Hkv,S,D] (B' >= B: rows past B are not read), lengths [B] int32, k_new/v_new [B,T,Hkv,D],
// mask [B,T,T] uint8 (query t sees new token j iff mask[b,t,j]); out [B,T,Hq,D]. A query
// that sees nothing gets zeros. D must be a multiple of the vector width.
//
// The paged entries read pools [N,Hkv,BS,D] through block tables [B,W] int32 (after
// lengths): position s of row b lies at row s % BS of block tables[b, s / BS]. The
// contiguous cache is the case W = 1, BS = S, block b, so both share one code path
// (CachedRows); a row's valid prefix ends at its capacity W * BS and at its first table
// entry outside [0, N) (no block).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel_tasks.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxD = 256;
constexpr int kKeys = 8;  // keys scored together (independent accumulators)
constexpr int64_t kAhead = 32;  // cache rows prefetched ahead of the scores

inline void prefetch_row(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(float)) __builtin_prefetch(row + d);
}

struct Job {
  const float *q, *k_cache, *v_cache, *k_new, *v_new;
  const int32_t* lengths;
  const int32_t* tables;  // [B, W] block tables; nullptr: a contiguous cache (block b)
  const uint8_t* mask;
  float* out;
  int64_t B, T, Hq, Hkv, D;
  int64_t blocks, W, BS;  // caches [blocks, Hkv, BS, D]; contiguous: [B', Hkv, S, D], W 1, BS S
  std::vector<float> rotated_q;  // the fused entry's rotated queries (q points here)
};

// Where the cached positions of row b, KV head h lie in the caches, in floats: position s
// at row s % BS of block tables[b, s / BS] (kPaged), or of block b, BS = S (contiguous).
template <bool kPaged>
class CachedRows {
 public:
  CachedRows(const Job& job, int64_t b, int64_t h) : job_(job), b_(b), h_(h) {}

  // Row r of the block of table entry i; -1 where the entry has no block.
  int64_t at(int64_t i, int64_t r) const {
    const int64_t block = kPaged ? job_.tables[b_ * job_.W + i] : b_;
    if (block < 0 || block >= job_.blocks) return -1;
    return ((block * job_.Hkv + h_) * job_.BS + r) * job_.D;
  }
  // Where a write to position s goes; -1 (dropped) past the capacity or without a block.
  int64_t slot(int64_t s) const {
    return s < 0 || s >= job_.W * job_.BS ? -1 : at(s / job_.BS, s % job_.BS);
  }
  // The readable prefix of a row of `length`: up to the capacity and the first entry
  // without a block. Paged, its rows' offsets are listed in `offsets` (block by block: no
  // division per key); `row(s)` then reads them.
  int64_t prefix(int64_t length, std::vector<int64_t>& offsets) {
    const int64_t len = std::clamp<int64_t>(length, 0, job_.W * job_.BS);
    if (!kPaged) {
      base_ = at(0, 0);
      return len;
    }
    offsets.resize(len);
    offsets_ = offsets.data();
    for (int64_t s = 0; s < len; s += job_.BS) {
      const int64_t first = at(s / job_.BS, 0);
      if (first < 0) return s;  // no block: the prefix ends here
      for (int64_t r = 0; r < std::min(job_.BS, len - s); ++r) offsets[s + r] = first + r * job_.D;
    }
    return len;
  }
  // Position s < prefix.
  int64_t row(int64_t s) const { return kPaged ? offsets_[s] : base_ + s * job_.D; }

 private:
  const Job& job_;
  int64_t b_, h_, base_ = 0;
  const int64_t* offsets_ = nullptr;
};

// A task's scratch memory, kept by its thread for the next.
struct Scratch {
  std::vector<float> values;     // transposed queries, then scores and weights
  std::vector<int64_t> offsets;  // the cached rows of a paged row (CachedRows::prefix)
};

// f(std::true_type) for paged caches, f(std::false_type) for a contiguous one.
template <typename F>
void with_layout(const Job& job, F f) {
  if (job.tables) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Scores of NK keys k[j] (D values each) for the kLanes queries of qt ([D][kLanes]):
// out[j * kLanes + lane] = scale * (q . k[j]), each summed over d in order.
template <int NK>
inline void scores(const float* const* k, const float* qt, int64_t D, float scale, float* out) {
  Vec acc[NK] = {};
  for (int64_t d = 0; d < D; ++d) {
    const Vec qv = load(qt + d * kLanes);
    for (int j = 0; j < NK; ++j) acc[j] += k[j][d] * qv;
  }
  for (int j = 0; j < NK; ++j) store(out + j * kLanes, acc[j] * scale);
}

// Queries [i0, i0 + NG) of a task: out_row(i) = sum over keys s, in order, of
// weights[s][i] * value_row(s), divided by denom[i]; NV vectors per value row (0: nv, known
// only at run time).
template <int NV, int NG, typename ValueRow, typename OutRow>
inline void value_group(const ValueRow& value_row, const float* weights, const Vec& denom,
                        const OutRow& out_row, int64_t keys, int64_t i0, int nv) {
  constexpr int kMaxVectors = kMaxD / kLanes;
  const int vectors = NV ? NV : nv;
  Vec acc[NG][NV ? NV : kMaxVectors] = {};
  for (int64_t s = 0; s < keys; ++s) {
    const float* value = value_row(s);
    for (int g = 0; g < NG; ++g) {
      const float w = weights[s * kLanes + i0 + g];
      for (int c = 0; c < vectors; ++c) acc[g][c] += w * load(value + c * kLanes);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const int64_t i = i0 + g;
    const float inv = denom[i] > 0.0f ? 1.0f / denom[i] : 1.0f;
    float* o = out_row(i);
    for (int c = 0; c < vectors; ++c) store(o + c * kLanes, acc[g][c] * inv);
  }
}

// Vector registers the value pass may fill with accumulators: half of the 32 (AVX-512) or
// 16 (AVX2), the rest holding a value row's vectors.
constexpr int kAccumulatorRegisters = kLanes == 16 ? 16 : 8;

// Every query of a task through value_group, as many queries per pass over V as keep the
// accumulators in registers.
template <int NV, typename ValueRow, typename OutRow>
void value_pass(const ValueRow& value_row, const float* weights, const Vec& denom,
                const OutRow& out_row, int64_t keys, int64_t count, int nv = NV) {
  constexpr int kGroup = NV == 0 ? 1 : std::max(1, std::min(4, kAccumulatorRegisters / NV));
  int64_t i0 = 0;
  for (; i0 + kGroup <= count; i0 += kGroup) {
    value_group<NV, kGroup>(value_row, weights, denom, out_row, keys, i0, nv);
  }
  for (; i0 < count; ++i0) value_group<NV, 1>(value_row, weights, denom, out_row, keys, i0, nv);
}

// Query vectors (kLanes queries each) of one row and KV head: query i = (t, g), t-major.
inline int64_t query_vectors(const Job& job) {
  return (job.T * (job.Hq / job.Hkv) + kLanes - 1) / kLanes;
}

// One vector of queries of row b over KV head h: queries sit in vector lanes (query
// first + lane), so scores, the softmax and the denominators are computed for them at once
// and each keeps its own key order; which vector a query shares does not change its result.
template <bool kPaged>
void run_task(const Job& job, int64_t task, Scratch& scratch) {
  const int64_t nq = query_vectors(job);
  const int64_t b = task / (job.Hkv * nq), h = task / nq % job.Hkv;
  const int64_t T = job.T, D = job.D, G = job.Hq / job.Hkv, Q = T * G;
  const int64_t first = task % nq * kLanes, count = std::min<int64_t>(kLanes, Q - first);
  CachedRows<kPaged> rows(job, b, h);
  const int64_t len = rows.prefix(job.lengths[b], scratch.offsets);
  const int64_t keys = len + T;  // the cache prefix, then the new tokens
  scratch.values.assign(D * kLanes + keys * kLanes, 0.0f);
  float* qt = scratch.values.data();  // [D][kLanes] queries, transposed
  float* weights = qt + D * kLanes;   // [keys][kLanes] scores, then weights
  const auto t_of = [&](int64_t lane) { return (first + lane) / G; };
  for (int64_t i = 0; i < count; ++i) {
    const float* src = job.q + ((b * T + t_of(i)) * job.Hq + h * G + (first + i) % G) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * kLanes + i] = src[d];
  }
  const float *kc = job.k_cache, *vc = job.v_cache;
  auto key_row = [&](const float* cache, const float* fresh, int64_t s) {
    return s < len ? cache + rows.row(s) : fresh + ((b * T + (s - len)) * job.Hkv + h) * D;
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Vec hidden = Vec{} - std::numeric_limits<float>::infinity();

  // Scores: for each key, q . k summed over d in order, the queries in parallel lanes.
  // The cache's rows come from memory (a decode step's weights evict them): keys are
  // prefetched kAhead rows ahead, and the values beside them for the pass that follows.
  const int64_t ahead_rows = std::min<int64_t>(len, kAhead);
  for (int64_t s = 0; s < ahead_rows; ++s) prefetch_row(kc + rows.row(s), D);
  int64_t s0 = 0;
  for (; s0 + kKeys <= keys; s0 += kKeys) {
    const float* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = key_row(kc, job.k_new, s0 + j);
    for (int64_t s = s0 + kAhead; s < std::min(s0 + kAhead + kKeys, len); ++s) {
      prefetch_row(kc + rows.row(s), D);
    }
    for (int64_t s = s0; s < std::min(s0 + kKeys, len); ++s) prefetch_row(vc + rows.row(s), D);
    scores<kKeys>(k, qt, D, scale, weights + s0 * kLanes);
  }
  for (; s0 < keys; ++s0) {
    const float* k[1] = {key_row(kc, job.k_new, s0)};
    scores<1>(k, qt, D, scale, weights + s0 * kLanes);
  }
  // New token j is hidden from query i unless mask[b, t(i), j].
  for (int64_t j = 0; j < T; ++j) {
    float* row = weights + (len + j) * kLanes;
    for (int64_t i = 0; i < count; ++i) {
      if (!job.mask[(b * T + t_of(i)) * T + j]) row[i] = -std::numeric_limits<float>::infinity();
    }
  }
  // Softmax weights in place; denominators summed in key order.
  Vec top = hidden;
  for (int64_t s = 0; s < keys; ++s) {
    const Vec x = load(weights + s * kLanes);
    top = x > top ? x : top;
  }
  top = top == hidden ? Vec{} : top;  // a query that sees nothing: all weights 0
  Vec denom = {};
  for (int64_t s = 0; s < keys; ++s) {
    float* p = weights + s * kLanes;
    const Vec e = exp_nonpositive(load(p) - top);
    store(p, e);
    denom += e;
  }
  // Values: each output accumulated in key order, a few queries per pass over V.
  const auto value_row = [&](int64_t s) { return key_row(vc, job.v_new, s); };
  const auto out_row = [&](int64_t i) {
    return job.out + ((b * T + t_of(i)) * job.Hq + h * G + (first + i) % G) * D;
  };
  switch (D / kLanes) {
    case 4: value_pass<4>(value_row, weights, denom, out_row, keys, count); break;
    case 8: value_pass<8>(value_row, weights, denom, out_row, keys, count); break;
    default: value_pass<0>(value_row, weights, denom, out_row, keys, count, D / kLanes); break;
  }
}

void launch(ffi::ThreadPool& pool, const std::shared_ptr<Job>& job) {
  // One (row, KV head, query vector) per task: a verify block's queries of one head spread
  // over both cores of a 2-core machine instead of waiting on one.
  with_layout(*job, [&](auto paged) {
    parallel_tasks(pool, job->B * job->Hkv * query_vectors(*job), [job] {
      return [job, scratch = Scratch()](int64_t task) mutable {
        run_task<decltype(paged)::value>(*job, task, scratch);
      };
    });
  });
}

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using U8 = ffi::Buffer<ffi::U8>;
using Result = ffi::ResultBuffer<ffi::F32>;

// The job's cache layout for B rows: caches [B',Hkv,S,D] with B' >= B (no tables), or pools
// [N,Hkv,BS,D] read through tables [B,W] (BS > 0); false where they do not fit.
bool set_layout(Job& job, int64_t B, ffi::Span<const int64_t> cache, const S32* tables) {
  job.B = B;
  job.blocks = cache[0];
  job.BS = cache[2];
  job.W = 1;
  job.tables = nullptr;
  if (!tables) return cache[0] >= B;
  const auto td = tables->dimensions();
  if (td.size() != 2 || td[0] != B || job.BS <= 0) return false;
  job.tables = tables->typed_data();
  job.W = td[1];
  return true;
}

constexpr char kLayouts[] =
    "caches [B',Hkv,S,D] (B' >= B) or pools [N,Hkv,BS,D] (BS > 0) with tables [B,W]";

// cache_attention, over caches or (tables) pools.
ffi::Error attention(ffi::ThreadPool& pool, F32& q, F32& k_cache, F32& v_cache, S32& lengths,
                     const S32* tables, F32& k_new, F32& v_new, U8& mask, Result& out) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), nd = k_new.dimensions();
  auto job = std::make_shared<Job>();
  if (qd.size() != 4 || kd.size() != 4 || nd.size() != 4 || kd[3] != qd[3] ||
      nd[0] != qd[0] || nd[1] != qd[1] || nd[2] != kd[1] || qd[3] % kLanes != 0 ||
      qd[3] > kMaxD || qd[2] % kd[1] != 0 || !set_layout(*job, qd[0], kd, tables)) {
    return ffi::Error::InvalidArgument(
        std::string("cache_attention: expected q [B,T,Hq,D], ") + kLayouts +
        ", new [B,T,Hkv,D] with D a multiple of the vector width up to 256 and Hq a "
        "multiple of Hkv");
  }
  job->q = q.typed_data();
  job->k_cache = k_cache.typed_data();
  job->v_cache = v_cache.typed_data();
  job->lengths = lengths.typed_data();
  job->k_new = k_new.typed_data();
  job->v_new = v_new.typed_data();
  job->mask = mask.typed_data();
  job->out = out->typed_data();
  job->T = qd[1];
  job->Hq = qd[2];
  job->D = qd[3];
  job->Hkv = kd[1];
  launch(pool, job);
  return ffi::Error::Success();
}

ffi::Error cache_attention(ffi::ThreadPool pool, F32 q, F32 k_cache, F32 v_cache, S32 lengths,
                           F32 k_new, F32 v_new, U8 mask, Result out) {
  return attention(pool, q, k_cache, v_cache, lengths, nullptr, k_new, v_new, mask, out);
}

ffi::Error paged_cache_attention(ffi::ThreadPool pool, F32 q, F32 k_pool, F32 v_pool,
                                 S32 lengths, S32 tables, F32 k_new, F32 v_new, U8 mask,
                                 Result out) {
  return attention(pool, q, k_pool, v_pool, lengths, &tables, k_new, v_new, mask, out);
}

// x * cos + rotate_half(x) * sin over one head's D values (the Hugging Face layout).
void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + -x[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// The whole attention step of a decoder layer from its projection's output: qkv
// [B,T,Hkv,G+2,D] (each KV head's G query heads, then its key, then its value) is rotated
// (cos/sin [B,T,D]), the new keys and values are written into the caches (or through the
// tables into the pools) at positions lengths[b] + t (dropped past the capacity or without a
// block; the cache results alias the inputs) and returned as k_new/v_new [B,T,Hkv,D], and
// the queries attend as in cache_attention.
ffi::Error rope_attention(ffi::ThreadPool& pool, F32& qkv, F32& cos, F32& sin, F32& k_cache,
                          F32& v_cache, S32& lengths, const S32* tables, U8& mask, Result& out,
                          Result& k_cache_out, Result& v_cache_out, Result& k_new,
                          Result& v_new) {
  const auto xd = qkv.dimensions(), kd = k_cache.dimensions(), cd = cos.dimensions();
  auto job = std::make_shared<Job>();
  if (xd.size() != 5 || kd.size() != 4 || cd.size() != 3 || xd[2] != kd[1] || xd[3] < 3 ||
      xd[4] != kd[3] || cd[0] != xd[0] || cd[1] != xd[1] || cd[2] != xd[4] ||
      xd[4] % kLanes != 0 || xd[4] > kMaxD || !set_layout(*job, xd[0], kd, tables)) {
    return ffi::Error::InvalidArgument(
        std::string("rope_cache_attention: expected qkv [B,T,Hkv,G+2,D], cos/sin [B,T,D], ") +
        kLayouts + " with D a multiple of the vector width up to 256");
  }
  const int64_t B = xd[0], T = xd[1], Hkv = xd[2], G = xd[3] - 2, D = xd[4];
  float* kc = k_cache_out->typed_data();
  float* vc = v_cache_out->typed_data();
  if (kc != k_cache.typed_data()) std::memcpy(kc, k_cache.typed_data(), k_cache.size_bytes());
  if (vc != v_cache.typed_data()) std::memcpy(vc, v_cache.typed_data(), v_cache.size_bytes());
  job->rotated_q.resize(B * T * Hkv * G * D);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cos.typed_data() + (b * T + t) * D;
      const float* n = sin.typed_data() + (b * T + t) * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* heads = qkv.typed_data() + ((b * T + t) * Hkv + h) * (G + 2) * D;
        for (int64_t g = 0; g < G; ++g) {
          rotate(heads + g * D, c, n, job->rotated_q.data() + ((b * T + t) * Hkv * G + h * G + g) * D, D);
        }
        rotate(heads + G * D, c, n, k_new->typed_data() + ((b * T + t) * Hkv + h) * D, D);
        std::memcpy(v_new->typed_data() + ((b * T + t) * Hkv + h) * D, heads + (G + 1) * D,
                    D * sizeof(float));
      }
    }
  }
  job->q = job->rotated_q.data();
  job->k_cache = kc;
  job->v_cache = vc;
  job->lengths = lengths.typed_data();
  job->k_new = k_new->typed_data();
  job->v_new = v_new->typed_data();
  job->mask = mask.typed_data();
  job->out = out->typed_data();
  job->T = T;
  job->Hq = Hkv * G;
  job->D = D;
  job->Hkv = Hkv;
  with_layout(*job, [&](auto paged) {  // the new rows into the caches
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const CachedRows<decltype(paged)::value> rows(*job, b, h);
        for (int64_t t = 0; t < T; ++t) {
          const int64_t at = rows.slot(job->lengths[b] + t), row = ((b * T + t) * Hkv + h) * D;
          if (at < 0) continue;
          std::memcpy(kc + at, job->k_new + row, D * sizeof(float));
          std::memcpy(vc + at, job->v_new + row, D * sizeof(float));
        }
      }
    }
  });
  launch(pool, job);
  return ffi::Error::Success();
}

ffi::Error rope_cache_attention(ffi::ThreadPool pool, F32 qkv, F32 cos, F32 sin, F32 k_cache,
                                F32 v_cache, S32 lengths, U8 mask, Result out,
                                Result k_cache_out, Result v_cache_out, Result k_new,
                                Result v_new) {
  return rope_attention(pool, qkv, cos, sin, k_cache, v_cache, lengths, nullptr, mask, out,
                        k_cache_out, v_cache_out, k_new, v_new);
}

ffi::Error paged_rope_cache_attention(ffi::ThreadPool pool, F32 qkv, F32 cos, F32 sin,
                                      F32 k_pool, F32 v_pool, S32 lengths, S32 tables,
                                      U8 mask, Result out, Result k_pool_out,
                                      Result v_pool_out, Result k_new, Result v_new) {
  return rope_attention(pool, qkv, cos, sin, k_pool, v_pool, lengths, &tables, mask, out,
                        k_pool_out, v_pool_out, k_new, v_new);
}

// `first` (the thread pool and the operands before the caches), then the caches, lengths
// and (kPaged) the block tables. (Bindings move only within one expression.)
template <bool kPaged, typename Binding>
auto with_caches(Binding&& first) {
  if constexpr (kPaged) {
    return std::move(first).template Arg<F32>().template Arg<F32>().template Arg<S32>()
        .template Arg<S32>();
  } else {
    return std::move(first).template Arg<F32>().template Arg<F32>().template Arg<S32>();
  }
}

template <bool kPaged>
auto attention_binding() {
  return with_caches<kPaged>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>())
      .template Arg<F32>().template Arg<F32>().template Arg<U8>().template Ret<F32>();
}

template <bool kPaged>
auto rope_binding() {
  return with_caches<kPaged>(
             ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<F32>().Arg<F32>())
      .template Arg<U8>().template Ret<F32>().template Ret<F32>().template Ret<F32>()
      .template Ret<F32>().template Ret<F32>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxCacheAttention, cache_attention, attention_binding<false>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxPagedCacheAttention, paged_cache_attention,
                              attention_binding<true>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxRopeCacheAttention, rope_cache_attention, rope_binding<false>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxPagedRopeCacheAttention, paged_rope_cache_attention,
                              rope_binding<true>());
