// y[M,N] = x[M,K] . W[N,K]^T for a few rows M with W in GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K,
// Q6_K) and x quantized to int8 in blocks of 32 (eaglejax/models/gguf_blocks.py has the
// format):
//   y[m,n] = sum_b t[m,b] * (sum_{s in b} d[n,s] * S[m,n,s] + mn[n,b] * sum_{k in b} p[m,k]),
//   S[m,n,s] = sum_{k in s} (q[n,k] + offset) p[m,k]   (an integer, exact),
// over sub-blocks s of 32 (one per block) or 16 (Q6_K); offset -8 (Q4_0), 0 (Q4_1, Q4_K),
// -128 (Q8_0, stored q + 128) or -32 (Q6_K); the minimum term only where the kind has
// minimums. d and mn are the file's float16 values, or for a K-quant formed per block from
// its float16 super-scales and integer sub-scales: d = D * sc and mn = -(Dmin * m) (Q4_K),
// d = D * sc (Q6_K), each exact in float32.
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
// 6-bit values (Q6_K): per block its low 4 bits as 4 lines of nibbles, then its high 2 bits
// in 2 lines (groups 4i..4i+3 of the block in line i at bits 0, 2, 4, 6): packed
// [N/16, 6K/32, 16, 4]; each half of a block (a sub-block of 16) is summed on its own.
// Scales d and minimums mn: float16 [N/16, K/32, 16] (one 16-lane vector per tile and
// block); for Q4_K uint8 sc and m [N/16, K/32, 16] and float16 supers (D, Dmin)
// [N/16, K/256, 2, 16]; for Q6_K int8 sc [N/16, K/16, 16] and supers (D) [N/16, K/256, 1, 16].
// A (sub-)block's integer sums start at offset * sum(p), its float32 sum is
// d * S (+ mn * sum(p)), scaled by t and added to the row's sums in block order; every
// row is summed in the same order whatever M is, so a verify block reproduces the
// single-token step bit for bit. Without VNNI the same sums run in plain loops. Threads,
// prologues and the residual are as in int8_matmul.cc.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
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

// How a kind keeps its scales (the dtype of its scales tells them apart).
enum Scales { kHalves, kQ4K, kQ6K };

constexpr int64_t kSuper = 256;  // weights per super-block of a K-quant

struct Job {
  const uint8_t* w;       // [N/16, K bits/32, 16, 4]
  const void* d;          // float16, or a K-quant's integer sub-scales
  const void* mins;       // float16 or Q4_K's uint8, or null
  const uint16_t* supers;  // a K-quant's float16 super-scales, or null
  QuantizedX x;
  float* y;
  int64_t M, K, N, run_tiles;
  int32_t offset, bits;
  Scales scales;

  int64_t block_bytes() const { return kBlock * kTile * bits / 8; }  // one tile's block
  int64_t tile_bytes() const { return K / kBlock * block_bytes(); }
  int64_t at(int64_t tile, int64_t b) const { return (tile * (K / kBlock) + b) * kTile; }
  // The first of tile t's 16 sub-scales of Q6_K's sub-block s of 16.
  int64_t at16(int64_t tile, int64_t s) const { return (tile * (K / 16) + s) * kTile; }
  // Tile t's super-scales of the super-block holding block b (c per super-block).
  const uint16_t* super(int64_t tile, int64_t b, int64_t c) const {
    return supers + (tile * (K / kSuper) + b * kBlock / kSuper) * c * kTile;
  }
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

// Groups 4h + 2J and 4h + 2J + 1 of 6-bit values (half h of a block) for RW tiles: the
// low nibbles of nibble line 2h + J and high ones, each under its 2 high bits from crumb
// line 4 + h (bits 4J and 4J + 2), multiplied by MX rows' x words into acc.
template <int MX, int RW, int J>
inline void six_bit_groups(const uint8_t* const* lines, int h, const int32_t* xw,
                           int64_t groups, __m512i (*acc)[RW]) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  __m512i g0[RW], g1[RW];
  for (int r = 0; r < RW; ++r) {
    const __m512i v = opaque(_mm512_loadu_si512(lines[r] + (2 * h + J) * kLine));
    const __m512i c = opaque(_mm512_loadu_si512(lines[r] + (4 + h) * kLine));
    // the 2 bits of group 2J + e at bits 4-5: shifted left 4 - 2(2J + e) (16-bit shifts:
    // what crosses a byte falls outside the mask)
    const __m512i c0 = J == 0 ? _mm512_slli_epi16(c, 4) : c;
    const __m512i c1 = J == 0 ? _mm512_slli_epi16(c, 2) : _mm512_srli_epi16(c, 2);
    g0[r] = _mm512_or_si512(_mm512_and_si512(v, low), _mm512_and_si512(c0, top));
    g1[r] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                            _mm512_and_si512(c1, top));
  }
  for (int m = 0; m < MX; ++m) {
    const __m512i x0 = _mm512_set1_epi32(xw[m * groups + 4 * h + 2 * J]);
    const __m512i x1 = _mm512_set1_epi32(xw[m * groups + 4 * h + 2 * J + 1]);
    for (int r = 0; r < RW; ++r) {
      acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], g0[r], x0);
      acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], g1[r], x1);
    }
  }
}

