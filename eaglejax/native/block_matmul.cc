// y[M,N] = x[M,K] . W[N,K]^T for a few rows M with W in GGUF blocks (Q4_0, Q4_1, Q8_0) and x
// quantized to int8 in blocks of 32 (eaglejax/models/gguf_blocks.py has the format):
//   y[m,n] = sum_b t[m,b] * (d[n,b] * S[m,n,b] + mn[n,b] * sum_{k in b} p[m,k]),
//   S[m,n,b] = sum_{k in b} (q[n,k] + offset) p[m,k]   (an integer, exact),
// offset -8 (Q4_0), 0 (Q4_1) or -128 (Q8_0, stored q + 128), the minimum term only where
// the kind has minimums.
//
// W arrives packed as int8_matmul.cc's weights are: tiles of 16 output rows, each 4
// consecutive k of the 16 rows one 64-byte line of unsigned bytes, the operand of
// vpdpbusd (64 unsigned weight bytes times one row's 4 signed x bytes, broadcast).
// 8-bit values: packed [N/16, K/4, 16, 4]. 4-bit values: two lines share 64 bytes, line 2j
// in the low nibbles and 2j + 1 in the high ones: packed [N/16, K/8, 16, 4], unpacked in
// registers with an and and a shift and then used by a group of 4 rows of x (groups of 8
// rows x 2 tiles ran 8-20% slower at 8-16 rows once the next tiles were prefetched, 6 x 2
// and 6 x 3 4-15% slower; unpacking once into an L1 buffer for all rows measured the same
// as 8-row groups, its stores costing what the reuse saved). One row runs the same groups
// of 3 tiles: 8 tiles at a time ran 7-13% slower.
// Scales d and minimums mn: float16 [N/16, K/32, 16] (one 16-lane vector per tile and
// block). A block's integer sums start at offset * sum(p), its float32 sum is
// d * S (+ mn * sum(p)), scaled by t and added to the row's sums in block order; every
// row is summed in the same order whatever M is, so a verify block reproduces the
// single-token step bit for bit. Without VNNI the same sums run in plain loops. Threads,
// prologues and the residual are as in int8_matmul.cc.

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

constexpr int64_t kLine = 64;  // bytes of one line: 4 k of a tile's 16 rows

struct Job {
  const uint8_t* w;      // [N/16, K/4 or K/8, 16, 4]
  const uint16_t* d;     // float16 [N/16, K/32, 16]
  const uint16_t* mins;  // float16 [N/16, K/32, 16], or null
  QuantizedX x;
  float* y;
  int64_t M, K, N, run_tiles;
  int32_t offset, bits;

  int64_t block_bytes() const { return kBlock * kTile * bits / 8; }  // one tile's block
  int64_t tile_bytes() const { return K / kBlock * block_bytes(); }
  int64_t at(int64_t tile, int64_t b) const { return (tile * (K / kBlock) + b) * kTile; }
};

#if defined(__AVX512VNNI__)
// 4 rows x 3 tiles: 12 integer sums, 3 weight lines and x in registers; the float sums of
// every row wait in L1 while a block's lines serve each group of rows.
constexpr int kRowsX = 4;
constexpr int kTilesW = 3;

// An opaque copy of a weight line: what is unpacked from it is unpacked again for each group
// of rows. Left to itself the compiler hoists the unpacking of all 3 tiles' 8 lines out of
// the loop over groups of rows (24 registers) and spills the sums instead (4-5% slower at
// 8-12 rows).
inline __m512i opaque(__m512i v) {
  asm volatile("" : "+v"(v));
  return v;
}

