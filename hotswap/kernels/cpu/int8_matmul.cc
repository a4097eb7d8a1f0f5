// y_i[M, N_i] = x[M, K] @ W_i for int8 weights W_i[k, n] = data_i[k, n] * scales_i[k / (K / G_i), n]
// in f32, on XLA's intra-op threads (hotswap/kernels/cpu_int8.py).
//
// Why: a decode step reads every weight once, so int8 weights are a quarter of f32's bytes and
// half of bf16's; the step's time is those bytes over DRAM's bandwidth up to ~16 rows. The
// kernel reads the int8 data in place and widens it in registers: no dequantized copy of a
// weight is ever written (the VNNI path repacks one L2-sized block of it, still int8).
//
// Layout: row-major x [M, K], data [K, N] (int8, `[in, out]` as x @ W), scales [G, N] (f32; G == 1
// is one scale per column), y [M, N]. Group g covers rows [g * K / G, (g + 1) * K / G).
//
// Paths (`isa.h`), picked per call from the FFI attribute `isa`:
//   - avx512 / avx2: register tiles over rows as in small_matmul.cc: each widened w vector is
//     multiplied into MR rows of x held as broadcasts. A tile sums a group's rows in f32
//     (`part`) and adds scale * part to its result at the group's end: one FMA per row and
//     vector a group, not a multiply per weight.
//   - avx512_vnni: x is quantized per row and group to int8 (symmetric, round to nearest, then
//     + 128: vpdpbusd multiplies u8 by s8) and each block of w is repacked to 4 consecutive k of
//     a column in each 32-bit lane, with the block's column sums (the + 128 comes back off as
//     128 * colsum). vpdpbusd does 64 multiply-adds an instruction against 16 for the f32 FMA, so
//     it pays from ~16 rows (prefill); it changes results (x is rounded to 8 bits), so it runs
//     only where the caller passes exact = 0.
//   - avx_vnni: the same on AVX2 CPUs with AVX-VNNI (vpdpbusd on ymm): the avx2 path's tiles, 8
//     lanes, the same quantized x, packing and column sums; 32 multiply-adds an instruction
//     against 8 for avx2's f32 FMA.
//   - scalar: plain loops, for a CPU with neither and as the tests' reference path.
// 1-2 rows split K over the threads (each streams whole weight rows: the GEMV of small_matmul);
// more rows split the columns. Weights sharing x (q/k/v, gate/up) share one parallel region.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "isa.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using hotswap::Isa;

// Bytes of w per k-block: the block sits in L2 while the next one is prefetched.
constexpr int64_t kSlabBytes = 256 << 10;
constexpr int64_t kMaxKB = 256;
// Rows from which "auto" takes the VNNI path when exact = 0 (below it reading w is the bound,
// and the f32 tile is as fast and exact).
constexpr int64_t kVnniRows = 16;
int64_t MaxWidth(int64_t M) { return M <= 8 ? 2048 : 1024; }
int64_t MinKB(int64_t M) { return M <= 8 ? 32 : 64; }

// Prefetches a run of weight row segments into L2, a few lines per call, spread over the
// compute of the block before it (as small_matmul.cc).
struct Prefetch {
  const char* row;
  int64_t stride, lines_per_row, rows_left, line = 0, per_step = 0;  // stride in bytes
  inline void Step() {
    for (int64_t i = 0; i < per_step && rows_left > 0; ++i) {
      _mm_prefetch(row + line * 64, _MM_HINT_T1);
      if (++line == lines_per_row) line = 0, row += stride, --rows_left;
    }
  }
};

// One tile call: rows [0, MR) of x from `x` (f32) or `xq` (VNNI: u8, + 128), a block of kn rows
// of w starting at absolute row k0, the panel's scales and (VNNI) its block's column sums.
struct TileArgs {
  const float* x;  // x at (tile's first row, block's first k); row stride ldx
  const uint8_t* xq;
  const float* sx;  // VNNI: x's scale per (row, group); row stride ldsx
  int64_t ldx, ldsx;
  const int8_t* w;  // f32 paths: data at (block's first k, panel's first column), row stride ldw;
  int64_t ldw;      // VNNI: the packed panel, ldw bytes per 4 k
  const float* s;   // scales at (group 0, panel's first column), row stride lds
  int64_t lds;
  const int32_t* cs;  // VNNI: column sums of the block's segments, row stride ldcs
  int64_t ldcs;
  int64_t k0, kn, gl;  // the block's first absolute k, its rows, the group length
  float* c;
  int64_t ldc;
  bool first;  // c is written, not added to
};
using TileFn = void (*)(const TileArgs&, Prefetch&);
using GemvFn = void (*)(const float*, int64_t, const int8_t*, int64_t, int64_t, const float*, int64_t, int64_t,
                        int64_t, float*, float*);