// Block b of rows m0..m0+MX-1 for RW tiles of 6-bit values (Q6_K), added to sums[m][r]:
// each half (a sub-block of 16, its scale d[h][r]) summed and scaled on its own.
template <int MX, int RW>
inline void six_bit_rows(const Job& job, const uint8_t* const* lines, int64_t b, int64_t m0,
                         const __m512* d0, const __m512* d1, __m512 (*sums)[kTilesW]) {
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  const int32_t* xw = job.x.words.data() + m0 * groups + b * kGroupsPerBlock;
  for (int h = 0; h < 2; ++h) {
    __m512i acc[MX][RW];
    for (int m = 0; m < MX; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      const int32_t half = h == 0 ? job.x.halves[at] : job.x.sums[at] - job.x.halves[at];
      for (int r = 0; r < RW; ++r) acc[m][r] = _mm512_set1_epi32(job.offset * half);
    }
    six_bit_groups<MX, RW, 0>(lines, h, xw, groups, acc);
    six_bit_groups<MX, RW, 1>(lines, h, xw, groups, acc);
    const __m512* d = h == 0 ? d0 : d1;
    for (int m = 0; m < MX; ++m) {
      const __m512 t = _mm512_set1_ps(job.x.scales[(m0 + m) * blocks + b]);
      for (int r = 0; r < RW; ++r) {
        const __m512 block = _mm512_mul_ps(d[r], _mm512_cvtepi32_ps(acc[m][r]));
        sums[m0 + m][r] = _mm512_fmadd_ps(block, t, sums[m0 + m][r]);
      }
    }
  }
}

