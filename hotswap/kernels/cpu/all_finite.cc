// Whether each of many arrays is free of NaN and Inf: the check `update_weights` runs on
// every new weight before it swaps them in (hotswap/kernels/cpu_finite.py).
//
// Why: the check reads every weight byte once, so it is bound by memory bandwidth, and
// XLA:CPU's reductions run one array at a time well below it, slower than the rest of a
// same-sharding update. Here the arrays are cut into 1 MB
// pieces shared out over XLA's intra-op threads, each read once with AVX-512, or AVX2, where
// the CPU has it (the scalar loop cannot vectorize: its sum must not be reordered).
//
// Inputs: any number of f32 or bf16 arrays. Output: uint8 [L], 1 where array i is finite.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPieceBytes = 1 << 20;
// Lines are prefetched into L2 this far ahead: the hardware's streams stop at each 4 KB page
// and restart on its first misses; a prefetch a page ahead keeps the next page coming.
constexpr int64_t kPrefetchBytes = 4096;

// f32: x - x is 0 for a finite value and NaN for NaN or Inf, and a sum keeps the NaN.
bool FiniteF32(const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 64 <= n; i += 64) {
    const char* ahead = reinterpret_cast<const char*>(x + i) + kPrefetchBytes;  // may pass the end: no fault
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16), v2 = _mm512_loadu_ps(x + i + 32),
                 v3 = _mm512_loadu_ps(x + i + 48);
    a0 = _mm512_add_ps(a0, _mm512_sub_ps(v0, v0));
    a1 = _mm512_add_ps(a1, _mm512_sub_ps(v1, v1));
    a2 = _mm512_add_ps(a2, _mm512_sub_ps(v2, v2));
    a3 = _mm512_add_ps(a3, _mm512_sub_ps(v3, v3));
  }
  const __m512 a = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0) return false;
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 32 <= n; i += 32) {
    const char* ahead = reinterpret_cast<const char*>(x + i) + kPrefetchBytes;  // may pass the end: no fault
    for (int line = 0; line < 2; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8), v2 = _mm256_loadu_ps(x + i + 16),
                 v3 = _mm256_loadu_ps(x + i + 24);
    a0 = _mm256_add_ps(a0, _mm256_sub_ps(v0, v0));
    a1 = _mm256_add_ps(a1, _mm256_sub_ps(v1, v1));
    a2 = _mm256_add_ps(a2, _mm256_sub_ps(v2, v2));
    a3 = _mm256_add_ps(a3, _mm256_sub_ps(v3, v3));
  }
  const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  if (_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0) return false;
#endif
  float acc = 0.0f;
  for (; i < n; ++i) acc += x[i] - x[i];
  return acc == 0.0f;
}

// bf16: NaN and Inf are the values whose 8 exponent bits are all ones.
bool FiniteBF16(const uint16_t* x, int64_t n) {
  uint16_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint16_t>((x[i] & 0x7F80) == 0x7F80);
  return bad == 0;
}

ffi::Error AllFinite(ffi::ThreadPool pool, ffi::RemainingArgs arrays, ffi::Result<ffi::Buffer<ffi::U8>> out) {
  const int64_t n = static_cast<int64_t>(arrays.size());
  if (out->element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument("hotswap all_finite: need one output per array");
  }
  struct Piece {
    int64_t array;
    const void* data;
    int64_t count;
    bool bf16;
  };
  std::vector<Piece> pieces;
  for (int64_t a = 0; a < n; ++a) {
    auto buf = arrays.get<ffi::AnyBuffer>(a);
    if (!buf.has_value()) return ffi::Error::InvalidArgument("hotswap all_finite: an argument is not a buffer");
    const ffi::DataType t = buf->element_type();
    if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("hotswap all_finite: arrays must be f32 or bf16");
    }
    const bool bf16 = t == ffi::DataType::BF16;
    const int64_t size = bf16 ? 2 : 4, count = static_cast<int64_t>(buf->element_count());
    const int64_t step = kPieceBytes / size;
    const char* base = static_cast<const char*>(buf->untyped_data());
    for (int64_t i = 0; i < count; i += step) pieces.push_back({a, base + i * size, std::min(step, count - i), bf16});
  }
  std::vector<uint8_t> ok(pieces.size(), 1);
  hotswap::ParallelFor(pool, static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    const Piece& p = pieces[i];
    ok[i] = p.bf16 ? FiniteBF16(static_cast<const uint16_t*>(p.data), p.count)
                   : FiniteF32(static_cast<const float*>(p.data), p.count);
  });
  uint8_t* o = out->typed_data();
  std::fill(o, o + n, 1);
  for (size_t i = 0; i < pieces.size(); ++i) o[pieces[i].array] &= ok[i];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapAllFinite, AllFinite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()                 // the arrays
                                  .Ret<ffi::Buffer<ffi::U8>>());  // 1 where finite