// Block b of rows m0..m0+MX-1 for RW tiles, added to sums[m][r]. The block's 8 lines of
// tile r are at lines[r] (8-bit values), or with Nibbles its 4 packed lines, unpacked in
// registers.
template <int MX, int RW, bool Nibbles>
inline void block_rows(const Job& job, const uint8_t* const* lines, int64_t b, int64_t m0,
                       const __m512* d, const __m512* mn, __m512 (*sums)[kTilesW]) {
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  __m512i acc[MX][RW];
  for (int m = 0; m < MX; ++m) {
    const __m512i start = _mm512_set1_epi32(job.offset * job.x.sums[(m0 + m) * blocks + b]);
    for (int r = 0; r < RW; ++r) acc[m][r] = start;
  }
  const int32_t* xw = job.x.words.data() + m0 * groups + b * kGroupsPerBlock;
  if constexpr (Nibbles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < kGroupsPerBlock / 2; ++j) {
      __m512i lo[RW], hi[RW];
      for (int r = 0; r < RW; ++r) {
        const __m512i v = opaque(_mm512_loadu_si512(lines[r] + j * kLine));
        lo[r] = _mm512_and_si512(v, low);
        hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int m = 0; m < MX; ++m) {
        const __m512i x0 = _mm512_set1_epi32(xw[m * groups + 2 * j]);
        const __m512i x1 = _mm512_set1_epi32(xw[m * groups + 2 * j + 1]);
        for (int r = 0; r < RW; ++r) {
          acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], lo[r], x0);
          acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], hi[r], x1);
        }
      }
    }
  } else {
    for (int g = 0; g < kGroupsPerBlock; ++g) {
      __m512i wv[RW];
      for (int r = 0; r < RW; ++r) wv[r] = opaque(_mm512_loadu_si512(lines[r] + g * kLine));
      for (int m = 0; m < MX; ++m) {
        const __m512i xv = _mm512_set1_epi32(xw[m * groups + g]);
        for (int r = 0; r < RW; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv[r], xv);
      }
    }
  }
  for (int m = 0; m < MX; ++m) {
    const __m512 t = _mm512_set1_ps(job.x.scales[(m0 + m) * blocks + b]);
    const __m512 p = _mm512_set1_ps(static_cast<float>(job.x.sums[(m0 + m) * blocks + b]));
    for (int r = 0; r < RW; ++r) {
      __m512 block = _mm512_mul_ps(d[r], _mm512_cvtepi32_ps(acc[m][r]));
      if (job.mins != nullptr) block = _mm512_fmadd_ps(mn[r], p, block);
      sums[m0 + m][r] = _mm512_fmadd_ps(block, t, sums[m0 + m][r]);
    }
  }
}

// Block b of every row for RW tiles: in groups of 4 rows, then the rest.
template <int RW, bool Nibbles>
inline void block_all_rows(const Job& job, const uint8_t* const* lines, int64_t b,
                           const __m512* d, const __m512* mn, __m512 (*sums)[kTilesW]) {
  int64_t m0 = 0;
  for (; m0 + kRowsX <= job.M; m0 += kRowsX) {
    block_rows<kRowsX, RW, Nibbles>(job, lines, b, m0, d, mn, sums);
  }
  switch (job.M - m0) {
    case 3: block_rows<3, RW, Nibbles>(job, lines, b, m0, d, mn, sums); break;
    case 2: block_rows<2, RW, Nibbles>(job, lines, b, m0, d, mn, sums); break;
    case 1: block_rows<1, RW, Nibbles>(job, lines, b, m0, d, mn, sums); break;
    default: break;
  }
}

inline __m512 load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Every row of output tiles t0..t0+RW-1.
template <int RW>
void tiles(const Job& job, int64_t t0) {
  const int64_t blocks = job.K / kBlock, block_bytes = job.block_bytes();
  __m512 sums[kMaxRows][kTilesW];
  for (int64_t m = 0; m < job.M; ++m)
    for (int r = 0; r < RW; ++r) sums[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 d[RW], mn[RW];
    const uint8_t* lines[RW];
    for (int r = 0; r < RW; ++r) {
      d[r] = load_half(job.d + job.at(t0 + r, b));
      mn[r] = job.mins != nullptr ? load_half(job.mins + job.at(t0 + r, b)) : d[r];
      lines[r] = job.w + (t0 + r) * job.tile_bytes() + b * block_bytes;
      // The same block of the next group of tiles (RW tiles on), its scales and minimums
      // (one 64-byte line per two blocks), into L2: 4 KB on in the tile's own stream left
      // the kernel waiting on the scales and on half of each group's tiles (6 rows 28%
      // slower, one row 17%).
      const uint8_t* ahead = lines[r] + RW * job.tile_bytes();
      for (int64_t i = 0; i < block_bytes; i += kLine) __builtin_prefetch(ahead + i, 0, 2);
      if (b % 2 == 0) {
        __builtin_prefetch(job.d + job.at(t0 + r + RW, b), 0, 2);
        if (job.mins != nullptr) __builtin_prefetch(job.mins + job.at(t0 + r + RW, b), 0, 2);
      }
    }
    if (job.bits == 4) {
      block_all_rows<RW, true>(job, lines, b, d, mn, sums);
    } else {
      block_all_rows<RW, false>(job, lines, b, d, mn, sums);
    }
  }
  for (int r = 0; r < RW; ++r)
    for (int64_t m = 0; m < job.M; ++m)
      _mm512_storeu_ps(job.y + m * job.N + (t0 + r) * kTile, sums[m][r]);
}

void run_chunk(const Job& job, int64_t chunk) {
  const int64_t begin = chunk * job.run_tiles;
  const int64_t end = std::min(job.N / kTile, begin + job.run_tiles);
  int64_t t0 = begin;
  for (; t0 + kTilesW <= end; t0 += kTilesW) tiles<kTilesW>(job, t0);
  for (; t0 < end; ++t0) tiles<1>(job, t0);
}
#else
// IEEE half to float (normal, subnormal, zero, infinity, NaN).
float half_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float v = exponent == 0    ? std::ldexp(static_cast<float>(mantissa), -24)
            : exponent == 31 ? (mantissa != 0 ? NAN : INFINITY)
                             : std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

