// y[M,N] = x[M,K] . w[N,K]^T for a few rows M with w in int8 storage and x quantized to int8
// in blocks of 32 (eaglejax/models/quantized.py has the format and the formula):
//   y[m,n] = s[n] * sum_b t[m,b] * sum_{k in b} p[m,k] q[n,k].
//
// w arrives packed: tiles of 16 output rows, each 4 consecutive k of the 16 rows in one
// 64-byte line, stored as q + 128 (unsigned). AVX-512 VNNI's vpdpbusd multiplies the 64
// unsigned weight bytes by one row's 4 signed x bytes (broadcast) and adds each lane's 4
// products to its 32-bit sum: 64 multiply-adds per instruction, four times float32's FMA,
// so a verify block of 8-16 rows costs little more than the weight stream (a quarter of
// float32's bytes). A block's integer sums start at -128 * sum_{k in b} p[m,k], which
// removes the +128 exactly; each block's sum is then scaled by t[m,b] into float32, and
// the row scales s come last. Every row is summed in the same order whatever M is, so a
// verify block reproduces the single-token step bit for bit. Without VNNI the same sums
// run in plain integer loops. Work is split over XLA's intra-op thread pool in long runs
// of tiles (parallel_tasks.h); the rows may be RMS-normed or formed as silu(gate) * up
// first and a residual added after (row_prologue.h), as in few_row_matmul.cc.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

#include "parallel_tasks.h"
#include "quantized_rows.h"
#include "row_prologue.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Job {
  const uint8_t* w;  // [N/16, K/4, 16, 4]
  const float* s;    // [N]
  QuantizedX x;
  float* y;
  int64_t M, K, N, run_tiles;
};

#if defined(__AVX512VNNI__)
// 4 rows x 3 tiles: 12 integer sums, 3 weight lines and x in registers; the float sums of
// every row wait in L1 while a block's weight lines (1.5 KB) serve each group of rows.
constexpr int kRowsX = 4;
constexpr int kTilesW = 3;
constexpr int kTilesWOneRow = 8;  // one row: more lines in flight (the stream bounds it)

// One block b of rows m0..m0+MX-1 for tiles t0..t0+RW-1, added to sums[m][r].
template <int MX, int RW>
inline void block_rows(const Job& job, const uint8_t* const* lines, int64_t b, int64_t m0,
                       bool prefetch, __m512 (*sums)[kTilesWOneRow]) {
  const int64_t ahead = RW * job.K / 4 * 64;  // the same line of the next group of tiles
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  __m512i acc[MX][RW];
  for (int m = 0; m < MX; ++m) {
    const __m512i start = _mm512_set1_epi32(-128 * job.x.sums[(m0 + m) * blocks + b]);
    for (int r = 0; r < RW; ++r) acc[m][r] = start;
  }
  for (int64_t g = b * kGroupsPerBlock; g < (b + 1) * kGroupsPerBlock; ++g) {
    __m512i wv[RW];
    for (int r = 0; r < RW; ++r) {
      wv[r] = _mm512_loadu_si512(lines[r] + g * 64);
      if (prefetch) __builtin_prefetch(lines[r] + g * 64 + ahead, 0, 2);
    }
    for (int m = 0; m < MX; ++m) {
      const __m512i xv = _mm512_set1_epi32(job.x.words[(m0 + m) * groups + g]);
      for (int r = 0; r < RW; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MX; ++m) {
    const __m512 t = _mm512_set1_ps(job.x.scales[(m0 + m) * blocks + b]);
    for (int r = 0; r < RW; ++r) {
      sums[m0 + m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][r]), t, sums[m0 + m][r]);
    }
  }
}

// Every row of output tiles t0..t0+RW-1.
template <int RW>
void tiles(const Job& job, int64_t t0) {
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  __m512 sums[kMaxRows][kTilesWOneRow];
  for (int64_t m = 0; m < job.M; ++m)
    for (int r = 0; r < RW; ++r) sums[m][r] = _mm512_setzero_ps();
  const uint8_t* lines[RW];
  for (int r = 0; r < RW; ++r) lines[r] = job.w + (t0 + r) * groups * 64;
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t m0 = 0;
    for (; m0 + kRowsX <= job.M; m0 += kRowsX) {
      block_rows<kRowsX, RW>(job, lines, b, m0, m0 == 0, sums);
    }
    switch (job.M - m0) {
      case 3: block_rows<3, RW>(job, lines, b, m0, m0 == 0, sums); break;
      case 2: block_rows<2, RW>(job, lines, b, m0, m0 == 0, sums); break;
      case 1: block_rows<1, RW>(job, lines, b, m0, m0 == 0, sums); break;
      default: break;
    }
  }
  for (int r = 0; r < RW; ++r) {
    const __m512 s = _mm512_loadu_ps(job.s + (t0 + r) * kTile);
    for (int64_t m = 0; m < job.M; ++m) {
      _mm512_storeu_ps(job.y + m * job.N + (t0 + r) * kTile, _mm512_mul_ps(sums[m][r], s));
    }
  }
}

