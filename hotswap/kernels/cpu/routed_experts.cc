// The routed experts of a MoE layer for the few token-expert pairs of a decode step, on XLA's
// intra-op threads (hotswap/kernels/cpu_experts.py).
//
// Why: a decode step routes each token to k of the layer's E experts, whose weights are stacked
// leaves (gate/up [E, D, F], down [E, F, D]). In jnp each pair's matrices are dynamic slices of
// the stacks; XLA:CPU copies every slice into a fresh buffer before its dot, so the step moved
// each routed expert's bytes twice and then ran a dot of one row. Here each pair's rows are read
// in place from the stacks, once per expert for all the pairs routed to it, straight from the
// argument buffers: the step reads the routed experts' bytes once and no other expert's.
//
// Per layer: out[t] = sum_j weights[t, j] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)), e =
// experts[t, j], with f32 products and sums. The pairs are grouped by expert, and each group's
// products are cut into items, about two per thread, claimed in two parallel regions:
//   1. gate and up: an item per (expert, matrix, range of D) writes partial sums [N, F];
//   2. down: an item per (expert, range of F) adds up its range's gate and up partials, takes
//      silu(g) * u and multiplies it into partial sums [N, D];
// then each token's k outputs (their ranges added) are summed with its weights in pair order.
// Items split the contraction, not the columns: each streams whole weight rows, one contiguous
// run of the expert's matrix, as the small-row GEMV does (`small_matmul.cc`); split by columns,
// an item reads a segment of every row (a row of a [768, 1024] f32 expert is a page) and the
// experts ran well behind the dense GEMV of the same bytes. Rows are prefetched a few ahead and
// multiplied into accumulators held in L1, four weight rows per pass; only when many pairs share
// an expert (their accumulators would spill L1) are the columns cut too.
//
// `round` (activations in bf16): gate, up, act and each expert's output rounded to bf16 where
// the jnp twin's bf16 arrays round them (routed_experts.py), so both give the same values up to
// the order of the sums.
//
// Shapes: x f32 [T, D]; experts int32 [T, k] (clamped into [0, E), as a dynamic slice clamps);
// weights f32 [T, k]; gate, up [E, D, F] and down [E, F, D], all f32 or all bf16; out f32 [T, D].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HOTSWAP_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

using hotswap::bf16;
using hotswap::Widen;

// f32 -> the nearest bf16, back in f32: where the jnp twin rounds a bf16 activation.
inline float RoundBf16(float v) { return Widen(hotswap::ToBf16(v)); }

// Accumulators an item holds (rows x columns): 8 KB, so they and the four weight rows of a pass
// stay in L1.
constexpr int64_t kAccFloats = 2048;
constexpr int64_t kAhead = 8;           // weight rows prefetched ahead of the pass that reads them
constexpr int64_t kItemsPerThread = 2;  // a thread that starts late leaves its share to the others
constexpr int64_t kMinRange = 64;       // rows of K an item reads at least

inline void PrefetchRow(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 3);
}

#if HOTSWAP_AVX2
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// acc[0:n] += a*w0[0:n] + b*w1[0:n] + c*w2[0:n] + d*w3[0:n], each column's terms in that order.
template <typename W>
inline void Axpy4(float* __restrict acc, const W* w0, const W* w1, const W* w2, const W* w3, float a, float b,
                  float c, float d, int64_t n) {
  int64_t j = 0;
#if HOTSWAP_AVX2
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), vc = _mm256_set1_ps(c), vd = _mm256_set1_ps(d);
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(acc + j);
    v = _mm256_fmadd_ps(va, Load8(w0 + j), v);
    v = _mm256_fmadd_ps(vb, Load8(w1 + j), v);
    v = _mm256_fmadd_ps(vc, Load8(w2 + j), v);
    v = _mm256_fmadd_ps(vd, Load8(w3 + j), v);
    _mm256_storeu_ps(acc + j, v);
  }
#endif
  for (; j < n; ++j) {
    float v = acc[j];  // plain products: std::fma is a library call on CPUs without FMA
    v += a * Widen(w0[j]);
    v += b * Widen(w1[j]);
    v += c * Widen(w2[j]);
    v += d * Widen(w3[j]);
    acc[j] = v;
  }
}

template <typename W>
inline void Axpy1(float* __restrict acc, const W* w0, float a, int64_t n) {
  int64_t j = 0;
#if HOTSWAP_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(va, Load8(w0 + j), _mm256_loadu_ps(acc + j)));
#endif
  for (; j < n; ++j) acc[j] += a * Widen(w0[j]);
}

