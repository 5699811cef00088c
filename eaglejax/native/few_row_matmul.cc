// y[M,N] = x[M,K] . w[N,K]^T in float32 for a few rows M, reading w exactly once; w is
// float32 or bfloat16 (widened exactly in registers: the products are those of float32).
//
// Verification blocks (2-16 rows) multiply every weight matrix of the model. XLA:CPU's
// matrix-matrix kernels run such shapes well below memory bandwidth, although each weight
// element is needed only M times: this kernel streams w row by row, keeps a tile of x rows
// in L1 and does M fused multiply-adds per weight element loaded. The float32 sum of every
// output element runs over k in the same order whatever M is, so a row's result does not
// depend on the other rows in the block (a verify block reproduces the single-token step).
// Work is split over XLA's intra-op thread pool in chunks of w rows (parallel_tasks.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "parallel_tasks.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kRowsX = 6;   // x rows per tile: 6 x 4 accumulators + 4 w + 1 x registers
#else
constexpr int kRowsX = 3;   // 3 x 4 accumulators in 16 registers
#endif
constexpr int kRowsW = 4;   // w rows per tile (8 when M <= 2)
constexpr int64_t kChunk = 32;  // w rows per unit of threaded work
// With 3 or more x rows a tile computes long enough that hardware prefetching alone leaves
// the core waiting on memory: fetch each w stream this many floats (32 KB) ahead as well.
constexpr int64_t kPrefetchAhead = 8192;

typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Word __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// bfloat16 is the top half of a float32: widen by shifting into place.
inline Vec load(const uint16_t* p) {
  Half h;
  std::memcpy(&h, p, sizeof h);
  const Word bits = __builtin_convertvector(h, Word) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline float scalar(float v) { return v; }

inline float scalar(uint16_t v) {
  const uint32_t bits = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Output rows m0..m0+MX-1, columns n0..n0+RW-1.
template <int MX, int RW, typename W>
void tile(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t m0,
          int64_t n0) {
  Vec acc[MX][RW] = {};
  const bool prefetch = MX >= 3 && m0 == 0;  // later x tiles find w in cache
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[RW];
    for (int r = 0; r < RW; ++r) {
      wv[r] = load(w + (n0 + r) * K + k);
      if (prefetch) __builtin_prefetch(w + (n0 + r) * K + k + kPrefetchAhead);
    }
    for (int m = 0; m < MX; ++m) {
      Vec xv = load(x + (m0 + m) * K + k);
      asm("" : "+v"(xv));  // keep xv in a register: folding it into each FMA reloads it RW times
      for (int r = 0; r < RW; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MX; ++m) {
    for (int r = 0; r < RW; ++r) {
      float s = lane_sum(acc[m][r]);
      for (int64_t j = k; j < K; ++j) s += x[(m0 + m) * K + j] * scalar(w[(n0 + r) * K + j]);
      y[(m0 + m) * N + n0 + r] = s;
    }
  }
}

template <int RW, typename W>
void columns_small(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N,
                   int64_t n0) {
  if (M == 1) tile<1, RW, W>(x, w, y, K, N, 0, n0);
  else tile<2, RW, W>(x, w, y, K, N, 0, n0);
}

template <int RW, typename W>
void columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + kRowsX <= M; m0 += kRowsX) tile<kRowsX, RW, W>(x, w, y, K, N, m0, n0);
  switch (M - m0) {
#if defined(__AVX512F__)
    case 5: tile<5, RW, W>(x, w, y, K, N, m0, n0); break;
    case 4: tile<4, RW, W>(x, w, y, K, N, m0, n0); break;
    case 3: tile<3, RW, W>(x, w, y, K, N, m0, n0); break;
#endif
    case 2: tile<2, RW, W>(x, w, y, K, N, m0, n0); break;
    case 1: tile<1, RW, W>(x, w, y, K, N, m0, n0); break;
    default: break;
  }
}

template <typename W>
struct Job {
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N;
};

template <typename W>
void run_chunk(const Job<W>& job, int64_t chunk) {
  const int64_t begin = chunk * kChunk, end = std::min(job.N, begin + kChunk);
  int64_t n0 = begin;
  if (job.M <= 2) {  // few accumulators: take more w rows per tile
    for (; n0 + 2 * kRowsW <= end; n0 += 2 * kRowsW) {
      columns_small<2 * kRowsW, W>(job.x, job.w, job.y, job.M, job.K, job.N, n0);
    }
  }
  for (; n0 + kRowsW <= end; n0 += kRowsW) {
    columns<kRowsW, W>(job.x, job.w, job.y, job.M, job.K, job.N, n0);
  }
  for (; n0 < end; ++n0) columns<1, W>(job.x, job.w, job.y, job.M, job.K, job.N, n0);
}

template <typename W, typename WBuffer>
ffi::Error few_row_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, WBuffer w,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("few_row_matmul: expected x [M,K] and w [N,K]");
  }
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data();
  job->w = reinterpret_cast<const W*>(w.untyped_data());
  job->y = y->typed_data();
  job->M = xd[0];
  job->K = xd[1];
  job->N = wd[0];
  parallel_tasks(pool, (job->N + kChunk - 1) / kChunk, [job] {
    return [job](int64_t chunk) { run_chunk(*job, chunk); };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxFewRowMatmul,
                              (few_row_matmul<float, ffi::Buffer<ffi::F32>>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxFewRowMatmulBf16,
                              (few_row_matmul<uint16_t, ffi::Buffer<ffi::BF16>>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
