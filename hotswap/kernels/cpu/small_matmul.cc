// y[M, N] = x[M, K] @ w[K, N] in f32 for the few rows of a decode step, on XLA's intra-op
// threads (hotswap/kernels/cpu_matmul.py).
//
// Why: decode multiplies a handful of rows by every weight matrix, and XLA:CPU does that
// poorly at both ends of the range served here:
//   - 1-2 rows: XLA emits a matrix-vector product as single-threaded loops, so a batch-1
//     step read its weights at one core's bandwidth. `KSlice` splits the weight rows over
//     the threads.
//   - 3-32 rows: XLA's dot ran far below both the FMA peak and DRAM bandwidth over a chain
//     of layer weights streamed from DRAM as in a decode step. Up to ~20 rows a step is bound by
//     reading w (2M FLOP per 4-byte weight against ~11 FLOP/B of the cores over DRAM), above
//     it by the FMAs. `Item` reads w in place (no packing: the engine's weights are the
//     trainer's arrays, zero copy), prefetching each block of row segments into L2 a block
//     ahead, and multiplies every w vector it loads into up to 9 rows held in registers (a
//     tile's rows set its speed on Zen 4: 5-9 rows run at the FMA peak, 4 or fewer at half
//     of it). Tiles are AVX-512 (zmm) or, without it, AVX2 + FMA (ymm); a CPU with neither
//     takes XLA's dot from 3 rows on.
//
// Layout: row-major x [M, K], w [K, N], y [M, N]. Correct for any M; the engine calls it for
// at most HotswapSmallMatmulMaxRows() rows.
//
// Weights are f32 or bf16 (one dtype per call), x and y f32. A bf16 weight is widened to f32
// in registers (its 16 bits are the top half of the f32) and multiplied in f32: a decode step
// is bound by reading the weights, and bf16 halves those bytes; the products and sums are
// what XLA's bf16 dot computes with f32 accumulation, up to the order of the sums.
//
// `HotswapFixedMatmul` (deterministic mode) takes any M and computes every y[r, n] as one chain
// over k = 0 .. K-1 in order: register tiles whatever the row count, never a split over K. Tile
// grouping, column chunks, k-blocks and prefetching decide only which values are in registers
// when, not the order of a row's sum, so a row's result is the same bits in a step of 1 row or
// of 512 (the small-row path splits K for 1-2 rows, and XLA's dot blocks K by the row count).

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HOTSWAP_TILED 1  // 3-32 rows in register tiles; without either, 1-2 rows only
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using hotswap::bf16;
using hotswap::Widen;

// Rows [k0, k1) of w times columns [k0, k1) of x, into part[M, N]: each thread streams a
// contiguous run of whole weight rows, the best access pattern for the prefetchers.
template <typename W>
void KSlice(const float* __restrict x, const W* __restrict w, float* __restrict part, int64_t M, int64_t K,
            int64_t N, int64_t k0, int64_t k1) {
  std::fill(part, part + M * N, 0.0f);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const W* w0 = w + k * N;
    const W *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
    for (int64_t r = 0; r < M; ++r) {
      const float *xr = x + r * K + k;
      const float a = xr[0], b = xr[1], c = xr[2], d = xr[3];
      float* pr = part + r * N;
#pragma GCC ivdep
      for (int64_t n = 0; n < N; ++n)
        pr[n] += a * Widen(w0[n]) + b * Widen(w1[n]) + c * Widen(w2[n]) + d * Widen(w3[n]);
    }
  }
  for (; k < k1; ++k) {
    const W* wk = w + k * N;
    for (int64_t r = 0; r < M; ++r) {
      const float a = x[r * K + k];
      float* pr = part + r * N;
      for (int64_t n = 0; n < N; ++n) pr[n] += a * Widen(wk[n]);
    }
  }
}

// Columns [n0, n1) of y = x @ w, each a chain over k = 0 .. K-1 in order (the fixed-order path
// without AVX-512; see the header).
template <typename W>
void ColumnSlice(const float* __restrict x, const W* __restrict w, float* __restrict y, int64_t M, int64_t K,
                 int64_t N, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < M; ++r) {
    float* yr = y + r * N;
    std::fill(yr + n0, yr + n1, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[r * K + k];
      const W* wk = w + k * N;
      for (int64_t n = n0; n < n1; ++n) yr[n] += a * Widen(wk[n]);
    }
  }
}

#if defined(__AVX512F__)
// The vector a tile is built of, and the tile sizes for it (one set per instruction set).
// zmm: a tile is up to kMR rows x kV zmm (48 columns): 27 accumulators, 3 w vectors and a
// broadcast x value in the 32 zmm registers. Rows are what set a tile's speed on Zen 4: on
// one core with w in L1, tiles of 5-9 rows ran at 105-114 GFLOP/s (the FMA peak) and tiles of
// 3-4 rows at 45-63 whatever their width, so M rows go in ceil(M / 9) tiles as even as
// possible (16 = 8 + 8, 32 = 4 x 8): M = 8 in one tile instead of two of 4 is 1.5x. Up to
// kMRWide rows (one tile) the tile is kVWide zmm wide: 1.02-1.09x the 3-wide one at 3-4 rows.
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kMR = 9, kV = 3, kMRWide = 4, kVWide = 4;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec LoadV(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadV(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void StoreV(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#elif defined(HOTSWAP_TILED)
// ymm (AVX2 + FMA): 16 registers, so a tile is up to 6 rows x 2 ymm (16 columns): 12
// accumulators, 2 w vectors and a broadcast, the shape of BLIS's Haswell kernel. Up to 3 rows
// it is 3 ymm wide (9 accumulators): fewer than 8 independent chains would leave the two FMA
// pipes waiting on their 4-cycle latency. A bf16 weight widens with a zero-extend and a shift.
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kMR = 6, kV = 2, kMRWide = 3, kVWide = 3;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec LoadV(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadV(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void StoreV(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#else
constexpr int kLanes = 16;  // no vector tiles: only the column chunks of the fixed order use it
#endif

#if defined(__AVX512BW__)
// KSlice for bf16 weights with AVX-512: the generic loop widens each 16 weights with a
// zero-extending load and a shift, two uops per 16 weights more than the f32 GEMV spends, so it
// ran out of instructions before DRAM ran out of bytes (bench-100m's 12-layer 1-row chain:
// 22 GB/s of bf16 against the f32 GEMV's 29). Here one 64-byte load gives 32 weights, widened
// by two interleaves with a zero register (a bf16 is the top half of its f32): within each
// 128-bit lane the low one holds columns 0-3 (8-11, ...), the high one 4-7 (12-15, ...). `part`
// keeps that order for every 32 columns until the slice's end. A sweep reads kSliceRows whole
// weight rows at once. Chain in one process, interleaved reps, best of 80: the generic loop
// 6.85 ms, this one 5.61 (27 GB/s; the f32 GEMV 10.93 ms, 28 GB/s); 4, 8, 16 rows a sweep
// were 0.89, 0.81, 0.81 of the generic loop's time.
constexpr int kSliceRows = 16;

// part[r, 0:cols] (+)= x[r, 0:R] @ w[0:R, 0:cols] for every row r (row strides K, N, N), part
// interleaved; cols a multiple of 32.
template <int R>
void SweepBf16(const float* __restrict x, const bf16* __restrict w, float* __restrict part, int64_t M, int64_t K,
               int64_t N, int64_t cols, bool first) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r = 0; r < M; ++r) {
    __m512 xb[R];
    for (int i = 0; i < R; ++i) xb[i] = _mm512_set1_ps(x[r * K + i]);
    float* pr = part + r * N;
    for (int64_t n = 0; n < cols; n += 32) {
      __m512 lo = first ? _mm512_setzero_ps() : _mm512_loadu_ps(pr + n);
      __m512 hi = first ? _mm512_setzero_ps() : _mm512_loadu_ps(pr + n + 16);
      for (int i = 0; i < R; ++i) {
        const __m512i a = _mm512_loadu_si512(w + i * N + n);
        lo = _mm512_fmadd_ps(xb[i], _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, a)), lo);
        hi = _mm512_fmadd_ps(xb[i], _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, a)), hi);
      }
      _mm512_storeu_ps(pr + n, lo);
      _mm512_storeu_ps(pr + n + 16, hi);
    }
  }
}