// Block b of rows m0..m0+MX-1 for RW tiles, added to sums[m][r]. The block's 8 lines of
// tile r are at lines[r] (8-bit values), or with 4 bits its 4 packed lines, unpacked in
// registers; 6 bits go to six_bit_rows (mn is then the second half's scale).
template <int MX, int RW, int Bits>
inline void block_rows(const Job& job, const uint8_t* const* lines, int64_t b, int64_t m0,
                       const __m512* d, const __m512* mn, __m512 (*sums)[kTilesW]) {
  if constexpr (Bits == 6) {
    six_bit_rows<MX, RW>(job, lines, b, m0, d, mn, sums);
    return;
  }
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  __m512i acc[MX][RW];
  for (int m = 0; m < MX; ++m) {
    const __m512i start = _mm512_set1_epi32(job.offset * job.x.sums[(m0 + m) * blocks + b]);
    for (int r = 0; r < RW; ++r) acc[m][r] = start;
  }
  const int32_t* xw = job.x.words.data() + m0 * groups + b * kGroupsPerBlock;
  if constexpr (Bits == 4) {
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
template <int RW, int Bits>
inline void block_all_rows(const Job& job, const uint8_t* const* lines, int64_t b,
                           const __m512* d, const __m512* mn, __m512 (*sums)[kTilesW]) {
  int64_t m0 = 0;
  for (; m0 + kRowsX <= job.M; m0 += kRowsX) {
    block_rows<kRowsX, RW, Bits>(job, lines, b, m0, d, mn, sums);
  }
  switch (job.M - m0) {
    case 3: block_rows<3, RW, Bits>(job, lines, b, m0, d, mn, sums); break;
    case 2: block_rows<2, RW, Bits>(job, lines, b, m0, d, mn, sums); break;
    case 1: block_rows<1, RW, Bits>(job, lines, b, m0, d, mn, sums); break;
    default: break;
  }
}

inline __m512 load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load_s8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Tile t's scales of block b: d and mn (Q4_0, Q4_1, Q8_0, Q4_K; mn = d without minimums),
// or Q6_K's two sub-block scales; `supers`: a K-quant's super-scales of the block (D, and
// Dmin for Q4_K), loaded once per super-block. The kind is a template argument: the file
// kinds' blocks run the loop they ran before K-quants (a kind chosen per block cost the
// default model's Q4_1 steps 6-8%, session 36).
template <Scales S>
inline void block_scales(const Job& job, int64_t t, int64_t b, const __m512* supers,
                         __m512* d, __m512* mn) {
  if constexpr (S == kHalves) {
    const auto* halves = static_cast<const uint16_t*>(job.d);
    *d = load_half(halves + job.at(t, b));
    *mn = job.mins != nullptr
              ? load_half(static_cast<const uint16_t*>(job.mins) + job.at(t, b)) : *d;
  } else if constexpr (S == kQ4K) {
    *d = _mm512_mul_ps(supers[0], load_u8(static_cast<const uint8_t*>(job.d) + job.at(t, b)));
    *mn = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(
        supers[1], load_u8(static_cast<const uint8_t*>(job.mins) + job.at(t, b))));
  } else {
    const auto* sc = static_cast<const int8_t*>(job.d);
    *d = _mm512_mul_ps(supers[0], load_s8(sc + job.at16(t, 2 * b)));
    *mn = _mm512_mul_ps(supers[0], load_s8(sc + job.at16(t, 2 * b + 1)));
  }
}

// The scales of tile t's block b (and its super-scales at a super-block's start) into L2.
template <Scales S>
inline void prefetch_scales(const Job& job, int64_t t, int64_t b) {
  constexpr int64_t bytes = S == kHalves ? 2 : 1;  // (past the last tile: a harmless hint)
  const int64_t at = S == kQ6K ? job.at16(t, 2 * b) : job.at(t, b);
  __builtin_prefetch(static_cast<const uint8_t*>(job.d) + at * bytes, 0, 2);
  if (job.mins != nullptr) __builtin_prefetch(static_cast<const uint8_t*>(job.mins) + at * bytes, 0, 2);
  if constexpr (S != kHalves) {
    if (b % (kSuper / kBlock) == 0) __builtin_prefetch(job.super(t, b, S == kQ4K ? 2 : 1), 0, 2);
  }
}

// Every row of output tiles t0..t0+RW-1, scales kept as S says.
template <int RW, Scales S>
void tiles(const Job& job, int64_t t0) {
  const int64_t blocks = job.K / kBlock, block_bytes = job.block_bytes();
  __m512 sums[kMaxRows][kTilesW];
  for (int64_t m = 0; m < job.M; ++m)
    for (int r = 0; r < RW; ++r) sums[m][r] = _mm512_setzero_ps();
  constexpr int64_t per_super = S == kQ4K ? 2 : 1;
  __m512 supers[RW][2];
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 d[RW], mn[RW];
    const uint8_t* lines[RW];
    for (int r = 0; r < RW; ++r) {
      if constexpr (S != kHalves) {
        if (b % (kSuper / kBlock) == 0) {
          for (int64_t c = 0; c < per_super; ++c) {
            supers[r][c] = load_half(job.super(t0 + r, b, per_super) + c * kTile);
          }
        }
      }
      block_scales<S>(job, t0 + r, b, supers[r], &d[r], &mn[r]);
      lines[r] = job.w + (t0 + r) * job.tile_bytes() + b * block_bytes;
      // The same block of the next group of tiles (RW tiles on), its scales and minimums
      // (one 64-byte line per two blocks), into L2: 4 KB on in the tile's own stream left
      // the kernel waiting on the scales and on half of each group's tiles (6 rows 28%
      // slower, one row 17%).
      const uint8_t* ahead = lines[r] + RW * job.tile_bytes();
      for (int64_t i = 0; i < block_bytes; i += kLine) __builtin_prefetch(ahead + i, 0, 2);
      if (b % 2 == 0) prefetch_scales<S>(job, t0 + r + RW, b);
    }
    if constexpr (S == kQ6K) {
      block_all_rows<RW, 6>(job, lines, b, d, mn, sums);
    } else if (S == kQ4K || job.bits == 4) {
      block_all_rows<RW, 4>(job, lines, b, d, mn, sums);
    } else {
      block_all_rows<RW, 8>(job, lines, b, d, mn, sums);
    }
  }
  for (int r = 0; r < RW; ++r)
    for (int64_t m = 0; m < job.M; ++m)
      _mm512_storeu_ps(job.y + m * job.N + (t0 + r) * kTile, sums[m][r]);
}