// The end (relative to the block) of the segment that starts at block row k: the block cut at
// group boundaries. Every group's partial sum is scaled where its segment ends.
inline int64_t SegmentEnd(const TileArgs& a, int64_t k) {
  return std::min(a.kn, ((a.k0 + k) / a.gl + 1) * a.gl - a.k0);
}

// The GEMV's prefetch distance: the bytes of whole 4-row steps ~16 KB ahead. Each 16 columns of
// a step (64 bytes read) prefetch the line of the step that far ahead into L2: on one Zen 4 core
// (2 cores busy with other work) a long weight streamed at 11-12 GB/s on the hardware
// prefetchers alone, 17-18 with this (8 KB ahead: 16.6, 32 KB: 16.5-17.7, into L1: 11-12).
inline int64_t kGemvAhead(int64_t N) { return (16384 + 4 * N - 1) / (4 * N) * 4 * N; }

// 1-2 rows (GEMV): c[R, 0:cols] (row stride N) = x[:, k0:k1] @ W[k0:k1, 0:cols], streaming whole
// weight rows 4 at a time (contiguous runs: what the prefetchers stream best) into a group's
// partial sums `part` [R, cols] (L1/L2), added to c times the group's scales at its end.
template <int R>
HOTSWAP_TARGET_AVX512 void GemvAvx512(const float* x, int64_t K, const int8_t* w, int64_t N, int64_t cols,
                                      const float* s, int64_t gl, int64_t k0, int64_t k1, float* c, float* part) {
  for (int r = 0; r < R; ++r) std::fill(c + r * N, c + r * N + cols, 0.0f);
  const int64_t ahead = kGemvAhead(N);
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / gl, end = std::min(k1, (g + 1) * gl);
    std::fill(part, part + R * cols, 0.0f);
    for (int64_t rows; k < end; k += rows) {
      rows = std::min<int64_t>(4, end - k);  // 1-3 at a group's or range's end
      __m512 b[R][4];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) b[r][i] = _mm512_set1_ps(i < rows ? x[r * K + k + i] : 0.0f);
      const int8_t* wk = w + k * N;
      int64_t at[4];  // each row's offset; past `rows`, row k again, times a zero x
      for (int i = 0; i < 4; ++i) at[i] = i < rows ? i * N : 0;
      for (int64_t n = 0; n < cols; n += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + ahead + 4 * n), _MM_HINT_T1);
        __m512 wv[4];
        for (int i = 0; i < 4; ++i)
          wv[i] = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + at[i] + n))));
        for (int r = 0; r < R; ++r) {
          __m512 p = _mm512_loadu_ps(part + r * cols + n);
          for (int i = 0; i < 4; ++i) p = _mm512_fmadd_ps(b[r][i], wv[i], p);
          _mm512_storeu_ps(part + r * cols + n, p);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t n = 0; n < cols; n += 16) {
        float* cr = c + r * N + n;
        _mm512_storeu_ps(cr, _mm512_fmadd_ps(_mm512_loadu_ps(part + r * cols + n), _mm512_loadu_ps(s + g * N + n),
                                             _mm512_loadu_ps(cr)));
      }
  }
}

template <int R>
HOTSWAP_TARGET_AVX2 void GemvAvx2(const float* x, int64_t K, const int8_t* w, int64_t N, int64_t cols,
                                  const float* s, int64_t gl, int64_t k0, int64_t k1, float* c, float* part) {
  for (int r = 0; r < R; ++r) std::fill(c + r * N, c + r * N + cols, 0.0f);
  const int64_t ahead = kGemvAhead(N);
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / gl, end = std::min(k1, (g + 1) * gl);
    std::fill(part, part + R * cols, 0.0f);
    for (int64_t rows; k < end; k += rows) {
      rows = std::min<int64_t>(4, end - k);
      __m256 b[R][4];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) b[r][i] = _mm256_set1_ps(i < rows ? x[r * K + k + i] : 0.0f);
      const int8_t* wk = w + k * N;
      int64_t at[4];  // each row's offset; past `rows`, row k again, times a zero x
      for (int i = 0; i < 4; ++i) at[i] = i < rows ? i * N : 0;
      for (int64_t n = 0; n < cols; n += 8) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + ahead + 4 * n), _MM_HINT_T1);
        __m256 wv[4];
        for (int i = 0; i < 4; ++i)
          wv[i] = _mm256_cvtepi32_ps(
              _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk + at[i] + n))));
        for (int r = 0; r < R; ++r) {
          __m256 p = _mm256_loadu_ps(part + r * cols + n);
          for (int i = 0; i < 4; ++i) p = _mm256_fmadd_ps(b[r][i], wv[i], p);
          _mm256_storeu_ps(part + r * cols + n, p);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t n = 0; n < cols; n += 8) {
        float* cr = c + r * N + n;
        _mm256_storeu_ps(cr, _mm256_fmadd_ps(_mm256_loadu_ps(part + r * cols + n), _mm256_loadu_ps(s + g * N + n),
                                             _mm256_loadu_ps(cr)));
      }
  }
}

