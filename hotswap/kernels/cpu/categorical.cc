// One categorical draw per logits row by the inverse CDF (hotswap/kernels/cpu_sampling.py):
// the sampler's draw on XLA:CPU.
//
// Why: a Gumbel-max draw (jax.random.categorical) needs a random number, a log and a log of a
// log for every entry of the row. On XLA:CPU those cost about 8 ms of a 51 ms batch-64 decode
// step at a 32k vocabulary: threefry bits alone take 4.6 ms. The inverse CDF needs one uniform
// per row, which comes in from jax, and an exp per entry: the row is read for its max, then
// exp(x - max) is written to scratch with a sum per block of 512, and the draw walks the
// block sums, then one block, to the first entry whose running sum passes u x total. The
// same distribution, a different token than the Gumbel draw for a given uniform.
//
// Semantics match the jnp twin (`reference.categorical`): masked entries (-inf) have zero
// probability; a row whose running sum never passes the target (rounding at u near 1) takes
// its last entry of non-zero probability; an all -inf row gives 0, a row with NaN gives V - 1,
// and a +inf entry is taken as certain (its first index). Shapes: scaled f32 [R, V] (logits /
// temperature, filtered entries -inf); u f32 [R] in [0, 1); tokens int32 [R].

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
constexpr int64_t kBlock = 512;  // entries per partial sum: the walk's first level

int32_t DrawRow(const float* x, int64_t V, float u, std::vector<float>& e, std::vector<double>& sums) {
  float m = -kInf;
  bool nan = false;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t j = 0; j < V; ++j) {
    m = std::max(m, x[j]);
    nan |= x[j] != x[j];
  }
  if (nan) return static_cast<int32_t>(V - 1);
  if (m == -kInf) return 0;
  if (m == kInf) return static_cast<int32_t>(std::find(x, x + V, kInf) - x);
  e.resize(V);
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = lo; j < hi; ++j) {
      const float p = x[j] == -kInf ? 0.0f : ExpNonPositive(x[j] - m);  // a masked entry: exactly 0
      e[j] = p;
      s += p;
    }
    sums[b] = s;
    total += s;
  }
  const double target = static_cast<double>(u) * total;
  double acc = 0.0;
  int64_t last = 0;  // the last entry of non-zero probability seen: the fallback
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] == 0.0) continue;
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    if (acc + sums[b] <= target && b + 1 < blocks) {
      acc += sums[b];
      for (int64_t j = hi - 1; j >= lo; --j) {
        if (e[j] > 0.0f) {
          last = j;
          break;
        }
      }
      continue;
    }
    for (int64_t j = lo; j < hi; ++j) {
      if (e[j] == 0.0f) continue;
      last = j;
      acc += e[j];
      if (acc > target) return static_cast<int32_t>(j);
    }
  }
  return static_cast<int32_t>(last);
}

ffi::Error Categorical(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scaled, ffi::Buffer<ffi::F32> u,
                       ffi::ResultBuffer<ffi::S32> tokens) {
  auto d = scaled.dimensions();
  if (d.size() != 2 || d[1] < 1 || u.element_count() != d[0]) {
    return ffi::Error::InvalidArgument("hotswap categorical: need scaled [R, V] with V >= 1 and u [R]");
  }
  const int64_t V = d[1];
  const float* x = scaled.typed_data();
  const float* up = u.typed_data();
  int32_t* out = tokens->typed_data();
  hotswap::ParallelFor(pool, d[0], [&](int64_t r) {
    thread_local std::vector<float> e;  // the row's exp(x - max): re-read by the walk from cache
    thread_local std::vector<double> sums;
    out[r] = DrawRow(x + r * V, V, up[r], e, sums);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapCategorical, Categorical,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scaled
                                  .Arg<ffi::Buffer<ffi::F32>>()    // u
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens
