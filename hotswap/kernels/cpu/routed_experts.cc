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
// experts[t, j], with f32 products and sums. Two parallel regions:
//   1. items (expert, column chunk of F): every pair routed to that expert, gate and up over
//      the chunk's columns, then act = silu(g) * u into a scratch [N, F];
//   2. items (expert, column chunk of D): act @ down into a scratch [N, D];
// then each token's k rows summed with its weights in pair order. A column chunk streams its
// weight row segments (prefetched a few rows ahead: a row of a wide expert is a page away from
// the next, where the hardware prefetchers stop) into accumulators held in L1, four weight rows
// per pass. A column's sum runs over k = 0 .. K-1 in order whatever the pairs or threads, so a
// token's result does not depend on the tokens beside it.
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

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HOTSWAP_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

using bf16 = uint16_t;  // XLA FFI's BF16 storage type
inline float Widen(float v) { return v; }
inline float Widen(bf16 v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }

// f32 -> the nearest bf16 (ties to even), back in f32; NaN stays NaN.
inline float RoundBf16(float v) {
  uint32_t u = __builtin_bit_cast(uint32_t, v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return v;
  u += 0x7fffu + ((u >> 16) & 1u);
  return __builtin_bit_cast(float, u & 0xffff0000u);
}

// Accumulators per matrix an item holds (rows x columns): 8 KB, so a chunk's gate and up
// accumulators and the four weight row segments of a pass stay in L1.
constexpr int64_t kAccFloats = 2048;
constexpr int64_t kMinWidth = 64;  // narrower chunks read too little of a row per page visited
constexpr int64_t kAhead = 8;      // weight rows prefetched ahead of the pass that reads them

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

// Column chunks of a width: `chunks` chunks of `width` columns (the last shorter) over [0, cols).
struct Chunks {
  int64_t width, chunks;
};

// Enough chunks per group for about two items per thread (the dynamic claiming then evens out
// a thread that starts late), each at least kMinWidth columns and its accumulators within
// kAccFloats for the group's rows.
Chunks Plan(int64_t cols, int64_t groups, int64_t most_rows, int64_t threads) {
  const int64_t want = (2 * threads + groups - 1) / groups;
  const int64_t widest = std::max<int64_t>(8, kAccFloats / std::max<int64_t>(most_rows, 1) / 8 * 8);
  int64_t chunks = std::min(want, std::max<int64_t>(cols / kMinWidth, 1));
  chunks = std::max(chunks, (cols + widest - 1) / widest);
  int64_t width = (cols + chunks - 1) / chunks;
  width = std::max<int64_t>((width + 7) / 8 * 8, 8);  // whole 8-lane vectors but the last chunk's
  return {width, std::max<int64_t>((cols + width - 1) / width, 1)};
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
  std::unique_ptr<float[]> act(new float[N * F]), ys(new float[N * D]);
  auto R = [&](float v) { return round ? RoundBf16(v) : v; };

  // 1. act[p] = silu(x[t] @ gate_e) * (x[t] @ up_e) for every pair p = (t, j).
  const Chunks cf = Plan(F, G, most_rows, threads);
  hotswap::ParallelFor(pool, G * cf.chunks, [&](int64_t item) {
    const Group& g = groups[item / cf.chunks];
    const int64_t n0 = item % cf.chunks * cf.width, n = std::min(cf.width, F - n0);
    const int64_t rows = static_cast<int64_t>(g.pairs.size());
    std::vector<const float*> xs(rows);
    for (int64_t r = 0; r < rows; ++r) xs[r] = x + g.pairs[r] / k * D;
    std::vector<float> acc(2 * rows * n);
    float *ag = acc.data(), *au = ag + rows * n;
    Segment(xs.data(), rows, gate + g.expert * D * F + n0, F, D, n, ag);
    Segment(xs.data(), rows, up + g.expert * D * F + n0, F, D, n, au);
    for (int64_t r = 0; r < rows; ++r) {
      float* a = act.get() + g.pairs[r] * F + n0;
      for (int64_t c = 0; c < n; ++c) a[c] = R(Silu(R(ag[r * n + c])) * R(au[r * n + c]));
    }
  });

  // 2. ys[p] = act[p] @ down_e.
  const Chunks cd = Plan(D, G, most_rows, threads);
  hotswap::ParallelFor(pool, G * cd.chunks, [&](int64_t item) {
    const Group& g = groups[item / cd.chunks];
    const int64_t n0 = item % cd.chunks * cd.width, n = std::min(cd.width, D - n0);
    const int64_t rows = static_cast<int64_t>(g.pairs.size());
    std::vector<const float*> xs(rows);
    for (int64_t r = 0; r < rows; ++r) xs[r] = act.get() + g.pairs[r] * F;
    std::vector<float> acc(rows * n);
    Segment(xs.data(), rows, down + g.expert * F * D + n0, D, F, n, acc.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* y = ys.get() + g.pairs[r] * D + n0;
      for (int64_t c = 0; c < n; ++c) y[c] = R(acc[r * n + c]);
    }
  });

  // 3. out[t] = sum_j weights[t, j] * ys[t * k + j], j in order.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const float wt = weights[t * k + j];
      const float* y = ys.get() + (t * k + j) * D;
      float* o = out + t * D;
      for (int64_t c = 0; c < D; ++c) o[c] += wt * y[c];
    }
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
  float* o = out->typed_data();
  if (type == ffi::DataType::F32) {
    Run(pool, x.typed_data(), experts.typed_data(), weights.typed_data(), static_cast<const float*>(gate.untyped_data()),
        static_cast<const float*>(up.untyped_data()), static_cast<const float*>(down.untyped_data()), o, T, k, E, D,
        F, round);
  } else {
    Run(pool, x.typed_data(), experts.typed_data(), weights.typed_data(), static_cast<const bf16*>(gate.untyped_data()),
        static_cast<const bf16*>(up.untyped_data()), static_cast<const bf16*>(down.untyped_data()), o, T, k, E, D, F,
        round);
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