// AVX-512: 16 lanes; a tile of MR rows x V zmm holds 2 * MR * V accumulators (the result and a
// group's partial sum), V widened w vectors and a broadcast in the 32 registers: 6 x 2 (27), and
// up to 2 rows 4 wide (a whole 64-byte line of int8 each k).
struct Avx512 {
  static constexpr int kLanes = 16, kMR = 6, kV = 2, kMRWide = 2, kVWide = 4, kStep = 1;
  static constexpr GemvFn kGemv[3] = {nullptr, GemvAvx512<1>, GemvAvx512<2>};
  template <int MR, int V>
  HOTSWAP_TARGET_AVX512 static void Tile(const TileArgs& a, Prefetch& pf) {
    __m512 acc[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = a.first ? _mm512_setzero_ps() : _mm512_loadu_ps(a.c + r * a.ldc + 16 * j);
    Prefetch p = pf;
    const int8_t* w = a.w;
    for (int64_t k = 0; k < a.kn;) {
      const int64_t g = (a.k0 + k) / a.gl, end = SegmentEnd(a, k);
      __m512 part[MR][V];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < V; ++j) part[r][j] = _mm512_setzero_ps();
      for (; k < end; ++k, w += a.ldw) {
        p.Step();
        __m512 wv[V];
        for (int j = 0; j < V; ++j)
          wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j))));
        for (int r = 0; r < MR; ++r) {
          const __m512 b = _mm512_set1_ps(a.x[r * a.ldx + k]);
          for (int j = 0; j < V; ++j) part[r][j] = _mm512_fmadd_ps(b, wv[j], part[r][j]);
        }
      }
      for (int j = 0; j < V; ++j) {
        const __m512 sv = _mm512_loadu_ps(a.s + g * a.lds + 16 * j);
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_fmadd_ps(part[r][j], sv, acc[r][j]);
      }
    }
    pf = p;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) _mm512_storeu_ps(a.c + r * a.ldc + 16 * j, acc[r][j]);
  }
};

// AVX2 + FMA: 8 lanes, 16 ymm registers: 3 rows x 2 ymm (12 accumulators, 2 w, a broadcast), and
// one row 4 wide.
struct Avx2 {
  static constexpr int kLanes = 8, kMR = 3, kV = 2, kMRWide = 1, kVWide = 4, kStep = 1;
  static constexpr GemvFn kGemv[3] = {nullptr, GemvAvx2<1>, GemvAvx2<2>};
  template <int MR, int V>
  HOTSWAP_TARGET_AVX2 static void Tile(const TileArgs& a, Prefetch& pf) {
    __m256 acc[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = a.first ? _mm256_setzero_ps() : _mm256_loadu_ps(a.c + r * a.ldc + 8 * j);
    Prefetch p = pf;
    const int8_t* w = a.w;
    for (int64_t k = 0; k < a.kn;) {
      const int64_t g = (a.k0 + k) / a.gl, end = SegmentEnd(a, k);
      __m256 part[MR][V];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < V; ++j) part[r][j] = _mm256_setzero_ps();
      for (; k < end; ++k, w += a.ldw) {
        p.Step();
        __m256 wv[V];
        for (int j = 0; j < V; ++j)
          wv[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * j))));
        for (int r = 0; r < MR; ++r) {
          const __m256 b = _mm256_set1_ps(a.x[r * a.ldx + k]);
          for (int j = 0; j < V; ++j) part[r][j] = _mm256_fmadd_ps(b, wv[j], part[r][j]);
        }
      }
      for (int j = 0; j < V; ++j) {
        const __m256 sv = _mm256_loadu_ps(a.s + g * a.lds + 8 * j);
        for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(part[r][j], sv, acc[r][j]);
      }
    }
    pf = p;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(a.c + r * a.ldc + 8 * j, acc[r][j]);
  }
};

