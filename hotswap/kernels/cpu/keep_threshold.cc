// Each logits row's keep threshold for top-k, top-p and min-p without sorting the row
// (hotswap/kernels/cpu_sampling.py; the jnp twin is `reference.keep_thresholds`).
//
// Why: XLA:CPU sorts a [R, V] logits array in the time of hundreds of passes over it. Every filter keeps
// an upper set of the row's values, so each is one threshold:
//   top-k: the k-th largest value (its ties kept);
//   top-p: the least value x whose strictly larger entries' mass is below top_p (the smallest
//          set of largest entries reaching top_p, ties of its last entry kept);
//   min-p: max + log(min_p) (probs >= min_p * max prob).
// The row keeps x >= the largest of the three. Top-k and top-p are the same search with
// weights 1 or exp(x - max): the least key c with W(keys > c) < target. It is a radix
// select over the float's order-preserving 32-bit key: an 11-bit histogram of the row (count
// or mass per bin), the bin where the mass above first reaches the target, then the next
// digits over that bin's entries alone. Mass is summed in double.
//
// Shapes: scaled f32 [R, V] (logits / temperature); top_k s32 [R] (<= 0 or >= V: off);
// top_p f32 [R] (>= 1: off); min_p f32 [R] (<= 0: off); threshold f32 [R] (-inf: keep all).
// A row holding NaN gets an unspecified threshold (its draw is garbage either way).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "vec_exp.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kDigitBits[3] = {11, 11, 10};  // 32 bits, most significant first
constexpr int kShift[3] = {21, 10, 0};

// Unsigned keys with the float order: a float's bits, the sign bit flipped for x >= 0 and
// every bit for x < 0. -0 + 0 is +0, so a zero's ties are kept whatever its sign. Written
// branch-free over restrict pointers so the loop vectorizes; returns the largest key.
uint32_t Keys(const float* __restrict x, uint32_t* __restrict keys, int64_t V) {
  uint32_t top = 0;
  for (int64_t j = 0; j < V; ++j) {
    const uint32_t b = __builtin_bit_cast(uint32_t, x[j] + 0.0f);
    const uint32_t k = b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);
    keys[j] = k;
    top = top > k ? top : k;
  }
  return top;
}

inline float FromKey(uint32_t k) {
  return __builtin_bit_cast(float, k ^ (~static_cast<uint32_t>(static_cast<int32_t>(k) >> 31) | 0x80000000u));
}

struct Scratch {
  std::vector<uint32_t> keys[3];  // the row's keys, then a bin's entries at each level down
  std::vector<float> w[3];  // their weights: exp(x - max) of the row, then of a bin's entries
};

// The entries of bin d (digit (key >> shift) & mask == d) into k2/w2: no branch per entry,
// since a bin's entries are scattered over the row. k2/w2 hold n + 16 entries.
int64_t Compact(const uint32_t* keys, const float* w, int64_t n, int shift, uint32_t mask, uint32_t d,
                uint32_t* k2, float* w2) {
  int64_t m = 0, i = 0;
#if defined(__AVX512F__)
  const __m512i dv = _mm512_set1_epi32(static_cast<int>(d)), mv = _mm512_set1_epi32(static_cast<int>(mask));
  for (; i + 16 <= n; i += 16) {
    const __m512i k = _mm512_loadu_si512(keys + i);
    const __mmask16 in = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_srli_epi32(k, shift), mv), dv);
    // Compress in a register, then a plain store: a compressing store to memory is slow on some
    // cores (microcoded on Zen 4).
    _mm512_storeu_si512(k2 + m, _mm512_maskz_compress_epi32(in, k));
    if (w) _mm512_storeu_ps(w2 + m, _mm512_maskz_compress_ps(in, _mm512_loadu_ps(w + i)));
    m += __builtin_popcount(in);
  }
#endif
  for (; i < n; ++i) {
    k2[m] = keys[i];
    if (w) w2[m] = w[i];
    m += ((keys[i] >> shift) & mask) == d;
  }
  return m;
}