// KSlice's contract (part[M, N] = x[:, k0:k1] @ w[k0:k1, :], in column order) for bf16 weights.
void KSliceBf16(const float* __restrict x, const bf16* __restrict w, float* __restrict part, int64_t M, int64_t K,
                int64_t N, int64_t k0, int64_t k1) {
  const int64_t cols = N / 32 * 32;
  int64_t k = k0;
  for (; k + kSliceRows <= k1; k += kSliceRows)
    SweepBf16<kSliceRows>(x + k, w + k * N, part, M, K, N, cols, k == k0);
  for (; k < k1; ++k) SweepBf16<1>(x + k, w + k * N, part, M, K, N, cols, k == k0);
  // Back to column order: element i of each 64-byte result is element idx[i] of (lo, hi).
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < M; ++r) {
    float* pr = part + r * N;
    for (int64_t n = 0; n < cols; n += 32) {
      const __m512 lo = _mm512_loadu_ps(pr + n), hi = _mm512_loadu_ps(pr + n + 16);
      _mm512_storeu_ps(pr + n, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(pr + n + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
    for (int64_t n = cols; n < N; ++n) {  // the columns past the last 32
      float acc = 0.0f;
      for (int64_t kk = k0; kk < k1; ++kk) acc += x[r * K + kk] * Widen(w[kk * N + n]);
      pr[n] = acc;
    }
  }
}
#endif

#if defined(HOTSWAP_TILED)
// Bytes of w per k-block: the block sits in L2 while the next one is prefetched.
constexpr int64_t kSlabBytes = 256 << 10;
// k rows per block, at most: a tile call's accumulator load and store are paid once per
// block, and a 32-row block ran at 85% of a 128-row one.
constexpr int64_t kMaxKB = 128;
// A step of M rows does 2M FLOP per 4-byte weight, and both cores' ~220 GFLOP/s over DRAM's
// ~20 GB/s is ~11 FLOP/B: up to ~20 rows reading w is the bound, and long row segments
// stream best. Up to kWideRows rows an item may be 2,048 columns wide (8 KB: a whole
// bench-100m MLP row) in blocks of >= 32 rows (+4-10% at 4-8 rows); above it that cost the
// tile 5% at 32 rows, so at most 1,024 columns in blocks of >= 64 rows.
constexpr int64_t kWideRows = 8;
int64_t MaxWidth(int64_t M) { return M <= kWideRows ? 2048 : 1024; }
int64_t MinKB(int64_t M) { return M <= kWideRows ? 32 : 64; }

// Prefetches a run of weight row segments into L2, a few lines per call, spread over the
// compute of the block before it.
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

// c[0:MR, 0:kLanes*V] (+)= x[0:MR, 0:kn] @ w[0:kn, 0:kLanes*V] (row strides ldx, ldw, ldc):
// each w vector is loaded once and multiplied into MR rows, x broadcast from L1, y held in
// registers for the whole block.
template <int MR, int V, typename W>
void Tile(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw, int64_t kn,
          float* __restrict c, int64_t ldc, bool first, Prefetch& pf) {
  Vec acc[MR][V];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = first ? Zero() : LoadV(c + r * ldc + kLanes * j);
  Prefetch p = pf;  // a local copy lives in registers, not in a store-to-load chain
  for (int64_t k = 0; k < kn; ++k, w += ldw, ++x) {
    p.Step();
    Vec wv[V];
    for (int j = 0; j < V; ++j) wv[j] = LoadV(w + kLanes * j);
    for (int r = 0; r < MR; ++r) {
      const Vec b = Broadcast(x[r * ldx]);
      for (int j = 0; j < V; ++j) acc[r][j] = Fma(b, wv[j], acc[r][j]);
    }
  }
  pf = p;
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < V; ++j) StoreV(c + r * ldc + kLanes * j, acc[r][j]);
}
template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t, bool, Prefetch&);
// Tiles of 1..sizeof(MR) rows, V vectors wide, indexed by their row count.
template <typename W, int V, int... MR>
constexpr std::array<TileFn<W>, sizeof...(MR) + 1> Rows(std::integer_sequence<int, MR...>) {
  return {nullptr, Tile<MR + 1, V, W>...};
}
template <typename W, int V, int N>
constexpr auto kRow = Rows<W, V>(std::make_integer_sequence<int, N>());
// [V][MR]: kV-wide and narrower tiles of up to kMR rows, and at V = kVWide the wide tile of up
// to kMRWide rows.
static_assert(kVWide == kV + 1, "the wide tile sits just past the general widths");
template <typename W, int... V>
constexpr std::array<const TileFn<W>*, kV + 2> Widths(std::integer_sequence<int, V...>) {
  return {nullptr, kRow<W, V + 1, kMR>.data()..., kRow<W, kVWide, kMRWide>.data()};
}
template <typename W>
constexpr auto kTiles = Widths<W>(std::make_integer_sequence<int, kV>());