template <Scales S>
void run_tiles(const Job& job, int64_t chunk) {
  const int64_t begin = chunk * job.run_tiles;
  const int64_t end = std::min(job.N / kTile, begin + job.run_tiles);
  int64_t t0 = begin;
  for (; t0 + kTilesW <= end; t0 += kTilesW) tiles<kTilesW, S>(job, t0);
  for (; t0 < end; ++t0) tiles<1, S>(job, t0);
}

void run_chunk(const Job& job, int64_t chunk) {
  switch (job.scales) {
    case kHalves: run_tiles<kHalves>(job, chunk); break;
    case kQ4K: run_tiles<kQ4K>(job, chunk); break;
    case kQ6K: run_tiles<kQ6K>(job, chunk); break;
  }
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

// Stored value j of group g (4 consecutive k) of lane `lane` in a tile's bytes.
int32_t stored_value(const Job& job, const uint8_t* tile, int64_t g, int64_t lane, int64_t j) {
  const int64_t at = lane * 4 + j;
  if (job.bits == 8) return tile[g * kLine + at];
  if (job.bits == 4) return (tile[g / 2 * kLine + at] >> (4 * (g % 2))) & 0x0F;
  const uint8_t* block = tile + g / kGroupsPerBlock * 6 * kLine;  // 6 bits
  const int64_t i = g % kGroupsPerBlock;
  return ((block[i / 2 * kLine + at] >> (4 * (i % 2))) & 0x0F) |
         (((block[(4 + i / 4) * kLine + at] >> (2 * (i % 4))) & 0x03) << 4);
}

// Lane `lane` of tile t's block b: the scales of its sub-blocks (d[1] = d[0] but for Q6_K)
// and its minimum (0 without).
void lane_scales(const Job& job, int64_t t, int64_t b, int64_t lane, float* d, float* mn) {
  *mn = 0.0f;
  if (job.scales == kHalves) {
    d[0] = d[1] = half_to_float(static_cast<const uint16_t*>(job.d)[job.at(t, b) + lane]);
    if (job.mins != nullptr) {
      *mn = half_to_float(static_cast<const uint16_t*>(job.mins)[job.at(t, b) + lane]);
    }
  } else if (job.scales == kQ4K) {
    const uint16_t* super = job.super(t, b, 2);
    d[0] = d[1] = half_to_float(super[lane]) *
                  static_cast<float>(static_cast<const uint8_t*>(job.d)[job.at(t, b) + lane]);
    *mn = -(half_to_float(super[kTile + lane]) *
            static_cast<float>(static_cast<const uint8_t*>(job.mins)[job.at(t, b) + lane]));
  } else {
    const float super = half_to_float(job.super(t, b, 1)[lane]);
    const auto* sc = static_cast<const int8_t*>(job.d);
    d[0] = super * static_cast<float>(sc[job.at16(t, 2 * b) + lane]);
    d[1] = super * static_cast<float>(sc[job.at16(t, 2 * b + 1) + lane]);
  }
}

void run_chunk(const Job& job, int64_t chunk) {
  const int64_t groups = job.K / 4, blocks = job.K / kBlock;
  const int64_t subs = job.bits == 6 ? 2 : 1, sub_groups = kGroupsPerBlock / subs;
  const int64_t end = std::min(job.N / kTile, (chunk + 1) * job.run_tiles);
  for (int64_t t = chunk * job.run_tiles; t < end; ++t) {
    const uint8_t* tile = job.w + t * job.tile_bytes();
    for (int64_t m = 0; m < job.M; ++m) {
      const int8_t* p = reinterpret_cast<const int8_t*>(job.x.words.data() + m * groups);
      float sums[kTile] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t sum_p = job.x.sums[m * blocks + b], half = job.x.halves[m * blocks + b];
        const float scale = job.x.scales[m * blocks + b];
        for (int64_t s = 0; s < subs; ++s) {
          const int32_t sub_p = subs == 1 ? sum_p : s == 0 ? half : sum_p - half;
          int32_t block[kTile];
          std::fill(block, block + kTile, job.offset * sub_p);
          const int64_t g0 = b * kGroupsPerBlock + s * sub_groups;
          for (int64_t g = g0; g < g0 + sub_groups; ++g) {
            for (int64_t lane = 0; lane < kTile; ++lane) {
              for (int64_t j = 0; j < 4; ++j) {
                block[lane] += stored_value(job, tile, g, lane, j) * int32_t{p[g * 4 + j]};
              }
            }
          }
          for (int64_t lane = 0; lane < kTile; ++lane) {
            float d[2], mn;
            lane_scales(job, t, b, lane, d, &mn);
            float value = d[s] * static_cast<float>(block[lane]);
            if (job.mins != nullptr) value += mn * static_cast<float>(sum_p);
            sums[lane] += value * scale;
          }
        }
      }
      std::copy(sums, sums + kTile, job.y + m * job.N + t * kTile);
    }
  }
}
#endif

