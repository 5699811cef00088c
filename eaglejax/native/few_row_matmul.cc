// y[M,N] = x[M,K] . w[N,K]^T in float32 for a few rows M, reading w exactly once; w is
// float32 or bfloat16 (widened exactly in registers: the products are those of float32).
//
// Verification blocks (2-16 rows) multiply every weight matrix of the model. XLA:CPU's
// matrix-matrix kernels run such shapes well below memory bandwidth, although each weight
// element is needed only M times: this kernel streams w row by row, keeps a tile of x rows
// in L1 and does M fused multiply-adds per weight element loaded. The float32 sum of every
// output element runs over k in the same order whatever M is, so a row's result does not
// depend on the other rows in the block (a verify block reproduces the single-token step).
// Work is split over XLA's intra-op thread pool in two long runs of w rows per thread
// (parallel_tasks.h).
//
// bfloat16 weights on a CPU with AMX (Intel Sapphire Rapids and later) go through the tile
// unit instead: x is split into two bfloat16 halves (hi = x rounded, lo = the remainder
// rounded: x to 2^-17 relative, as XLA's path for 16-bit storage, `split_precision_linear`,
// splits it), each half times the stored weights is an exact product, and the tile unit sums
// them in float32. The AVX-512 path needs M fused multiply-adds per weight element, more
// than two cores compute while the weights stream in once M passes about 8; the tile unit
// does them faster, one product per 16 x columns: 8 rows per product with two halves (the
// measured gain and its limits are in BENCHMARKS.md).
//
// A decoder layer's small operations around its products ride along, so a verify block
// pays no separate pass (and no XLA operation of its own) for them: the rows multiplied may
// be x RMS-normed and scaled (prologue 1, attention and MLP inputs) or silu(gate) * up of
// x = [gate | up] (prologue 2, the MLP's down projection), and y may have a residual added.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define EAGLEJAX_AMX 1
#endif

#include "parallel_tasks.h"
#include "row_prologue.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
// x rows x w rows per tile: 8 x 3 accumulators + 3 w + 1 x registers. Every further pass
// over a tile's w rows widens them again and runs on fewer accumulators: 7-8 rows in one
// pass instead of 6 + 1-2 made those products 12-17% faster on AMD Zen 4.
constexpr int kRowsX = 8;
constexpr int kRowsW = 3;
#else
constexpr int kRowsX = 3;   // 3 x 4 accumulators in 16 registers
constexpr int kRowsW = 4;
#endif
constexpr int kRowsWSmall = 8;  // w rows per tile when M <= 2 (few accumulators)
constexpr int64_t kRunUnit = kRowsW * kRowsWSmall;  // a thread's runs: whole tiles of both
// Hardware prefetching alone leaves the core waiting on memory (with 3 or more x rows a tile
// computes long between loads; with 1-2 rows of bfloat16 storage the streams run ahead of
// it: 8-10% slower on AMD Zen 4): fetch each w stream this many elements ahead as well.
constexpr int64_t kPrefetchAhead = 8192;

// Threads take the w rows in kRunsPerThread long runs each, of `rows_per_run` rows (a
// multiple of `unit`): a run's streams stay warm and a block's prefetch of the next rows
// serves its own core. In 32-row chunks taken in turn half the blocks started cold (a decode
// step's products ran 13-15% slower on the tile unit, 3-16 float32 rows 11-13%).
constexpr int64_t kRunsPerThread = 2;

inline int64_t rows_per_run(int64_t N, int64_t unit, int64_t threads) {
  const int64_t runs = kRunsPerThread * std::max<int64_t>(threads, 1);
  return std::max<int64_t>(unit, (N / unit + runs - 1) / runs * unit);
}

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
  const bool prefetch = m0 == 0;  // later x tiles find w in cache
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
    case 7: tile<7, RW, W>(x, w, y, K, N, m0, n0); break;
    case 6: tile<6, RW, W>(x, w, y, K, N, m0, n0); break;
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
  int64_t M, K, N, run_rows;
};

template <typename W>
void run_chunk(const Job<W>& job, int64_t chunk) {
  const int64_t begin = chunk * job.run_rows, end = std::min(job.N, begin + job.run_rows);
  int64_t n0 = begin;
  if (job.M <= 2) {  // few accumulators: take more w rows per tile
    for (; n0 + kRowsWSmall <= end; n0 += kRowsWSmall) {
      columns_small<kRowsWSmall, W>(job.x, job.w, job.y, job.M, job.K, job.N, n0);
    }
  }
  for (; n0 + kRowsW <= end; n0 += kRowsW) {
    columns<kRowsW, W>(job.x, job.w, job.y, job.M, job.K, job.N, n0);
  }
  for (; n0 < end; ++n0) columns<1, W>(job.x, job.w, job.y, job.M, job.K, job.N, n0);
}