// acc[r, 0:n] = xs[r][0:K] @ w[0:K, 0:n] for R rows (w: row stride ldw, already offset to the
// chunk's first column). One pass of four weight rows serves every row r while in L1.
template <typename W>
void Segment(const float* const* xs, int64_t R, const W* w, int64_t ldw, int64_t K, int64_t n, float* acc) {
  std::fill(acc, acc + R * n, 0.0f);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(W));
  for (int64_t k = 0; k < std::min(K, kAhead); ++k) PrefetchRow(w + k * ldw, bytes);
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    for (int64_t p = k + kAhead; p < std::min(K, k + kAhead + 4); ++p) PrefetchRow(w + p * ldw, bytes);
    const W* w0 = w + k * ldw;
    for (int64_t r = 0; r < R; ++r) {
      const float* x = xs[r] + k;
      Axpy4(acc + r * n, w0, w0 + ldw, w0 + 2 * ldw, w0 + 3 * ldw, x[0], x[1], x[2], x[3], n);
    }
  }
  for (; k < K; ++k)
    for (int64_t r = 0; r < R; ++r) Axpy1(acc + r * n, w + k * ldw, xs[r][k], n);
}

// The pairs routed to one expert: their indices into the [N] pairs (t * k + j), in order.
struct Group {
  int64_t expert;
  std::vector<int64_t> pairs;
};

// How a product's work is cut: column chunks of `width` (the last shorter) times `ks` ranges
// of K whose partial sums are added afterwards.
struct Cut {
  int64_t width, chunks, ks;
  int64_t items() const { return chunks * ks; }
};

// The cut of `units` independent products (group x matrix) of [rows <= most_rows, K] x [K, cols]:
// columns only as far as the accumulators need, then ranges of K up to kItemsPerThread items
// per thread over all units.
Cut Plan(int64_t units, int64_t K, int64_t cols, int64_t most_rows, int64_t threads) {
  const int64_t want = (kItemsPerThread * threads + units - 1) / units;  // items per unit
  const int64_t widest = std::max<int64_t>(8, kAccFloats / std::max<int64_t>(most_rows, 1) / 8 * 8);
  const int64_t chunks = (cols + widest - 1) / widest;
  const int64_t ks = std::clamp<int64_t>((want + chunks - 1) / chunks, 1, std::max<int64_t>(K / kMinRange, 1));
  const int64_t width = std::max<int64_t>(((cols + chunks - 1) / chunks + 7) / 8 * 8, 8);  // 8-lane vectors
  return {width, std::max<int64_t>((cols + width - 1) / width, 1), ks};
}

inline float Silu(float v) { return v / (1.0f + std::exp(-v)); }

template <typename W>
void Run(ffi::ThreadPool& pool, const float* x, const int32_t* experts, const float* weights, const W* gate,
         const W* up, const W* down, float* out, int64_t T, int64_t k, int64_t E, int64_t D, int64_t F,
         bool round) {
  const int64_t N = T * k, threads = std::max<int64_t>(pool.num_threads(), 1);
  std::fill(out, out + T * D, 0.0f);
  if (N == 0 || D == 0) return;
  // Pairs grouped by expert, experts in order of first use: each routed expert read once.
  std::vector<Group> groups;
  std::vector<int64_t> slot(E, -1);
  int64_t most_rows = 0;
  for (int64_t p = 0; p < N; ++p) {
    const int64_t e = std::clamp<int64_t>(experts[p], 0, E - 1);
    if (slot[e] < 0) slot[e] = static_cast<int64_t>(groups.size()), groups.push_back({e, {}});
    groups[slot[e]].pairs.push_back(p);
    most_rows = std::max<int64_t>(most_rows, static_cast<int64_t>(groups[slot[e]].pairs.size()));
  }
  const int64_t G = static_cast<int64_t>(groups.size());
  auto R = [&](float v) { return round ? RoundBf16(v) : v; };

  // 1. Partial gate and up products: part1[s][m][p] = x[t] @ {gate, up}_e over K range s.
  const Cut c1 = Plan(2 * G, D, F, most_rows, threads);
  std::unique_ptr<float[]> part1(new float[c1.ks * 2 * N * F]);
  hotswap::ParallelFor(pool, 2 * G * c1.items(), [&](int64_t item) {
    const int64_t unit = item / c1.items(), rest = item % c1.items();
    const Group& g = groups[unit / 2];
    const int64_t m = unit % 2, s = rest % c1.ks, n0 = rest / c1.ks * c1.width, n = std::min(c1.width, F - n0);
    const int64_t k0 = D * s / c1.ks, k1 = D * (s + 1) / c1.ks, rows = static_cast<int64_t>(g.pairs.size());
    std::vector<const float*> xs(rows);
    for (int64_t r = 0; r < rows; ++r) xs[r] = x + g.pairs[r] / k * D + k0;
    std::vector<float> acc(rows * n);
    const W* w = (m == 0 ? gate : up) + g.expert * D * F + k0 * F + n0;
    Segment(xs.data(), rows, w, F, k1 - k0, n, acc.data());
    for (int64_t r = 0; r < rows; ++r)
      std::copy(acc.data() + r * n, acc.data() + (r + 1) * n, part1.get() + ((s * 2 + m) * N + g.pairs[r]) * F + n0);
  });
  // 2. Partial down products: part2[s][p] = act[p] @ down_e over K range s, act[p] = silu(gate)
  // * up over that range computed here from the partial sums (added in range order).
  const Cut c2 = Plan(G, F, D, most_rows, threads);
  std::unique_ptr<float[]> part2(new float[c2.ks * N * D]);
  hotswap::ParallelFor(pool, G * c2.items(), [&](int64_t item) {
    const Group& g = groups[item / c2.items()];
    const int64_t rest = item % c2.items(), s = rest % c2.ks, n0 = rest / c2.ks * c2.width;
    const int64_t n = std::min(c2.width, D - n0), k0 = F * s / c2.ks, k1 = F * (s + 1) / c2.ks;
    const int64_t rows = static_cast<int64_t>(g.pairs.size()), kn = k1 - k0;
    std::vector<float> act(rows * kn);
    std::vector<const float*> xs(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = g.pairs[r];
      float* a = act.data() + r * kn;
      for (int64_t c = 0; c < kn; ++c) {
        float gs = 0.0f, us = 0.0f;
        for (int64_t q = 0; q < c1.ks; ++q) {
          gs += part1[((q * 2) * N + p) * F + k0 + c];
          us += part1[((q * 2 + 1) * N + p) * F + k0 + c];
        }
        a[c] = R(Silu(R(gs)) * R(us));
      }
      xs[r] = a;
    }
    std::vector<float> acc(rows * n);
    Segment(xs.data(), rows, down + g.expert * F * D + k0 * D + n0, D, kn, n, acc.data());
    for (int64_t r = 0; r < rows; ++r)
      std::copy(acc.data() + r * n, acc.data() + (r + 1) * n, part2.get() + (s * N + g.pairs[r]) * D + n0);
  });

  // 3. out[t] = sum_j weights[t, j] * ys[t * k + j], j in order.
  hotswap::ParallelFor(pool, T, [&](int64_t t) {
    float* o = out + t * D;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = t * k + j;
      const float wt = weights[p];
      for (int64_t c = 0; c < D; ++c) {
        float y = 0.0f;
        for (int64_t s = 0; s < c2.ks; ++s) y += part2[(s * N + p) * D + c];
        o[c] += wt * R(y);
      }
    }
  });
}