// AVX512_VNNI: the tile walks 4 k a step over the packed block (`PackVnni`): one 64-byte vector
// holds 16 columns x 4 k, and vpdpbusd adds 4 products of u8 x and s8 w into each 32-bit lane.
// A segment's integer sum is exact (at most 256 rows of 255 * 128); at its end it loses the
// + 128 of x (128 * the column sum) and is scaled by x's and w's scales into the f32 result.
struct Vnni {
  static constexpr int kLanes = 16, kMR = 6, kV = 2, kMRWide = 2, kVWide = 4, kStep = 4;
  static constexpr GemvFn kGemv[3] = {nullptr, GemvAvx512<1>, GemvAvx512<2>};  // 1-2 rows: exact
  template <int MR, int V>
  HOTSWAP_TARGET_AVX512_VNNI static void Tile(const TileArgs& a, Prefetch& pf) {
    __m512 acc[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = a.first ? _mm512_setzero_ps() : _mm512_loadu_ps(a.c + r * a.ldc + 16 * j);
    Prefetch p = pf;
    const int8_t* w = a.w;
    for (int64_t k = 0, seg = 0; k < a.kn; ++seg) {
      const int64_t g = (a.k0 + k) / a.gl, end = SegmentEnd(a, k);
      __m512i part[MR][V];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < V; ++j) part[r][j] = _mm512_setzero_si512();
      for (; k < end; k += 4, w += a.ldw) {
        p.Step();
        __m512i wv[V];
        for (int j = 0; j < V; ++j) wv[j] = _mm512_loadu_si512(w + 64 * j);
        for (int r = 0; r < MR; ++r) {
          int32_t quad;
          std::memcpy(&quad, a.xq + r * a.ldx + k, 4);
          const __m512i b = _mm512_set1_epi32(quad);
          for (int j = 0; j < V; ++j) part[r][j] = _mm512_dpbusd_epi32(part[r][j], b, wv[j]);
        }
      }
      for (int j = 0; j < V; ++j) {
        const __m512 sv = _mm512_loadu_ps(a.s + g * a.lds + 16 * j);
        const __m512i bias = _mm512_slli_epi32(_mm512_loadu_si512(a.cs + seg * a.ldcs + 16 * j), 7);
        for (int r = 0; r < MR; ++r) {
          const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(part[r][j], bias));
          const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(a.sx[r * a.ldsx + g]), sv);
          acc[r][j] = _mm512_fmadd_ps(sum, scale, acc[r][j]);
        }
      }
    }
    pf = p;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) _mm512_storeu_ps(a.c + r * a.ldc + 16 * j, acc[r][j]);
  }
};

// AVX-VNNI: the Vnni tile on 8 lanes with Avx2's tile shapes (16 ymm: 3 x 2 f32 results and int32
// partial sums, 2 w and a broadcast; one row 4 wide) and GEMV. A 32-byte vector of the packed
// block is 8 columns x 4 k.
struct AvxVnni {
  static constexpr int kLanes = 8, kMR = Avx2::kMR, kV = Avx2::kV, kMRWide = Avx2::kMRWide, kVWide = Avx2::kVWide;
  static constexpr int kStep = 4;
  static constexpr GemvFn kGemv[3] = {nullptr, GemvAvx2<1>, GemvAvx2<2>};  // 1-2 rows: exact
  template <int MR, int V>
  HOTSWAP_TARGET_AVX_VNNI static void Tile(const TileArgs& a, Prefetch& pf) {
    __m256 acc[MR][V];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) acc[r][j] = a.first ? _mm256_setzero_ps() : _mm256_loadu_ps(a.c + r * a.ldc + 8 * j);
    Prefetch p = pf;
    const int8_t* w = a.w;
    for (int64_t k = 0, seg = 0; k < a.kn; ++seg) {
      const int64_t g = (a.k0 + k) / a.gl, end = SegmentEnd(a, k);
      __m256i part[MR][V];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < V; ++j) part[r][j] = _mm256_setzero_si256();
      for (; k < end; k += 4, w += a.ldw) {
        p.Step();
        __m256i wv[V];
        for (int j = 0; j < V; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        for (int r = 0; r < MR; ++r) {
          int32_t quad;
          std::memcpy(&quad, a.xq + r * a.ldx + k, 4);
          const __m256i b = _mm256_set1_epi32(quad);
          for (int j = 0; j < V; ++j) part[r][j] = _mm256_dpbusd_avx_epi32(part[r][j], b, wv[j]);
        }
      }
      for (int j = 0; j < V; ++j) {
        const __m256 sv = _mm256_loadu_ps(a.s + g * a.lds + 8 * j);
        const __m256i bias =
            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.cs + seg * a.ldcs + 8 * j)), 7);
        for (int r = 0; r < MR; ++r) {
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(part[r][j], bias));
          const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(a.sx[r * a.ldsx + g]), sv);
          acc[r][j] = _mm256_fmadd_ps(sum, scale, acc[r][j]);
        }
      }
    }
    pf = p;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(a.c + r * a.ldc + 8 * j, acc[r][j]);
  }
};

