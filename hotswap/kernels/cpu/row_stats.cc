// Each logits row's argmax and logsumexp, the two statistics every sampled token needs
// (hotswap/kernels/cpu_sampling.py).
//
// Why: XLA:CPU runs jnp's argmax as a scalar (value, index) reduction, and the vector form
// the jnp sampler uses instead (max, then the first index equal to it) writes and re-reads
// an int32 copy of the logits, and logsumexp is another pass of its own. Here each row is read twice from cache, 16 lanes at
// a time, on XLA's intra-op threads.
//
// Semantics are those of `sampling.argmax` and `jax.nn.logsumexp`: the first index of the
// row's max; a row holding NaN gives index V - 1 and logsumexp NaN; an all -inf row gives
// logsumexp -inf. Shapes: logits f32 [R, V]; idx int32 [R]; lse f32 [R].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "parallel.h"
#include "vec_exp.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Stats {
  float max;
  int64_t idx;
  bool nan;
};

#if defined(__AVX512F__)
Stats MaxIndex(const float* x, int64_t V) {
  __m512 mv = _mm512_set1_ps(-kInf);
  __m512i iv = _mm512_set1_epi32(0), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 live = V - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (V - j)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-kInf), live, x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);  // strict: a lane keeps its first max
    mv = _mm512_mask_mov_ps(mv, gt, v);
    iv = _mm512_mask_mov_epi32(iv, gt, at);
    at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
  }
  const float m = _mm512_reduce_max_ps(mv);
  // Of the lanes holding the max, the smallest index (an all -inf row: every lane, index 0).
  const __mmask16 top = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(m), _CMP_EQ_OQ);
  const int32_t idx = _mm512_mask_reduce_min_epi32(top, iv);
  return {m, idx, nan != 0};
}

float SumExp(const float* x, int64_t V, float m) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 live = V - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (V - j)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + j);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(v, mv))));
  }
  return _mm512_reduce_add_ps(acc);
}
#else
Stats MaxIndex(const float* x, int64_t V) {
  Stats s{-kInf, 0, false};
  for (int64_t j = 0; j < V; ++j) {
    s.nan |= std::isnan(x[j]);
    if (x[j] > s.max) s.max = x[j], s.idx = j;
  }
  return s;
}

float SumExp(const float* x, int64_t V, float m) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < V; ++j) acc += ExpNonPositive(x[j] - m);
  return acc;
}
#endif

// mean(x * x) over one row of D values, in one order whatever the row count (deterministic
// mode's RMS norms): squares summed 16 lanes at a time lane-wise in index order, then across
// lanes. XLA's row reduction orders a row's sum by the row count.
float MeanSquareRow(const float* x, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 live = D - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (D - j)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + j);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc) / static_cast<float>(D);
#else
  float sum = 0.0f;
  for (int64_t j = 0; j < D; ++j) sum += x[j] * x[j];
  return sum / static_cast<float>(D);
#endif
}

void Row(const float* x, int64_t V, int32_t* idx, float* lse) {
  const Stats s = MaxIndex(x, V);
  if (s.nan) {
    *idx = static_cast<int32_t>(V - 1);
    *lse = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *idx = static_cast<int32_t>(s.idx);
  // -inf: an all -inf row (logsumexp -inf); +inf: logsumexp is +inf as in jax.
  *lse = std::isinf(s.max) ? s.max : s.max + std::log(SumExp(x, V, s.max));
}

ffi::Error RowStats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> idx,
                    ffi::ResultBuffer<ffi::F32> lse) {
  auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1) {
    return ffi::Error::InvalidArgument("hotswap row stats: need logits [R, V] with V >= 1");
  }
  const int64_t R = d[0], V = d[1];
  const float* x = logits.typed_data();
  int32_t* ip = idx->typed_data();
  float* lp = lse->typed_data();
  hotswap::ParallelFor(pool, R, [&](int64_t r) { Row(x + r * V, V, ip + r, lp + r); });
  return ffi::Error::Success();
}

ffi::Error RowMeanSquare(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> ms) {
  auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1) return ffi::Error::InvalidArgument("hotswap row mean square: need x [R, D], D >= 1");
  const int64_t D = d[1];
  const float* xp = x.typed_data();
  float* mp = ms->typed_data();
  // Rows in blocks of 16: a row of a small model is too little work for an item of its own.
  constexpr int64_t kRows = 16;
  const int64_t R = d[0];
  hotswap::ParallelFor(pool, (R + kRows - 1) / kRows, [&](int64_t b) {
    for (int64_t r = b * kRows; r < std::min(R, (b + 1) * kRows); ++r) mp[r] = MeanSquareRow(xp + r * D, D);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapRowMeanSquare, RowMeanSquare,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // mean of squares

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapRowStats, RowStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits
                                  .Ret<ffi::Buffer<ffi::S32>>()  // idx
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse
