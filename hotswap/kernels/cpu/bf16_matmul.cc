// y[M, N] (f32) = x[M, K] (bf16) @ w[K, N] (bf16) with AVX512_BF16's `vdpbf16ps`, for the
// rows of a decode step when x and the weights are both bf16 (hotswap/kernels/cpu_matmul.py).
//
// Why: `small_matmul.cc` widens a bf16 weight to f32 and multiplies with f32 FMAs. Once a step
// has more than a few rows it is bound by the FMAs, not by reading the weights, and one
// `vdpbf16ps` does 32 multiply-adds where an f32 FMA does 16. A product of two bf16 is exact in
// f32 and the sums are f32, so the results are XLA's bf16 dot with f32 accumulation up to the
// order of the sums (pairs of k are summed first).
//
// Layout: row-major x [M, K], w [K, N], y [M, N]. `vdpbf16ps` adds the products of adjacent
// 16-bit pairs, so the weights' k and k+1 must sit side by side in a register: a tile loads 32
// columns of rows k and k+1 and interleaves them (`vpunpcklwd` / `vpunpckhwd`), which within
// each 128-bit lane gives columns 0-3, 8-11, 16-19, 24-27 (low) and 4-7, 12-15, ... (high). The
// accumulators keep that order between k-blocks (the tile stores and reloads them as they are)
// and are put back in column order by the last block's store. x's pair (x[r, k], x[r, k+1]) is
// one 32-bit broadcast. The weights are read in place (the engine's weights are the trainer's
// arrays, zero copy); the next k-block is prefetched into L2 while this one is computed.
//
// One row (a batch-1 decode step) is bound by reading the weights, not by multiplying: `RowItem`
// sweeps whole weight rows with the same pairing, at fewer instructions per byte than widening.
//
// Paths (`isa.h`): kAvx512Bf16, and kScalar (widened f32 loops: any CPU, the tests' second
// path). The engine sends calls here only on a CPU with AVX512_BF16; elsewhere bf16 weights
// take `small_matmul.cc`'s widening tiles.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bf16.h"
#include "isa.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#include <immintrin.h>

namespace ffi = xla::ffi;

namespace {

using hotswap::bf16;
using hotswap::Isa;
using hotswap::Widen;

constexpr int64_t kCols = 32;  // columns of one interleaved pair of zmm (32 bf16 a row)
// Bytes of w per k-block (it sits in L2 while the next one is prefetched) and its k rows, at
// most; both even so that a block never splits a k pair.
constexpr int64_t kSlabBytes = 256 << 10;
constexpr int64_t kMaxKB = 256, kMinKB = 32;

// The products a call computes: y = x @ w over column chunks of `width` (a multiple of kCols)
// in [0, cols), each split into `ksplit` ranges of K; the first K range writes y, the others
// `partial`, added into y at the end.
struct Product {
  const bf16* w;
  float* y;
  int64_t N, cols = 0, width = 1, chunks = 0, ksplit = 1;
  std::unique_ptr<float[]> partial;
  int64_t items() const { return chunks * ksplit; }
};

// ---- kAvx512Bf16 ----

// Prefetches the next block's weight row segments into L2, a few lines per k pair.
struct Prefetch {
  const char* row;
  int64_t stride, lines_per_row, rows_left, line = 0, per_step = 0;  // stride in bytes
  HOTSWAP_TARGET_AVX512_BF16 inline void Step() {
    for (int64_t i = 0; i < per_step && rows_left > 0; ++i) {
      _mm_prefetch(row + line * 64, _MM_HINT_T1);
      if (++line == lines_per_row) line = 0, row += stride, --rows_left;
    }
  }
};

// Element i of the result is element idx[i] of the pair (low, high), 16 + j meaning high[j].
HOTSWAP_TARGET_AVX512_BF16 inline void StoreOrdered(float* p, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// x's pair (x[k], x[k+1]) in every 32-bit lane; the second half zero when `odd` (K's last k).
HOTSWAP_TARGET_AVX512_BF16 inline __m512bh PairOfX(const bf16* x, bool odd) {
  uint32_t v = x[0];
  if (!odd) std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(v));
}

// c[0:MR, 0:kCols*V] (+)= x[0:MR, 0:kn] @ w[0:kn, 0:kCols*V] (row strides ldx, ldw, ldc), kn
// even except at K's end. `first`: the accumulators start at zero, else from c in the
// interleaved order; `last`: c is stored in column order, else interleaved.
template <int MR, int V>
HOTSWAP_TARGET_AVX512_BF16 void Tile(const bf16* __restrict x, int64_t ldx, const bf16* __restrict w, int64_t ldw,
                                     int64_t kn, float* __restrict c, int64_t ldc, bool first, bool last,
                                     Prefetch& pf) {
  __m512 acc[MR][2 * V];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * V; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * j);
  Prefetch p = pf;  // a local copy lives in registers
  for (int64_t k = 0; k < kn; k += 2, w += 2 * ldw, x += 2) {
    p.Step();
    const bool odd = k + 1 == kn;
    __m512bh wv[2 * V];
    for (int j = 0; j < V; ++j) {
      const __m512i a = _mm512_loadu_si512(w + kCols * j);
      const __m512i b = odd ? _mm512_setzero_si512() : _mm512_loadu_si512(w + ldw + kCols * j);
      wv[2 * j] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      wv[2 * j + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = PairOfX(x + r * ldx, odd);
      for (int j = 0; j < 2 * V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
    }
  }
  pf = p;
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < V; ++j) {
      float* out = c + r * ldc + kCols * j;
      if (last) {
        StoreOrdered(out, acc[r][2 * j], acc[r][2 * j + 1]);
      } else {
        _mm512_storeu_ps(out, acc[r][2 * j]);
        _mm512_storeu_ps(out + 16, acc[r][2 * j + 1]);
      }
    }
}

// Tiles: up to kMR rows x kV column pairs (24 accumulators, 4 interleaved w vectors and x's
// broadcast in the 32 zmm registers), and 1-column-pair tiles for a panel's last 32 columns.
constexpr int kMR = 6, kV = 2;
using TileFn = void (*)(const bf16*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t, bool, bool, Prefetch&);
constexpr TileFn kTiles[kV + 1][kMR + 1] = {
    {},
    {nullptr, Tile<1, 1>, Tile<2, 1>, Tile<3, 1>, Tile<4, 1>, Tile<5, 1>, Tile<6, 1>},
    {nullptr, Tile<1, 2>, Tile<2, 2>, Tile<3, 2>, Tile<4, 2>, Tile<5, 2>, Tile<6, 2>},
};

// One work item: c[M, 0:n1-n0] (row stride ldc) = x[:, k0:k1] @ w[k0:k1, n0:n1], n1 - n0 a
// multiple of kCols. Walks k in blocks (prefetching the next block's row segments), each block
// in panels of kCols * kV columns, each panel's rows in tiles of at most kMR rows, as even as
// possible: the panel's block of w stays in L1 while every row tile reads it.
HOTSWAP_TARGET_AVX512_BF16 void Item(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, int64_t k0,
                                     int64_t k1, int64_t n0, int64_t n1, float* c, int64_t ldc) {
  const int64_t nr = kCols * kV, width = n1 - n0, panels = (width + nr - 1) / nr;
  const int64_t lines = (width * 2 + 63) / 64;  // cache lines a row segment
  const int64_t passes = (M + kMR - 1) / kMR;
  const int64_t kb = std::clamp<int64_t>(kSlabBytes / (2 * width), kMinKB, kMaxKB) & ~int64_t{1};
  for (int64_t kk = k0; kk < k1; kk += kb) {
    const int64_t kn = std::min(kb, k1 - kk), next = kk + kn;
    Prefetch pf{reinterpret_cast<const char*>(w + next * N + n0), N * 2, lines, std::min(kb, k1 - next)};
    pf.per_step = (pf.rows_left * lines + panels * passes * (kn / 2) - 1) / std::max<int64_t>(panels * passes * (kn / 2), 1);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t v = std::min<int64_t>(kV, (width - p * nr) / kCols);
      for (int64_t t = 0; t < passes; ++t) {
        const int64_t r0 = M * t / passes, mr = M * (t + 1) / passes - r0;
        kTiles[v][mr](x + r0 * K + kk, K, w + kk * N + n0 + p * nr, N, kn, c + r0 * ldc + p * nr, ldc, kk == k0,
                      next == k1, pf);
      }
    }
  }
}

// ---- kAvx512Bf16, one row (a batch-1 decode step's GEMV) ----
//
// One row is bound by streaming w, so the tiles' short row segments (a few k rows of 64
// columns, rows a page apart) would waste the prefetchers: an item instead sweeps whole weight
// rows of its K range, kRowPairs k pairs at a time, each sweep reading 2 * kRowPairs contiguous
// streams and adding into y, kept in the unpacks' interleaved column order until the item's end.
// A pair's 64 weights (32 columns of rows k and k+1) cost two loads, two interleaves and two
// `vdpbf16ps`; the widening GEMV spends two loads, two widenings, two shifts and two FMAs on 32
// weights, so it ran out of instructions before DRAM ran out of bytes (11-20 GB/s where the f32
// GEMV streams 27-33). Over a chain of bench-100m's 12 layers' 1-row matmuls, in one process
// with interleaved reps (best of 80): 1, 2, 4, 8 pairs a sweep took 11.96, 7.74, 7.39, 5.51 ms
// (8: 27 GB/s, the f32 GEMV's rate; 8 is the most registers hold for x's pairs). Neither a
// software prefetch 256-1024 bytes ahead in each row (6.36-6.66 ms against 6.08 without), nor
// two accumulators per column block, nor 1-4 K ranges per thread changed it: DRAM is the bound.
constexpr int kRowPairs = 8;

// y[0:cols] (+)= x[0:2P] @ w[0:2P, 0:cols] (row stride ldw), y interleaved (see `Tile`);
// `Odd`: the last pair has one row (K's last k), its second half zero.
template <int P, bool Odd>
HOTSWAP_TARGET_AVX512_BF16 void Sweep(const bf16* __restrict x, const bf16* __restrict w, int64_t ldw, int64_t cols,
                                      float* __restrict y, bool first) {
  __m512bh xb[P];
  for (int p = 0; p < P; ++p) xb[p] = PairOfX(x + 2 * p, Odd && p == P - 1);
  for (int64_t n = 0; n < cols; n += kCols) {
    __m512 lo = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + n);
    __m512 hi = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + n + 16);
    for (int p = 0; p < P; ++p) {
      const bf16* row = w + 2 * p * ldw + n;
      const __m512i a = _mm512_loadu_si512(row);
      const __m512i b = Odd && p == P - 1 ? _mm512_setzero_si512() : _mm512_loadu_si512(row + ldw);
      lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(a, b), xb[p]);
      hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(a, b), xb[p]);
    }
    _mm512_storeu_ps(y + n, lo);
    _mm512_storeu_ps(y + n + 16, hi);
  }
}
using SweepFn = void (*)(const bf16*, const bf16*, int64_t, int64_t, float*, bool);
template <bool Odd, int... P>
constexpr std::array<SweepFn, sizeof...(P) + 1> Sweeps(std::integer_sequence<int, P...>) {
  return {nullptr, Sweep<P + 1, Odd>...};
}
// [odd][pairs]: sweeps of 1..kRowPairs pairs.
constexpr std::array<SweepFn, kRowPairs + 1> kSweeps[2] = {
    Sweeps<false>(std::make_integer_sequence<int, kRowPairs>()),
    Sweeps<true>(std::make_integer_sequence<int, kRowPairs>())};

// y[0, 0:cols] = x[0, k0:k1] @ w[k0:k1, 0:cols] (cols a multiple of kCols), in column order.
HOTSWAP_TARGET_AVX512_BF16 void RowItem(const bf16* x, const bf16* w, int64_t N, int64_t k0, int64_t k1,
                                        int64_t cols, float* y) {
  for (int64_t k = k0; k < k1; k += 2 * kRowPairs) {
    const int64_t rows = std::min<int64_t>(2 * kRowPairs, k1 - k);
    kSweeps[rows % 2][(rows + 1) / 2](x + k, w + k * N, N, cols, y, k == k0);
  }
  for (int64_t n = 0; n < cols; n += kCols) StoreOrdered(y + n, _mm512_loadu_ps(y + n), _mm512_loadu_ps(y + n + 16));
}

// ---- kScalar, and the columns past the last multiple of kCols on every path ----

void Columns(const bf16* x, int64_t M, int64_t K, const Product& p, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += Widen(x[r * K + k]) * Widen(p.w[k * p.N + n]);
      p.y[r * p.N + n] = acc;
    }
}

// Items: column chunks of at most `most` columns and at most one thread's share of the call's
// columns (a layer's q [768] splits while its k and v [256] stay whole); a call of one product
// too narrow to give every thread a chunk, or of 1-2 rows (bound by reading w: each thread
// streams whole weight rows), is split over K as well.
void Plan(Product& p, int64_t M, int64_t K, int64_t threads, int64_t share, bool alone) {
  const int64_t whole = p.N / kCols * kCols, groups = whole / kCols;
  const int64_t most = std::max<int64_t>(kCols, std::min<int64_t>(M <= 8 ? 2048 : 1024, share));
  // One row: every item sweeps whole weight rows (`RowItem`), so only K is split.
  const int64_t chunks = M == 1 ? std::min<int64_t>(groups, 1) : std::min(groups, (whole + most - 1) / most);
  p.cols = whole;
  p.width = chunks > 0 ? (groups + chunks - 1) / chunks * kCols : 1;
  p.chunks = chunks > 0 ? (whole + p.width - 1) / p.width : 0;
  const bool split = p.chunks > 0 && ((alone && p.chunks < threads) || M <= 2);
  const int64_t per = M <= 2 ? 2 * threads : threads;
  p.ksplit = split ? std::min<int64_t>(per, std::max<int64_t>(K / 128, 1)) : 1;
}

