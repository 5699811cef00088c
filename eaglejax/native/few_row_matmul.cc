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
//
// bfloat16 weights on a CPU with AMX (Intel Sapphire Rapids and later) go through the tile
// unit instead: x is split into two bfloat16 halves (hi = x rounded, lo = the remainder
// rounded: x to 2^-17 relative, as XLA's path for 16-bit storage, `split_precision_linear`,
// splits it), each half times the stored weights is an exact product, and the tile unit sums
// them in float32. The AVX-512 path needs M fused multiply-adds per weight element, more
// than two cores compute while the weights stream in once M passes about 8; the tile unit
// does them faster, one product per 16 x columns: 8 rows per product with two halves (the
// measured gain and its limits are in BENCHMARKS.md).

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

// x [M,K] as the B tiles of its parts: column c = part * M + m of tile c / 16, each k pair
// one 32-bit word (two bfloat16 values) as the tile unit reads it; tile (k block kb,
// column tile j) is 16 pairs x 16 columns at word (kb * column_tiles + j) * 256. Each part
// rounds what the parts before it left of x to 8 significant bits.
std::vector<uint32_t> pack_parts(const float* x, int64_t M, int64_t K, int64_t column_tiles) {
  std::vector<uint32_t> packed(K / kTileK * column_tiles * 256, 0);
  std::vector<float> rest(K);
  std::vector<uint16_t> values(K);  // one part of one row
  std::vector<uint32_t> pairs(K / 2);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(rest.data(), x + m * K, K * sizeof(float));
    for (int64_t part = 0; part < kParts; ++part) {
      for (int64_t k = 0; k < K; ++k) {  // an infinity is all in hi (inf - inf is NaN)
        values[k] = to_bf16(rest[k]);
        rest[k] = std::isinf(rest[k]) ? 0.0f : rest[k] - scalar(values[k]);
      }
      std::memcpy(pairs.data(), values.data(), K * sizeof(uint16_t));
      const int64_t c = part * M + m;
      uint32_t* column = packed.data() + (c / 16) * 256 + c % 16;
      for (int64_t kb = 0; kb < K / kTileK; ++kb) {
        uint32_t* tile = column + kb * column_tiles * 256;
        const uint32_t* block = pairs.data() + kb * 16;
        for (int kk = 0; kk < 16; ++kk) tile[kk * 16] = block[kk];
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
    for (int64_t r = 0; r < kTileN; ++r) {  // the next 16 rows' weights at these k
      __builtin_prefetch(rows + (kTileN + r) * K + kb * kTileK);
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
  int64_t M, K, N, column_tiles;
  std::vector<uint32_t> packed;
};

void amx_chunk(const AmxJob& job, int64_t chunk) {
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
  const int64_t end = std::min(job.N, (chunk + 1) * kChunk);
  for (int64_t n0 = chunk * kChunk; n0 < end; n0 += kTileN) {
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
  parallel_tasks(pool, (N + kChunk - 1) / kChunk, [job] {
    return [job](int64_t chunk) { amx_chunk(*job, chunk); };
  });
}
#endif

template <typename W, typename WBuffer>
ffi::Error few_row_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, WBuffer w,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("few_row_matmul: expected x [M,K] and w [N,K]");
  }
#if EAGLEJAX_AMX
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (amx_applies(xd[0], xd[1], wd[0])) {
      amx_matmul(pool, x.typed_data(), reinterpret_cast<const uint16_t*>(w.untyped_data()),
                 y->typed_data(), xd[0], xd[1], wd[0]);
      return ffi::Error::Success();
    }
  }
#endif
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