// w[0:kn, 0:width] (row stride ldw; kn a multiple of 4, width of 8) -> out[kn / 4][width][4 bytes]:
// each column's 4 consecutive k in one 32-bit lane (vpdpbusd's operand order), so a vector of
// either VNNI path is its lanes' columns. cs[segment][width]: each segment's column sums
// (segments as `SegmentEnd` cuts the block). SSE only: both VNNI paths call it.
void PackVnni(const int8_t* w, int64_t ldw, int64_t kn, int64_t width, int64_t k0, int64_t gl, int8_t* out,
              int32_t* cs) {
  const __m128i ones8 = _mm_set1_epi8(1), ones16 = _mm_set1_epi16(1);
  int32_t* seg = cs;
  std::fill(seg, seg + width, 0);
  for (int64_t k = 0, end = std::min(kn, (k0 / gl + 1) * gl - k0); k < kn; k += 4) {
    if (k == end) {
      seg += width;
      std::fill(seg, seg + width, 0);
      end = std::min(kn, end + gl);
    }
    const int8_t* row = w + k * ldw;
    int8_t* dst = out + (k / 4) * width * 4;
    for (int64_t c = 0; c < width; c += 8) {
      __m128i r[4];  // 8 columns of rows k..k+3
      for (int i = 0; i < 4; ++i) r[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i * ldw + c));
      const __m128i r01 = _mm_unpacklo_epi8(r[0], r[1]), r23 = _mm_unpacklo_epi8(r[2], r[3]);
      const __m128i cols[2] = {_mm_unpacklo_epi16(r01, r23), _mm_unpackhi_epi16(r01, r23)};  // 0-3, 4-7
      for (int h = 0; h < 2; ++h) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 4 * (c + 4 * h)), cols[h]);
        // 4 signed bytes per lane summed: pairs by vpmaddubsw (1 x s8, no saturation), then vpmaddwd.
        const __m128i sums = _mm_madd_epi16(_mm_maddubs_epi16(ones8, cols[h]), ones16);
        __m128i* at = reinterpret_cast<__m128i*>(seg + c + 4 * h);
        _mm_storeu_si128(at, _mm_add_epi32(_mm_loadu_si128(at), sums));
      }
    }
  }
}

// x rows [r0, r1) -> xq (round(x / sx) + 128) and sx = max |x| / 127 per (row, group of gl).
// Plain C++ (both VNNI paths call it).
void QuantizeRows(const float* x, int64_t K, int64_t gl, int64_t r0, int64_t r1,
                  uint8_t* xq, float* sx) {
  const int64_t groups = K / gl;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xs = x + r * K + g * gl;
      float amax = 0.0f;
      for (int64_t k = 0; k < gl; ++k) amax = std::max(amax, std::fabs(xs[k]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      sx[r * groups + g] = amax / 127.0f;
      uint8_t* q = xq + r * K + g * gl;
      for (int64_t k = 0; k < gl; ++k) q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(xs[k] * inv)) + 128);
    }
}

// Tile tables: [V][MR] for the general widths, and the wide tile's [MR].
template <class P, int V, int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> RowsOf(std::integer_sequence<int, R...>) {
  return {nullptr, &P::template Tile<R + 1, V>...};
}
template <class P, int... V>
constexpr std::array<std::array<TileFn, P::kMR + 1>, sizeof...(V) + 1> WidthsOf(std::integer_sequence<int, V...>) {
  return {std::array<TileFn, P::kMR + 1>{}, RowsOf<P, V + 1>(std::make_integer_sequence<int, P::kMR>())...};
}
template <class P>
TileFn PickTile(int64_t v, int64_t mr) {
  static constexpr auto general = WidthsOf<P>(std::make_integer_sequence<int, P::kV>());
  static constexpr auto wide = RowsOf<P, P::kVWide>(std::make_integer_sequence<int, P::kMRWide>());
  return v > P::kV ? wide[mr] : general[v][mr];
}

// The operands of one call, shared by its products.
struct Call {
  const float* x;
  const uint8_t* xq;  // VNNI only
  const float* sx;
  int64_t M, K, gl_x;  // gl_x: x's quantization group (VNNI)
};

// One product y = x @ W of a call, cut into work items: `chunks` column ranges of at most
// `width` columns over [0, cols), times `ksplit` ranges of K. The first K range writes y, the
// others write `partial`, which is then added into y.
struct Product {
  const int8_t* w;
  const float* s;
  float* y;
  int64_t N, gl;
  int64_t cols = 0, width = 1, chunks = 0, ksplit = 1;
  std::unique_ptr<float[]> partial;
  int64_t items() const { return chunks * ksplit; }
};

// Columns [n0, n1) of y = x[:, k0:k1] @ W[k0:k1] in plain loops, group by group: the scalar path
// and the vector paths' last columns past a multiple of the vector width.
void ScalarColumns(const Call& call, const Product& p, int64_t k0, int64_t k1, int64_t n0, int64_t n1, float* c,
                   int64_t ldc) {
  for (int64_t r = 0; r < call.M; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      for (int64_t k = k0; k < k1;) {
        const int64_t g = k / p.gl, end = std::min(k1, (g + 1) * p.gl);
        float part = 0.0f;
        for (; k < end; ++k) part += call.x[r * call.K + k] * static_cast<float>(p.w[k * p.N + n]);
        acc += part * p.s[g * p.N + n];
      }
      c[r * ldc + (n - n0)] = acc;
    }
}

// One work item on path P: c[M, 0:n1-n0] = x[:, k0:k1] @ W[k0:k1, n0:n1] (n1 - n0 a multiple of
// kLanes). Rows go in as few tiles as kMR allows, as even as possible; k in blocks of about
// kSlabBytes, the next block's rows prefetched into L2 while this one is computed (VNNI: this
// block packed into `pack` first, then read by every row pass from L2).
template <class P>
void Item(const Call& call, const Product& pr, int64_t k0, int64_t k1, int64_t n0, int64_t n1, float* c,
          int64_t ldc) {
  constexpr bool vnni = P::kStep == 4;
  const int64_t M = call.M, N = pr.N;
  const int64_t vmax = M <= P::kMRWide ? P::kVWide : P::kV, nr = P::kLanes * vmax;
  const int64_t width = n1 - n0, panels = (width + nr - 1) / nr, lines = (width + 63) / 64;
  const int64_t passes = (M + P::kMR - 1) / P::kMR;
  const int64_t kb = std::clamp<int64_t>(kSlabBytes / width, MinKB(M), kMaxKB) / 4 * 4;
  std::vector<int8_t> pack;
  std::vector<int32_t> sums;
  if (vnni) {
    pack.resize(kb * width);
    sums.resize((kb / 4 + 2) * width);  // segments of a block: at most one per 4 rows, + 1
  }
  for (int64_t kk = k0; kk < k1; kk += kb) {
    const int64_t kn = std::min(kb, k1 - kk), next = std::min(k1, kk + kn);
    Prefetch pf{reinterpret_cast<const char*>(pr.w + next * N + n0), N, lines, std::min(kb, k1 - next)};
    const int64_t steps = panels * passes * ((kn + P::kStep - 1) / P::kStep);
    pf.per_step = (pf.rows_left * lines + steps - 1) / steps;
    if (vnni) PackVnni(pr.w + kk * N + n0, N, kn, width, kk, pr.gl, pack.data(), sums.data());
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t v = std::min(vmax, (width - p * nr) / P::kLanes);
      for (int64_t t = 0; t < passes; ++t) {
        const int64_t r0 = M * t / passes, mr = M * (t + 1) / passes - r0;
        TileArgs a{};
        a.ldx = call.K;
        if (vnni) {
          a.xq = call.xq + r0 * call.K + kk;
          a.sx = call.sx + r0 * (call.K / call.gl_x);
          a.ldsx = call.K / call.gl_x;
          a.w = pack.data() + p * nr * 4;
          a.ldw = width * 4;
          a.cs = sums.data() + p * nr;
          a.ldcs = width;
        } else {
          a.x = call.x + r0 * call.K + kk;
          a.w = pr.w + kk * N + n0 + p * nr;
          a.ldw = N;
        }
        a.s = pr.s + n0 + p * nr;
        a.lds = N;
        a.k0 = kk, a.kn = kn, a.gl = pr.gl;
        a.c = c + r0 * ldc + p * nr, a.ldc = ldc, a.first = kk == k0;
        PickTile<P>(v, mr)(a, pf);
      }
    }
  }
}

// The k range of part `part` of `parts`: cut at multiples of 4 where K is one (VNNI's steps).
std::pair<int64_t, int64_t> KRange(int64_t K, int64_t part, int64_t parts) {
  const int64_t unit = K % 4 == 0 ? 4 : 1, units = K / unit;
  return {units * part / parts * unit, units * (part + 1) / parts * unit};
}