void run_chunk(const Job& job, int64_t chunk) {
  const int64_t begin = chunk * job.run_tiles;
  const int64_t end = std::min(job.N / kTile, begin + job.run_tiles);
  int64_t t0 = begin;
  if (job.M == 1) {
    for (; t0 + kTilesWOneRow <= end; t0 += kTilesWOneRow) tiles<kTilesWOneRow>(job, t0);
  }
  for (; t0 + kTilesW <= end; t0 += kTilesW) tiles<kTilesW>(job, t0);
  for (; t0 < end; ++t0) tiles<1>(job, t0);
}
#else
void run_chunk(const Job& job, int64_t chunk) {
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  const int64_t end = std::min(job.N / kTile, (chunk + 1) * job.run_tiles);
  for (int64_t t = chunk * job.run_tiles; t < end; ++t) {
    const uint8_t* lines = job.w + t * groups * 64;
    for (int64_t m = 0; m < job.M; ++m) {
      const int8_t* p = reinterpret_cast<const int8_t*>(job.x.words.data() + m * groups);
      float sums[kTile] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t block[kTile];
        std::fill(block, block + kTile, -128 * job.x.sums[m * blocks + b]);
        for (int64_t g = b * kGroupsPerBlock; g < (b + 1) * kGroupsPerBlock; ++g) {
          for (int64_t lane = 0; lane < kTile; ++lane) {
            for (int64_t j = 0; j < 4; ++j) {
              block[lane] += int32_t{lines[g * 64 + lane * 4 + j]} * p[g * 4 + j];
            }
          }
        }
        const float scale = job.x.scales[m * blocks + b];
        for (int64_t lane = 0; lane < kTile; ++lane) {
          sums[lane] += static_cast<float>(block[lane]) * scale;
        }
      }
      for (int64_t lane = 0; lane < kTile; ++lane) {
        job.y[m * job.N + t * kTile + lane] = sums[lane] * job.s[t * kTile + lane];
      }
    }
  }
}
#endif

ffi::Error int8_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                       ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::F32> y,
                       int32_t prologue, float eps) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const bool packed = wd.size() == 4 && wd[2] == kTile && wd[3] == 4;
  const int64_t N = packed ? wd[0] * kTile : 0, K = packed ? wd[1] * 4 : 0;
  const int64_t width = prologue == kSiluGate ? 2 * K : K;
  if (!packed || K % kBlock != 0 || xd.size() != 2 || xd[1] != width || s.element_count() != N ||
      prologue < kPlain || prologue > kSiluGate ||
      (prologue == kRmsNorm && scale.element_count() != K) ||
      (residual.element_count() != 0 && residual.element_count() != xd[0] * N)) {
    return ffi::Error::InvalidArgument(
        "int8_matmul: expected x [M,K] ([M,2K] for silu(gate) * up), w packed [N/16,K/4,16,4] "
        "with K % 32 == 0, row scales [N], a norm scale [K] with the RMS norm, and a residual "
        "[M,N] or none");
  }
  const int64_t M = xd[0];
  std::vector<float> rows;
  const float* a = prologue_rows(static_cast<Prologue>(prologue), x.typed_data(), M, K,
                                 scale.typed_data(), eps, rows);
  // Blocks of up to kMaxRows rows, one after the other (a prefill chunk, a large batch):
  // each reads the weights once, its rows summed exactly as alone.
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t rows_in_block = std::min(kMaxRows, M - m0);
    auto job = std::make_shared<Job>();
    job->w = w.typed_data();
    job->s = s.typed_data();
    job->x = quantize_rows(a + m0 * K, rows_in_block, K);
    job->y = y->typed_data() + m0 * N;
    job->M = rows_in_block;
    job->K = K;
    job->N = N;
    job->run_tiles = tiles_per_run(N / kTile, pool.num_threads());
    parallel_tasks(pool, (N / kTile + job->run_tiles - 1) / job->run_tiles, [job] {
      return [job](int64_t chunk) { run_chunk(*job, chunk); };
    });
  }
  if (residual.element_count() != 0) add_residual(y->typed_data(), residual.typed_data(), M * N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxInt8Matmul, int8_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps"));