// One work item: c[M, 0:n1-n0] (row stride ldc) = x[:, k0:k1] @ w[k0:k1, n0:n1], n1 - n0 a
// multiple of kLanes. Rows go in as few tiles as kMR allows, as even as possible (32 = 4 x 8,
// 12 = 6 + 6), each the full height of a panel of kLanes * kV columns (the last panel
// narrower when the width asks). Walks k in blocks, prefetching the next block's row segments
// (contiguous runs, which the memory system streams best) while computing this one.
template <typename W>
void Item(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t k0, int64_t k1, int64_t n0,
          int64_t n1, float* c, int64_t ldc) {
  const int64_t vmax = M <= kMRWide ? kVWide : kV, nr = kLanes * vmax;  // panel width
  const int64_t width = n1 - n0, panels = (width + nr - 1) / nr;
  const int64_t lines = (width * static_cast<int64_t>(sizeof(W)) + 63) / 64;  // cache lines a row
  const int64_t passes = (M + kMR - 1) / kMR;
  const int64_t kb = std::clamp<int64_t>(kSlabBytes / (static_cast<int64_t>(sizeof(W)) * width), MinKB(M), kMaxKB);
  for (int64_t kk = k0; kk < k1; kk += kb) {
    const int64_t kn = std::min(kb, k1 - kk);
    const int64_t next = std::min(k1, kk + kn);
    Prefetch pf{reinterpret_cast<const char*>(w + next * N + n0), N * static_cast<int64_t>(sizeof(W)), lines,
                std::min(kb, k1 - next)};
    pf.per_step = (pf.rows_left * lines + panels * passes * kn - 1) / (panels * passes * kn);
    // One line of each row of the block after next: its page walks (rows of a wide weight
    // are pages apart) are done before its prefetches need them (1.03-1.13x at 4-32 rows).
    for (int64_t k = next + kb; k < std::min(k1, next + 2 * kb); ++k)
      _mm_prefetch(reinterpret_cast<const char*>(w + k * N + n0), _MM_HINT_T1);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t v = std::min(vmax, (width - p * nr) / kLanes);
      for (int64_t t = 0; t < passes; ++t) {
        const int64_t r0 = M * t / passes, mr = M * (t + 1) / passes - r0;
        kTiles<W>[v][mr](x + r0 * K + kk, K, w + kk * N + n0 + p * nr, N, kn, c + r0 * ldc + p * nr, ldc, kk == k0,
                         pf);
      }
    }
  }
}

constexpr int64_t kMaxRows = 32;  // from 64 rows (prefill) on, XLA's dot is compute-efficient
#else
constexpr int64_t kMaxRows = 2;  // without vector tiles only the GEMV path is faster than XLA
#endif