void run_chunk(const Job& job, int64_t chunk) {
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  const int64_t end = std::min(job.N / kTile, (chunk + 1) * job.run_tiles);
  for (int64_t t = chunk * job.run_tiles; t < end; ++t) {
    const uint8_t* tile = job.w + t * job.tile_bytes();
    for (int64_t m = 0; m < job.M; ++m) {
      const int8_t* p = reinterpret_cast<const int8_t*>(job.x.words.data() + m * groups);
      float sums[kTile] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t sum_p = job.x.sums[m * blocks + b];
        int32_t block[kTile];
        std::fill(block, block + kTile, job.offset * sum_p);
        for (int64_t g = b * kGroupsPerBlock; g < (b + 1) * kGroupsPerBlock; ++g) {
          // Line g: its own 64 bytes (8-bit), or the low / high nibbles of line g / 2.
          const uint8_t* line = tile + (job.bits == 8 ? g : g / 2) * kLine;
          const int shift = job.bits == 8 ? 0 : 4 * (g % 2);
          const int mask = job.bits == 8 ? 0xFF : 0x0F;
          for (int64_t lane = 0; lane < kTile; ++lane) {
            for (int64_t j = 0; j < 4; ++j) {
              block[lane] += ((line[lane * 4 + j] >> shift) & mask) * int32_t{p[g * 4 + j]};
            }
          }
        }
        const float scale = job.x.scales[m * blocks + b];
        for (int64_t lane = 0; lane < kTile; ++lane) {
          float value = half_to_float(job.d[job.at(t, b) + lane]) * static_cast<float>(block[lane]);
          if (job.mins != nullptr) {
            value += half_to_float(job.mins[job.at(t, b) + lane]) * static_cast<float>(sum_p);
          }
          sums[lane] += value * scale;
        }
      }
      std::copy(sums, sums + kTile, job.y + m * job.N + t * kTile);
    }
  }
}
#endif

ffi::Error block_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> mins,
                        ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> residual,
                        ffi::ResultBuffer<ffi::F32> y, int32_t prologue, float eps,
                        int32_t offset, int32_t bits) {
  const auto xd = x.dimensions(), wd = w.dimensions(), dd = d.dimensions();
  const auto yd = y->dimensions();
  const bool packed = (bits == 4 || bits == 8) && wd.size() == 4 && wd[2] == kTile && wd[3] == 4;
  const int64_t N = packed ? wd[0] * kTile : 0, K = packed ? wd[1] * 32 / bits : 0;
  const int64_t width = prologue == kSiluGate ? 2 * K : K;
  const bool scales = dd.size() == 3 && dd[0] == N / kTile && dd[1] == K / kBlock &&
                      dd[2] == kTile;
  const auto md = mins.dimensions();
  const bool minimums = mins.element_count() == 0 ||
                        (md.size() == 3 && md[0] == dd[0] && md[1] == dd[1] && md[2] == dd[2]);
  if (!packed || K == 0 || K % kBlock != 0 || !scales || !minimums || xd.size() != 2 ||
      xd[1] != width || yd.size() != 2 || yd[0] != xd[0] || yd[1] != N ||
      prologue < kPlain || prologue > kSiluGate ||
      (prologue == kRmsNorm && scale.element_count() != K) ||
      (residual.element_count() != 0 && residual.element_count() != xd[0] * N)) {
    return ffi::Error::InvalidArgument(
        "block_matmul: expected bits 4 or 8, x [M,K] ([M,2K] for silu(gate) * up), "
        "packed [N/16,K/8,16,4] (4 bits) or [N/16,K/4,16,4] (8 bits) with K % 32 == 0, "
        "scales float16 [N/16,K/32,16], mins the same or empty, y [M,N], a norm scale [K] "
        "with the RMS norm, and a residual [M,N] or none");
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
    job->d = d.typed_data();
    job->mins = mins.element_count() != 0 ? mins.typed_data() : nullptr;
    job->x = quantize_rows(a + m0 * K, rows_in_block, K);
    job->y = y->typed_data() + m0 * N;
    job->M = rows_in_block;
    job->K = K;
    job->N = N;
    job->offset = offset;
    job->bits = bits;
    job->run_tiles = tiles_per_run(N / kTile, pool.num_threads());
    parallel_tasks(pool, (N / kTile + job->run_tiles - 1) / job->run_tiles, [job] {
      return [job](int64_t chunk) { run_chunk(*job, chunk); };
    });
  }
  if (residual.element_count() != 0) add_residual(y->typed_data(), residual.typed_data(), M * N);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglejaxBlockMatmul, block_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("offset")
                                  .Attr<int32_t>("bits"));