// y_i = x @ W_i for every product on path P (lanes: its vector width; 1 for scalar), all their
// work items in one parallel region.
template <class P>
void Products(ffi::ThreadPool& pool, const Call& call, std::vector<Product>& ps, bool scalar) {
  const int64_t M = call.M, K = call.K, lanes = scalar ? 1 : P::kLanes;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t cols = 0, total = 0;
  for (const Product& p : ps) cols += p.N / lanes * lanes;
  const int64_t share = (cols / lanes + threads - 1) / threads * lanes;
  for (Product& p : ps) {
    const int64_t whole = p.N / lanes * lanes, groups = whole / lanes;
    p.cols = whole;
    if (M <= 2 && !scalar) {
      // GEMV: every item streams whole weight rows (a K range), the partial products summed.
      p.width = std::max<int64_t>(whole, 1);
      p.chunks = whole > 0 ? 1 : 0;
      p.ksplit = std::min<int64_t>(2 * threads, std::max<int64_t>(K / 64, 1));
    } else {
      const int64_t most = std::max<int64_t>(lanes, std::min(scalar ? share : MaxWidth(M), share));
      const int64_t chunks = std::min(groups, (whole + most - 1) / most);
      p.width = chunks > 0 ? (groups + chunks - 1) / chunks * lanes : 1;
      p.chunks = chunks > 0 ? (whole + p.width - 1) / p.width : 0;
      const bool split = ps.size() == 1 && p.chunks > 0 && p.chunks < threads && !scalar;
      p.ksplit = split ? std::min<int64_t>(threads, std::max<int64_t>(K / 64, 1)) : 1;
    }
    if (whole < p.N) ScalarColumns(call, p, 0, K, whole, p.N, p.y + whole, p.N);  // on this thread
    if (p.ksplit > 1) p.partial.reset(new float[(p.ksplit - 1) * M * p.N]);
    total += p.items();
  }
  hotswap::ParallelFor(pool, total, [&](int64_t i) {
    size_t j = 0;
    while (i >= ps[j].items()) i -= ps[j++].items();
    const Product& p = ps[j];
    const int64_t ch = i / p.ksplit, part = i % p.ksplit;
    const int64_t n0 = ch * p.width, n1 = std::min(n0 + p.width, p.cols);
    const auto [k0, k1] = KRange(K, part, p.ksplit);
    float* y = (part == 0 ? p.y : p.partial.get() + (part - 1) * M * p.N) + n0;
    if (scalar) {
      ScalarColumns(call, p, k0, k1, n0, n1, y, p.N);
    } else if (M <= 2) {
      std::unique_ptr<float[]> part(new float[M * p.cols]);
      P::kGemv[M](call.x, K, p.w, p.N, p.cols, p.s, p.gl, k0, k1, y, part.get());
    } else {
      Item<P>(call, p, k0, k1, n0, n1, y, p.N);
    }
  });
  for (Product& p : ps)
    for (int64_t part = 1; part < p.ksplit; ++part) {
      const float* pc = p.partial.get() + (part - 1) * M * p.N;
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < p.cols; ++n) p.y[r * p.N + n] += pc[r * p.N + n];
    }
}

const char* Name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      return "avx512_vnni";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2Fma:
      return "avx2";
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvxVnni:
      return "avx_vnni";
    default:
      return "unknown";
  }
}

// The kernel's paths, best first (scalar is always offered); and those that never quantize x.
constexpr Isa kOffered[] = {Isa::kAvx512Vnni, Isa::kAvxVnni, Isa::kAvx512, Isa::kAvx2Fma};
constexpr Isa kExact[] = {Isa::kAvx512, Isa::kAvx2Fma};
bool Quantizes(Isa path) { return path == Isa::kAvx512Vnni || path == Isa::kAvxVnni; }

// The path a call runs, or why it cannot.
struct Choice {
  Isa path;
  std::string error;  // empty: run `path`
};

// The path of a call of M rows asking for `asked` (cpu/isa.h's Isa; -1: the best) on a CPU with
// `features`: a pure function, so a test can ask what another CPU would run. "auto" quantizes x
// only where exact = 0, from kVnniRows rows and where every weight packs (one group length, a
// multiple of 4); below that reading w is the bound and the f32 tile is as fast and exact.
Choice Choose(int32_t asked, uint32_t features, int64_t M, bool exact, bool packable) {
  const Isa want = static_cast<Isa>(asked);
  if (want == Isa::kAuto) {
    const bool quantize = !exact && M >= kVnniRows && packable;
    return {quantize ? hotswap::Best(kOffered, features) : hotswap::Best(kExact, features), ""};
  }
  const std::string name = Name(want);
  if (hotswap::Pick(asked, kOffered, features) == Isa::kAuto) {
    bool offered = want == Isa::kScalar;
    for (Isa isa : kOffered) offered = offered || isa == want;
    if (!offered) return {Isa::kAuto, "path " + name + " is not one this kernel has"};
    const uint32_t needs = hotswap::Needs(want);
    return {Isa::kAuto, "path " + name + " needs " + hotswap::FeatureNames(needs) + "; this CPU lacks " +
                            hotswap::FeatureNames(needs & ~features)};
  }
  if (Quantizes(want) && exact) return {Isa::kAuto, name + " quantizes x, which exact = 1 forbids"};
  if (Quantizes(want) && !packable) {
    return {Isa::kAuto, name + " needs one group length for all weights, a multiple of 4"};
  }
  return {want, ""};
}