// The least key c among the n entries (keys, weights w or 1 when w is null) with
// above + W(keys > c) < target, given that `above` (the weight of entries outside these, all
// larger) is below it; the least key when every entry qualifies. `level` is the digit to
// split on (the entries share the digits before it). With weights, `target` at level 0 is a
// fraction of their total (the histogram's sum: top-p's mass without a pass of its own).
uint32_t Select(const uint32_t* keys, const float* w, int64_t n, double above, double target, int level,
                Scratch& s) {
  const int bins = 1 << kDigitBits[level], shift = kShift[level];
  const uint32_t mask = bins - 1;
  double hist[2048] = {};
  if (w) {
    for (int64_t i = 0; i < n; ++i) hist[(keys[i] >> shift) & mask] += w[i];
  } else {
    for (int64_t i = 0; i < n; ++i) hist[(keys[i] >> shift) & mask] += 1.0;
  }
  if (level == 0 && w) {
    double total = 0.0;
    for (int d = 0; d < bins; ++d) total += hist[d];
    target *= total;
    // A target that is not positive (top_p <= 0) keeps the max and its ties, as a tiny one
    // does; it must be positive for the search to descend only into bins that hold entries.
    if (!(target > 0.0)) target = 1e-300;
  }
  for (int d = bins - 1; d >= 0; --d) {
    if (above + hist[d] < target) {  // every entry of bin d has less than target above it
      above += hist[d];
      continue;
    }
    // Bin d holds the threshold: its largest entry has `above` < target above it.
    if (level == 2) return (keys[0] & ~mask) | static_cast<uint32_t>(d);
    std::vector<uint32_t>& k2 = s.keys[level + 1];
    std::vector<float>& w2 = s.w[level + 1];
    k2.resize(n + 16);
    if (w) w2.resize(n + 16);
    const int64_t m = Compact(keys, w, n, shift, mask, d, k2.data(), w2.data());
    return Select(k2.data(), w ? w2.data() : nullptr, m, above, target, level + 1, s);
  }
  uint32_t least = 0xFFFFFFFFu;  // every entry qualifies
  for (int64_t i = 0; i < n; ++i) least = std::min(least, keys[i]);
  return least;
}

float Row(const float* x, int64_t V, int32_t top_k, float top_p, float min_p, Scratch& s) {
  const bool k_on = top_k > 0 && top_k < V, p_on = top_p < 1.0f, m_on = min_p > 0.0f;
  float t = -kInf;
  if (!(k_on || p_on || m_on)) return t;
  std::vector<uint32_t>& keys = s.keys[0];
  keys.resize(V);
  const float m = FromKey(Keys(x, keys.data(), V));  // the row's max
  if (m == -kInf) return t;  // nothing to filter (and no finite mass)
  if (m_on) t = m + std::log(min_p);
  if (k_on) t = std::max(t, FromKey(Select(keys.data(), nullptr, V, 0.0, top_k, 0, s)));
  if (p_on) {
    std::vector<float>& e = s.w[0];
    e.resize(V);
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    for (; j + 16 <= V; j += 16) _mm512_storeu_ps(&e[j], Exp512(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv)));
#endif
    for (; j < V; ++j) e[j] = ExpNonPositive(x[j] - m);
    t = std::max(t, FromKey(Select(keys.data(), e.data(), V, 0.0, top_p, 0, s)));
  }
  return t;
}

ffi::Error KeepThreshold(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scaled, ffi::Buffer<ffi::S32> top_k,
                         ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                         ffi::ResultBuffer<ffi::F32> threshold) {
  auto d = scaled.dimensions();
  if (d.size() != 2 || d[1] < 1) {
    return ffi::Error::InvalidArgument("hotswap keep threshold: need logits [R, V] with V >= 1");
  }
  const int64_t R = d[0], V = d[1];
  const float* x = scaled.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* p = top_p.typed_data();
  const float* mp = min_p.typed_data();
  float* t = threshold->typed_data();
  hotswap::ParallelFor(pool, R, [&](int64_t r) {
    thread_local Scratch s;
    t[r] = Row(x + r * V, V, k[r], p[r], mp[r], s);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapKeepThreshold, KeepThreshold,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scaled logits
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p
                                  .Ret<ffi::Buffer<ffi::F32>>());  // threshold