// One product y = x @ w of a call, cut into work items: `chunks` column ranges of at most
// `width` columns over [0, cols), times `ksplit` ranges of K. The first K range writes y,
// the others write `partial`, which is then added into y.
template <typename W>
struct Product {
  const W* w;
  float* y;
  int64_t N, cols = 0, width = 1, chunks = 0, ksplit = 1;
  std::unique_ptr<float[]> partial;
  int64_t items() const { return chunks * ksplit; }
};

// 1-2 rows: each item streams a contiguous run of whole weight rows (a K range) and the
// partial products are summed. Splitting the columns instead read strided row segments and
// reached 36 GB/s, not 40.
template <typename W>
void PlanGemv(Product<W>& p, int64_t K, int64_t threads) {
  p.cols = p.width = p.N;
  p.chunks = 1;
  p.ksplit = std::min<int64_t>(2 * threads, std::max<int64_t>(K / 64, 1));
}

// The fixed-order path without vector tiles: column chunks of about one thread's share, all of K each.
template <typename W>
void PlanColumns(Product<W>& p, int64_t share) {
  p.cols = p.N;
  p.width = std::max<int64_t>(kLanes, std::min<int64_t>(p.N, share));
  p.chunks = (p.N + p.width - 1) / p.width;
  p.ksplit = 1;
}

#if defined(HOTSWAP_TILED)
// 3-32 rows: items are column chunks, each at most MaxWidth(M) and at most one thread's share
// of the call's columns (`share`): a layer's q [768] splits in two while its k and v [256]
// stay whole, so both threads get 640 columns. A product too narrow to give every thread a
// chunk when alone is split over K as well. Columns past the last multiple of kLanes are
// left to `Tail`.
template <typename W>
void PlanTiled(Product<W>& p, int64_t M, int64_t K, int64_t threads, int64_t share, bool alone) {
  const int64_t whole = p.N / kLanes * kLanes, lanes = whole / kLanes;  // lanes: kLanes-column groups
  const int64_t most = std::max<int64_t>(kLanes, std::min(MaxWidth(M), share));
  const int64_t chunks = std::min(lanes, (whole + most - 1) / most);
  p.cols = whole;
  p.width = chunks > 0 ? (lanes + chunks - 1) / chunks * kLanes : 1;
  p.chunks = chunks > 0 ? (whole + p.width - 1) / p.width : 0;
  const bool split = alone && p.chunks > 0 && p.chunks < threads;
  p.ksplit = split ? std::min<int64_t>(threads, std::max<int64_t>(K / 64, 1)) : 1;
}

template <typename W>
void Tail(const float* xp, const Product<W>& p, int64_t M, int64_t K) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = p.cols; n < p.N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += xp[r * K + k] * Widen(p.w[k * p.N + n]);
      p.y[r * p.N + n] = acc;
    }
}
#endif

// y_i = x[M, K] @ w_i[K, N_i] for every product, all their work items in one parallel region:
// a layer's q/k/v (or gate/up) weights share x, and one region instead of one per weight
// saves each call's start (waking the helper thread, the end-of-call wait for the slowest
// item).
// `fixed`: every row's sums in one order whatever M (see the header).
template <typename W>
void Products(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K, std::vector<Product<W>>& ps,
              bool fixed) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (K == 0 || M == 0) {  // no item would write y
    for (Product<W>& p : ps) std::fill(p.y, p.y + M * p.N, 0.0f);
    return;
  }
  bool tiled = false;
#if defined(HOTSWAP_TILED)
  tiled = M > 2 || fixed;