ffi::Error Int8Matmuls(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                       ffi::RemainingRets ys, int32_t isa, int32_t exact) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ys.size() == 0 || args.size() != 2 * ys.size()) {
    return ffi::Error::InvalidArgument("hotswap int8 matmul: need x [M, K] and a (data, scales) pair per result");
  }
  const int64_t M = xd[0], K = xd[1];
  std::vector<Product> ps;
  bool packable = true;  // every group a multiple of 4 rows and one group length (VNNI's terms)
  for (size_t i = 0; i < ys.size(); ++i) {
    auto w = args.get<ffi::Buffer<ffi::S8>>(2 * i);
    auto s = args.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !s.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("hotswap int8 matmul: int8 data, f32 scales and f32 results");
    }
    auto wd = w->dimensions(), sd = s->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || wd[0] != K || sd.size() != 2 || sd[1] != wd[1] || sd[0] < 1 || K % sd[0] != 0 ||
        yd.size() != 2 || yd[0] != M || yd[1] != wd[1]) {
      return ffi::Error::InvalidArgument(
          "hotswap int8 matmul: need data [K, N], scales [G, N] with G dividing K, y [M, N] for x [M, K]");
    }
    const int64_t gl = std::max<int64_t>(K / sd[0], 1);
    packable = packable && gl % 4 == 0 && (ps.empty() || ps[0].gl == gl);
    ps.push_back(Product{reinterpret_cast<const int8_t*>(w->untyped_data()), s->typed_data(), (*y)->typed_data(),
                         wd[1], gl});
  }
  const Choice choice = Choose(isa, hotswap::HostFeatures(), M, exact != 0, packable);
  if (choice.path == Isa::kAuto) return ffi::Error::InvalidArgument("hotswap int8 matmul: " + choice.error);
  Call call{x.typed_data(), nullptr, nullptr, M, K, 1};
  if (M == 0 || K == 0) {  // no item would write y
    for (Product& p : ps) std::fill(p.y, p.y + M * p.N, 0.0f);
    return ffi::Error::Success();
  }
  switch (choice.path) {
    case Isa::kAvx512Vnni:
    case Isa::kAvxVnni: {
      const int64_t gl = ps[0].gl;
      std::unique_ptr<uint8_t[]> xq(new uint8_t[M * K]);
      std::unique_ptr<float[]> sx(new float[M * (K / gl)]);
      const int64_t blocks = std::min<int64_t>(M, 4 * std::max<int64_t>(pool.num_threads(), 1));
      hotswap::ParallelFor(pool, blocks, [&](int64_t b) {
        QuantizeRows(call.x, K, gl, M * b / blocks, M * (b + 1) / blocks, xq.get(), sx.get());
      });
      call.xq = xq.get(), call.sx = sx.get(), call.gl_x = gl;
      if (choice.path == Isa::kAvx512Vnni) {
        Products<Vnni>(pool, call, ps, false);
      } else {
        Products<AvxVnni>(pool, call, ps, false);
      }
      break;
    }
    case Isa::kAvx512:
      Products<Avx512>(pool, call, ps, false);
      break;
    case Isa::kAvx2Fma:
      Products<Avx2>(pool, call, ps, false);
      break;
    default:
      Products<Avx2>(pool, call, ps, true);  // scalar: the template argument is unused
      break;
  }
  return ffi::Error::Success();
}

}  // namespace

// The dispatch table, for tests (ctypes, `kernels/cpu_int8.py`): the path `Choose` picks for a CPU
// with `features` (isa.h's Feature bits; -1 where the call would fail), this CPU's features, and
// the features a path needs. Exported here, beside the one kernel that offers every int8 path.
extern "C" int32_t HotswapInt8Path(int32_t asked, uint32_t features, int64_t rows, int32_t exact, int32_t packable) {
  return static_cast<int32_t>(Choose(asked, features, rows, exact != 0, packable != 0).path);
}
extern "C" uint32_t HotswapCpuFeatures() { return hotswap::HostFeatures(); }
extern "C" uint32_t HotswapIsaNeeds(int32_t isa) { return hotswap::Needs(static_cast<Isa>(isa)); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapInt8Matmuls, Int8Matmuls,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .RemainingArgs()               // (data [K, N], scales [G, N]) per weight
                                  .RemainingRets()               // y [M, N] per weight
                                  .Attr<int32_t>("isa")          // cpu/isa.h's Isa; -1: the best
                                  .Attr<int32_t>("exact"));      // 1: never quantize x (no VNNI)
