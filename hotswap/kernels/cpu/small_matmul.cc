// y[M, N] = x[M, K] @ w[K, N] in f32 for the few rows of a decode step, on XLA's intra-op
// threads (hotswap/kernels/cpu_matmul.py).
//
// Why: XLA:CPU emits a matrix-vector product as single-threaded loops, so a batch-1 decode
// step read its weights at one core's bandwidth (about 31 GB/s here, where the two cores
// reach 47 GB/s on the 98 MB head, which XLA hands to Eigen). Decode is bound by reading
// the weights, so this kernel splits the output columns over the threads and streams each
// weight row segment once per tile of rows.
//
// Layout: row-major x [M, K], w [K, N], y [M, N]. Correct for any M; the engine uses it
// for one or two rows only (from four rows on, XLA's own dot was as fast or faster).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows [k0, k1) of w times columns [k0, k1) of x, into part[M, N]: each thread streams a
// contiguous run of whole weight rows, the best access pattern for the prefetchers.
void KSlice(const float* __restrict x, const float* __restrict w, float* __restrict part, int64_t M, int64_t K,
            int64_t N, int64_t k0, int64_t k1) {
  std::fill(part, part + M * N, 0.0f);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const float* w0 = w + k * N;
    const float *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
    for (int64_t r = 0; r < M; ++r) {
      const float *xr = x + r * K + k;
      const float a = xr[0], b = xr[1], c = xr[2], d = xr[3];
      float* pr = part + r * N;
#pragma GCC ivdep
      for (int64_t n = 0; n < N; ++n) pr[n] += a * w0[n] + b * w1[n] + c * w2[n] + d * w3[n];
    }
  }
  for (; k < k1; ++k) {
    const float* wk = w + k * N;
    for (int64_t r = 0; r < M; ++r) {
      const float a = x[r * K + k];
      float* pr = part + r * N;
      for (int64_t n = 0; n < N; ++n) pr[n] += a * wk[n];
    }
  }
}

// Same claiming scheme as paged_attention.cc: the caller works too and waits only for
// parts already claimed; the state is on the heap for helpers that start late.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
};

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("hotswap small matmul: need x [M, K] and w [K, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Split the rows of w (K) over the threads and sum the partial products: splitting the
  // columns (N) instead read strided row segments and reached 36 GB/s, not 40.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t parts = std::min<int64_t>(2 * threads, std::max<int64_t>(K / 64, 1));
  auto work = std::make_shared<Work>();
  auto partial = std::shared_ptr<float[]>(new float[parts * M * N]);
  float* pp = partial.get();
  auto task = [=](Work& s) {
    for (int64_t c; (c = s.next.fetch_add(1)) < parts;) {
      KSlice(xp, wp, pp + c * M * N, M, K, N, K * c / parts, K * (c + 1) / parts);
      s.done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, parts) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work, partial, task] { task(*work); });
  task(*work);
  while (work->done.load() < parts) std::this_thread::yield();
  std::memcpy(yp, pp, M * N * sizeof(float));
  for (int64_t c = 1; c < parts; ++c) {
    const float* pc = pp + c * M * N;
    for (int64_t i = 0; i < M * N; ++i) yp[i] += pc[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>());