#endif
  int64_t total = 0, cols = 0;
  for (const Product<W>& p : ps) cols += p.N / kLanes * kLanes;
  const int64_t share = (cols / kLanes + threads - 1) / threads * kLanes;
  for (Product<W>& p : ps) {
#if defined(HOTSWAP_TILED)
    if (tiled) {
      PlanTiled(p, M, K, threads, share, ps.size() == 1 && !fixed);
      Tail(xp, p, M, K);  // on this thread, before it joins in
    } else
#endif
    if (fixed) {
      PlanColumns(p, share);  // the fixed order without vector tiles
    } else {
      PlanGemv(p, K, threads);
    }
    if (p.ksplit > 1) p.partial.reset(new float[(p.ksplit - 1) * M * p.N]);
    total += p.items();
  }
  hotswap::ParallelFor(pool, total, [&](int64_t i) {
    size_t j = 0;
    while (i >= ps[j].items()) i -= ps[j++].items();
    const Product<W>& p = ps[j];
    const int64_t ch = i / p.ksplit, part = i % p.ksplit;
    const int64_t n0 = ch * p.width, n1 = std::min(n0 + p.width, p.cols);
    const int64_t k0 = K * part / p.ksplit, k1 = K * (part + 1) / p.ksplit;
    float* y = (part == 0 ? p.y : p.partial.get() + (part - 1) * M * p.N) + n0;
    if (!tiled && fixed) {
      ColumnSlice(xp, p.w, p.y, M, K, p.N, n0, n1);
      return;
    }
    if (!tiled) {
#if defined(__AVX512BW__)
      if constexpr (std::is_same_v<W, bf16>) {
        KSliceBf16(xp, p.w, y, M, K, p.N, k0, k1);
        return;
      }
#endif
      KSlice(xp, p.w, y, M, K, p.N, k0, k1);
      return;
    }
#if defined(HOTSWAP_TILED)
    Item(xp, M, K, p.w, p.N, k0, k1, n0, n1, y, p.N);
#endif
  });
  for (Product<W>& p : ps)
    for (int64_t part = 1; part < p.ksplit; ++part) {
      const float* pc = p.partial.get() + (part - 1) * M * p.N;
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < p.cols; ++n) p.y[r * p.N + n] += pc[r * p.N + n];
    }
}

// x [M, K] and weights w_i [K, N_i] of one dtype W in; y_i [M, N_i] out, one result per weight.
template <typename W, ffi::DataType T>
ffi::Error TypedMatmuls(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, ffi::RemainingArgs& ws,
                        ffi::RemainingRets& ys, bool fixed) {
  std::vector<Product<W>> ps;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<T>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("hotswap small matmul: weights of one dtype (f32 or bf16), f32 results");
    }
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || wd[0] != K || yd.size() != 2 || yd[0] != M || yd[1] != wd[1]) {
      return ffi::Error::InvalidArgument("hotswap small matmul: need w [K, N] and y [M, N] for x [M, K]");
    }
    ps.push_back(Product<W>{reinterpret_cast<const W*>(w->untyped_data()), (*y)->typed_data(), wd[1]});
  }
  Products(pool, x, M, K, ps, fixed);
  return ffi::Error::Success();
}

ffi::Error Matmuls(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::RemainingArgs& ws, ffi::RemainingRets& ys,
                   bool fixed) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument("hotswap small matmul: need x [M, K] and one result per weight");
  }
  if (ws.get<ffi::Buffer<ffi::BF16>>(0).has_value()) {
    if (fixed) return ffi::Error::InvalidArgument("hotswap fixed matmul: f32 weights only");
    return TypedMatmuls<bf16, ffi::BF16>(pool, x.typed_data(), xd[0], xd[1], ws, ys, fixed);
  }
  return TypedMatmuls<float, ffi::F32>(pool, x.typed_data(), xd[0], xd[1], ws, ys, fixed);
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  return Matmuls(pool, x, ws, ys, false);
}

ffi::Error FixedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  return Matmuls(pool, x, ws, ys, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .RemainingArgs()               // weights
                                  .RemainingRets());             // one result each

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapFixedMatmul, FixedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .RemainingArgs()               // weights
                                  .RemainingRets());             // one result each

// The most rows the engine should send here (cpu_matmul.max_rows()); more go to XLA's dot.
extern "C" int64_t HotswapSmallMatmulMaxRows() { return kMaxRows; }