#if EAGLEJAX_AMX
constexpr int64_t kTileN = 16;  // w rows per tile (rows of the A and C tiles)
constexpr int64_t kTileK = 32;  // bfloat16 values per tile row (64 bytes)
constexpr int64_t kParts = 2;   // x ~ hi + lo in bfloat16

// Linux hands the tile registers to a process only on request (once per process).
bool amx_permitted() {
  static const bool permitted =
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows of 64 bytes: tmm0-1 blocks of w (16 rows x 32 k), tmm2-3 the
// packed x halves (16 k pairs x 16 columns), tmm5-6 the float32 sums (16 rows x 16 columns).
TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  return config;
}

// Round to the nearest bfloat16, ties to even; a NaN stays a NaN (rounding its payload
// could carry into the sign and give 0).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (f != f) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Splits 32 values of x (one k block) into their bfloat16 parts: parts[p][j] holds part p
// of x[j]; each part rounds what the parts before it left of x to 8 significant bits, and an
// infinity is all in the first part (inf - inf would be NaN).
inline void split_block(const float* x, uint16_t parts[kParts][kTileK]) {
#if defined(__AVX512BF16__)
  for (int half = 0; half < 2; ++half) {
    __m512 rest = _mm512_loadu_ps(x + 16 * half);
    for (int64_t part = 0; part < kParts; ++part) {
      const __m256bh rounded = _mm512_cvtneps_pbh(rest);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts[part] + 16 * half),
                          reinterpret_cast<const __m256i&>(rounded));
      const __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(rounded)), 16));
      const __mmask16 infinite = _mm512_fpclass_ps_mask(rest, 0x18);
      rest = _mm512_maskz_sub_ps(static_cast<__mmask16>(~infinite), rest, widened);
    }
  }
#else
  for (int64_t k = 0; k < kTileK; ++k) {
    float rest = x[k];
    for (int64_t part = 0; part < kParts; ++part) {
      parts[part][k] = to_bf16(rest);
      rest = std::isinf(rest) ? 0.0f : rest - scalar(parts[part][k]);
    }
  }
#endif
}

// x [M,K] as the B tiles of its parts: column c = part * M + m of tile c / 16, each k pair
// one 32-bit word (two bfloat16 values) as the tile unit reads it; tile (k block kb,
// column tile j) is 16 pairs x 16 columns at word (kb * column_tiles + j) * 256.
std::vector<uint32_t> pack_parts(const float* x, int64_t M, int64_t K, int64_t column_tiles) {
  std::vector<uint32_t> packed(K / kTileK * column_tiles * 256, 0);
  alignas(64) uint16_t parts[kParts][kTileK];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < K / kTileK; ++kb) {
      split_block(x + m * K + kb * kTileK, parts);
      for (int64_t part = 0; part < kParts; ++part) {
        const int64_t c = part * M + m;
        uint32_t* tile = packed.data() + (kb * column_tiles + c / 16) * 256 + c % 16;
        uint32_t pairs[kTileK / 2];
        std::memcpy(pairs, parts[part], sizeof pairs);
        for (int kk = 0; kk < kTileK / 2; ++kk) tile[kk * 16] = pairs[kk];
      }
    }
  }
  return packed;
}

// One k block of the sums: w rows into tile A (a literal: the intrinsics name registers),
// the halves' tiles into 2..3, products added to 5..6. Two A tiles alternate so the next
// block's weights load while the previous block's products still read theirs.
#define EAGLEJAX_AMX_STEP(A, rows, b)             \
  do {                                            \
    _tile_loadd(A, rows, K * sizeof(uint16_t));   \
    _tile_loadd(2, b, 64);                        \
    _tile_dpbf16ps(5, A, 2);                      \
    if (kColumnTiles > 1) {                       \
      _tile_loadd(3, (b) + 256, 64);              \
      _tile_dpbf16ps(6, A, 3);                    \
    }                                             \
  } while (0)