ffi::Error Run(ffi::ThreadPool& pool, Isa isa, const bf16* x, int64_t M, int64_t K, std::vector<Product>& ps) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (K == 0 || M == 0) {
    for (Product& p : ps) std::fill(p.y, p.y + M * p.N, 0.0f);
    return ffi::Error::Success();
  }
  if (isa == Isa::kScalar) {
    for (const Product& p : ps) Columns(x, M, K, p, 0, p.N);
    return ffi::Error::Success();
  }
  int64_t cols = 0, total = 0;
  for (const Product& p : ps) cols += p.N / kCols * kCols;
  const int64_t share = (cols / kCols + threads - 1) / threads * kCols;
  for (Product& p : ps) {
    Plan(p, M, K, threads, share, ps.size() == 1);
    Columns(x, M, K, p, p.cols, p.N);  // on this thread, before it joins in
    if (p.ksplit > 1) p.partial.reset(new float[(p.ksplit - 1) * M * p.N]);
    total += p.items();
  }
  hotswap::ParallelFor(pool, total, [&](int64_t i) {
    size_t j = 0;
    while (i >= ps[j].items()) i -= ps[j++].items();
    const Product& p = ps[j];
    const int64_t ch = i / p.ksplit, part = i % p.ksplit;
    const int64_t n0 = ch * p.width, n1 = std::min(n0 + p.width, p.cols);
    // K ranges start on an even k: a range never splits a pair.
    const int64_t k0 = K * part / p.ksplit & ~int64_t{1}, k1 = part + 1 == p.ksplit ? K : K * (part + 1) / p.ksplit & ~int64_t{1};
    float* y = (part == 0 ? p.y : p.partial.get() + (part - 1) * M * p.N) + n0;
    if (k0 == k1) {  // an empty range (tiny K) still owns its partial
      for (int64_t r = 0; r < M; ++r) std::fill(y + r * p.N, y + r * p.N + (n1 - n0), 0.0f);
      return;
    }
    if (M == 1) {
      RowItem(x, p.w + n0, p.N, k0, k1, n1 - n0, y);
    } else {
      Item(x, M, K, p.w, p.N, k0, k1, n0, n1, y, p.N);
    }
  });
  for (Product& p : ps)
    for (int64_t part = 1; part < p.ksplit; ++part) {
      const float* pc = p.partial.get() + (part - 1) * M * p.N;
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < p.cols; ++n) p.y[r * p.N + n] += pc[r * p.N + n];
    }
  return ffi::Error::Success();
}

constexpr Isa kOffered[] = {Isa::kAvx512Bf16};

ffi::Error Bf16Matmul(ffi::ThreadPool pool, int32_t isa, ffi::Buffer<ffi::BF16> x, ffi::RemainingArgs ws,
                      ffi::RemainingRets ys) {
  const Isa path = hotswap::Pick(isa, kOffered);
  if (path == Isa::kAuto) {
    return ffi::Error::InvalidArgument("hotswap bf16 matmul: isa " + std::to_string(isa) +
                                       " is not a path of this kernel that this CPU runs");
  }
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument("hotswap bf16 matmul: need x [M, K] and one result per weight");
  }
  const int64_t M = xd[0], K = xd[1];
  std::vector<Product> ps;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::BF16>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("hotswap bf16 matmul: bf16 weights, f32 results");
    }
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || wd[0] != K || yd.size() != 2 || yd[0] != M || yd[1] != wd[1]) {
      return ffi::Error::InvalidArgument("hotswap bf16 matmul: need w [K, N] and y [M, N] for x [M, K]");
    }
    ps.push_back(Product{reinterpret_cast<const bf16*>(w->untyped_data()), (*y)->typed_data(), wd[1]});
  }
  return Run(pool, path, reinterpret_cast<const bf16*>(x.untyped_data()), M, K, ps);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("isa")          // cpu_isa.attribute(...)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .RemainingArgs()                // weights
                                  .RemainingRets());              // one result each