ffi::Error RoutedExperts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> experts,
                         ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                         ffi::ResultBuffer<ffi::F32> out, bool round) {
  auto xd = x.dimensions(), ed = experts.dimensions(), wd = weights.dimensions();
  auto gd = gate.dimensions(), ud = up.dimensions(), dd = down.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || ed[0] != xd[0] || wd.size() != 2 || wd[0] != ed[0] ||
      wd[1] != ed[1]) {
    return ffi::Error::InvalidArgument("hotswap routed experts: need x [T, D], experts and weights [T, k]");
  }
  const int64_t T = xd[0], D = xd[1], k = ed[1];
  if (gd.size() != 3 || gd[1] != D || ud.size() != 3 || ud[0] != gd[0] || ud[1] != D || ud[2] != gd[2] ||
      dd.size() != 3 || dd[0] != gd[0] || dd[1] != gd[2] || dd[2] != D || gd[0] < 1) {
    return ffi::Error::InvalidArgument(
        "hotswap routed experts: need gate, up [E, D, F] and down [E, F, D] for x [T, D], E >= 1");
  }
  const int64_t E = gd[0], F = gd[2];
  const auto type = gate.element_type();
  if (up.element_type() != type || down.element_type() != type ||
      (type != ffi::DataType::F32 && type != ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("hotswap routed experts: gate, up and down all f32 or all bf16");
  }
  const float *xp = x.typed_data(), *wp = weights.typed_data();
  const int32_t* ep = experts.typed_data();
  const void *g = gate.untyped_data(), *u = up.untyped_data(), *d = down.untyped_data();
  float* o = out->typed_data();
  if (type == ffi::DataType::F32) {
    using W = float;
    Run(pool, xp, ep, wp, static_cast<const W*>(g), static_cast<const W*>(u), static_cast<const W*>(d), o, T, k, E,
        D, F, round);
  } else {
    using W = bf16;
    Run(pool, xp, ep, wp, static_cast<const W*>(g), static_cast<const W*>(u), static_cast<const W*>(d), o, T, k, E,
        D, F, round);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapRoutedExperts, RoutedExperts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // experts [T, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, k]
                                  .Arg<ffi::AnyBuffer>()         // gate [E, D, F]
                                  .Arg<ffi::AnyBuffer>()         // up [E, D, F]
                                  .Arg<ffi::AnyBuffer>()         // down [E, F, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, D]
                                  .Attr<bool>("round"));         // bf16 activations: round as they do