// Output columns n0..n0+15 of every row.
template <int kColumnTiles>
void amx_block(const uint16_t* w, const uint32_t* packed, float* y, int64_t M, int64_t K,
               int64_t N, int64_t n0) {
  alignas(64) float sums[kColumnTiles][16][16];
  _tile_zero(5);
  if (kColumnTiles > 1) _tile_zero(6);
  const uint16_t* rows = w + n0 * K;
  const int64_t blocks = K / kTileK, stride = kColumnTiles * 256;
  int64_t kb = 0;
  for (; kb + 2 <= blocks; kb += 2) {
    // The next 16 rows' weights at these k, into L2 only (prefetcht1): a fetch into L1
    // holds one of its few fill buffers until the line arrives, and a decode step ran 7-10%
    // slower that way (BENCHMARKS.md, session 23).
    for (int64_t r = 0; r < kTileN; ++r) {
      __builtin_prefetch(rows + (kTileN + r) * K + kb * kTileK, 0, 2);
    }
    EAGLEJAX_AMX_STEP(0, rows + kb * kTileK, packed + kb * stride);
    EAGLEJAX_AMX_STEP(1, rows + (kb + 1) * kTileK, packed + (kb + 1) * stride);
  }
  if (kb < blocks) EAGLEJAX_AMX_STEP(0, rows + kb * kTileK, packed + kb * stride);
  _tile_stored(5, sums[0], 64);
  if (kColumnTiles > 1) _tile_stored(6, sums[kColumnTiles > 1 ? 1 : 0], 64);
  const auto at = [&](int64_t r, int64_t c) { return sums[c / 16][r][c % 16]; };
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < kTileN; ++r) {
      y[m * N + n0 + r] = at(r, m) + at(r, M + m);
    }
  }
}

struct AmxJob {
  const uint16_t* w;
  float* y;
  int64_t M, K, N, column_tiles, run_rows;
  std::vector<uint32_t> packed;
};

void amx_chunk(const AmxJob& job, int64_t chunk) {
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
  const int64_t end = std::min(job.N, (chunk + 1) * job.run_rows);
  for (int64_t n0 = chunk * job.run_rows; n0 < end; n0 += kTileN) {
    const uint32_t* b = job.packed.data();
    switch (job.column_tiles) {
      case 1: amx_block<1>(job.w, b, job.y, job.M, job.K, job.N, n0); break;
      default: amx_block<2>(job.w, b, job.y, job.M, job.K, job.N, n0); break;
    }
  }
  _tile_release();
}

// Whether the tile unit takes this product: whole tiles of w (K a multiple of 32, N of 16)
// and at most 16 rows of x (two halves each in at most two column tiles).
bool amx_applies(int64_t M, int64_t K, int64_t N) {
  return K % kTileK == 0 && N % kTileN == 0 && M <= 16 && amx_permitted();
}

void amx_matmul(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y, int64_t M,
                int64_t K, int64_t N) {
  auto job = std::make_shared<AmxJob>();
  job->w = w;
  job->y = y;
  job->M = M;
  job->K = K;
  job->N = N;
  job->column_tiles = (kParts * M + 15) / 16;
  job->packed = pack_parts(x, M, K, job->column_tiles);
  job->run_rows = rows_per_run(N, kTileN, pool.num_threads());
  parallel_tasks(pool, (N + job->run_rows - 1) / job->run_rows, [job] {
    return [job](int64_t chunk) { amx_chunk(*job, chunk); };
  });
}
#endif

template <typename W, typename WBuffer>
ffi::Error few_row_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, WBuffer w,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> residual,
                          ffi::ResultBuffer<ffi::F32> y, int32_t prologue, float eps) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t width = prologue == kSiluGate ? 2 * wd[1] : wd[1];
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != width || prologue < kPlain ||
      prologue > kSiluGate || (prologue == kRmsNorm && scale.element_count() != wd[1]) ||
      (residual.element_count() != 0 && residual.element_count() != xd[0] * wd[0])) {
    return ffi::Error::InvalidArgument(
        "few_row_matmul: expected x [M,K] ([M,2K] for silu(gate) * up), w [N,K], a norm "
        "scale [K] with the RMS norm, and a residual [M,N] or none");
  }
  const int64_t M = xd[0], K = wd[1], N = wd[0];
  std::vector<float> rows;
  const float* a = prologue_rows(static_cast<Prologue>(prologue), x.typed_data(), M, K,
                                 scale.typed_data(), eps, rows);
  float* out = y->typed_data();
  bool done = false;
#if EAGLEJAX_AMX
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (amx_applies(M, K, N)) {
      amx_matmul(pool, a, reinterpret_cast<const uint16_t*>(w.untyped_data()), out, M, K, N);
      done = true;
    }
  }
#endif
  if (!done) {
    auto job = std::make_shared<Job<W>>();
    job->x = a;
    job->w = reinterpret_cast<const W*>(w.untyped_data());
    job->y = out;
    job->M = M;
    job->K = K;
    job->N = N;
    job->run_rows = rows_per_run(N, kRunUnit, pool.num_threads());
    parallel_tasks(pool, (N + job->run_rows - 1) / job->run_rows, [job] {
      return [job](int64_t chunk) { run_chunk(*job, chunk); };
    });
  }
  if (residual.element_count() != 0) add_residual(out, residual.typed_data(), M * N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxFewRowMatmul,
                              (few_row_matmul<float, ffi::Buffer<ffi::F32>>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxFewRowMatmulBf16,
                              (few_row_matmul<uint16_t, ffi::Buffer<ffi::BF16>>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps"));