// Whether `a` has the dims `want` (a tile's scales, minimums or supers).
bool has_dims(const ffi::AnyBuffer& a, std::initializer_list<int64_t> want) {
  const auto dims = a.dimensions();
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

// The way the arrays keep the scales, from their dtypes and shapes (false: malformed).
bool scales_of(const ffi::AnyBuffer& d, const ffi::AnyBuffer& mins,
               const ffi::AnyBuffer& supers, int64_t N, int64_t K, int32_t bits,
               Scales* kind) {
  const int64_t T = N / kTile;
  const bool no_mins = mins.element_count() == 0, no_supers = supers.element_count() == 0;
  switch (d.element_type()) {
    case ffi::DataType::F16:
      *kind = kHalves;
      return (bits == 4 || bits == 8) && has_dims(d, {T, K / kBlock, kTile}) && no_supers &&
             (no_mins || (mins.element_type() == ffi::DataType::F16 &&
                          has_dims(mins, {T, K / kBlock, kTile})));
    case ffi::DataType::U8:
      *kind = kQ4K;
      return bits == 4 && K % kSuper == 0 && has_dims(d, {T, K / kBlock, kTile}) &&
             mins.element_type() == ffi::DataType::U8 &&
             has_dims(mins, {T, K / kBlock, kTile}) &&
             supers.element_type() == ffi::DataType::F16 &&
             has_dims(supers, {T, K / kSuper, 2, kTile});
    case ffi::DataType::S8:
      *kind = kQ6K;
      return bits == 6 && K % kSuper == 0 && has_dims(d, {T, K / 16, kTile}) && no_mins &&
             supers.element_type() == ffi::DataType::F16 &&
             has_dims(supers, {T, K / kSuper, 1, kTile});
    default:
      return false;
  }
}

ffi::Error block_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::AnyBuffer d, ffi::AnyBuffer mins, ffi::AnyBuffer supers,
                        ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> residual,
                        ffi::ResultBuffer<ffi::F32> y, int32_t prologue, float eps,
                        int32_t offset, int32_t bits) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const auto yd = y->dimensions();
  const bool packed = (bits == 4 || bits == 6 || bits == 8) && wd.size() == 4 &&
                      wd[1] * 32 % bits == 0 && wd[2] == kTile && wd[3] == 4;
  const int64_t N = packed ? wd[0] * kTile : 0, K = packed ? wd[1] * 32 / bits : 0;
  const int64_t width = prologue == kSiluGate ? 2 * K : K;
  Scales kind = kHalves;
  if (!packed || K == 0 || K % kBlock != 0 || !scales_of(d, mins, supers, N, K, bits, &kind) ||
      xd.size() != 2 || xd[1] != width || yd.size() != 2 || yd[0] != xd[0] || yd[1] != N ||
      prologue < kPlain || prologue > kSiluGate ||
      (prologue == kRmsNorm && scale.element_count() != K) ||
      (residual.element_count() != 0 && residual.element_count() != xd[0] * N)) {
    return ffi::Error::InvalidArgument(
        "block_matmul: expected bits 4, 6 or 8, x [M,K] ([M,2K] for silu(gate) * up), "
        "packed [N/16,K bits/32,16,4] with K % 32 == 0, scales float16 [N/16,K/32,16] "
        "with mins the same or empty and no supers, or K-quant scales (Q4_K: uint8 "
        "[N/16,K/32,16], mins the same, supers float16 [N/16,K/256,2,16]; Q6_K: int8 "
        "[N/16,K/16,16], no mins, supers [N/16,K/256,1,16]), y [M,N], a norm scale [K] "
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
    job->d = d.untyped_data();
    job->mins = mins.element_count() != 0 ? mins.untyped_data() : nullptr;
    job->supers = supers.element_count() != 0
                      ? static_cast<const uint16_t*>(supers.untyped_data()) : nullptr;
    job->x = quantize_rows(a + m0 * K, rows_in_block, K);
    job->y = y->typed_data() + m0 * N;
    job->M = rows_in_block;
    job->K = K;
    job->N = N;
    job->offset = offset;
    job->bits = bits;
    job->scales = kind;
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("prologue")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("offset")
                                  .Attr<int32_t>("bits"));
