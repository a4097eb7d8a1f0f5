// One HF tensor into the params layout, checked for NaN/Inf on the way: the CPU conversion of
// a checkpoint update (hotswap/kernels/cpu_convert.py, used by engine/hf_device.py).
//
// Why: an update from an HF directory must read the file's bytes and write the new params
// once each. HF linear weights are [out, in] and params [in, out], so most tensors change
// layout; as a numpy finiteness pass, then XLA's transpose into a fresh buffer, every byte
// was read twice and XLA's transpose ran well below memory speed. Here each tensor is read
// once, in 16-row strips (a transpose) or 1 MB pieces (a copy) shared out over XLA's
// intra-op threads, checked while in registers, and written once (non-temporal stores where
// the rows are whole cache lines, so the new buffer is not read in first).
//
// Inputs: x, [R, C] when transposing (any shape otherwise). Attr transpose: 1 for
// y[c, r] = x[r, c] (y's bytes are x^T's, whatever y's shape), 0 for a copy. Outputs: y (x's
// element count), ok uint8 [] = 1 when x holds no NaN/Inf. Dtypes x -> y: f32 -> f32,
// bf16 -> bf16, or bf16 -> f32 (exact: a bf16 is the top half of an f32, so y is finite
// exactly where x is). Every value passes through an f32 register: a bf16 is widened by a
// shift and narrowed back by taking its top half, so bf16 bits come out unchanged.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using hotswap::bf16;
using hotswap::Widen;

constexpr int64_t kCopyPiece = 1 << 20;  // bytes of x in a copy's work item
constexpr int64_t kStrip = 16;           // rows of x in a transpose's work item

template <typename Out>
Out Narrow(float v);
template <>
inline float Narrow<float>(float v) {
  return v;
}
template <>
inline bf16 Narrow<bf16>(float v) {  // only ever given a widened bf16: exact
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<bf16>(bits >> 16);
}

// v - v is 0 for a finite value and NaN for NaN or Inf.
inline bool Bad(float v) { return (v - v) != 0.0f; }

// y[c, r0:r1] = x[r0:r1, c]^T for c in [c0, c1) (x [R, C], y [C, R]); false on a NaN/Inf.
template <typename In, typename Out>
bool TransposeScalar(const In* x, Out* y, int64_t R, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  bool bad = false;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float v = Widen(x[r * C + c]);
      y[c * R + r] = Narrow<Out>(v);
      bad |= Bad(v);
    }
  return !bad;
}

template <typename In, typename Out>
bool CopyScalar(const In* x, Out* y, int64_t n) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Widen(x[i]);
    y[i] = Narrow<Out>(v);
    bad |= Bad(v);
  }
  return !bad;
}

#if defined(__AVX512F__)
inline bool Aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// `stream`: a non-temporal store of a whole, aligned 64-byte line (f32 only).
inline void Store16(float* p, __m512 v, bool stream) {
  if (stream) {
    _mm512_stream_ps(p, v);
  } else {
    _mm512_storeu_ps(p, v);
  }
}
inline void Store16(bf16* p, __m512 v, bool) {
  const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), top);
}
inline bool Finite(__m512 acc) { return _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0; }

template <typename In, typename Out>
bool Copy(const In* x, Out* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  const bool stream = sizeof(Out) == 4 && Aligned(y);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = Load16(x + i);
    acc = _mm512_add_ps(acc, _mm512_sub_ps(v, v));
    Store16(y + i, v, stream);
  }
  _mm_sfence();  // the streamed stores are visible before the work item counts as done
  return CopyScalar(x + i, y + i, n - i) && Finite(acc);
}

// y[0:16, 0:16] (row stride ldy) = x[0:16, 0:16]^T (row stride ldx); acc collects x - x.
// The 16 x 16 transpose in registers: pairs of rows interleaved (unpack), then pairs of
// pairs (shuffle), then 128-bit lanes twice (shuffle_f32x4).
template <typename In, typename Out>
inline void Transpose16(const In* x, int64_t ldx, Out* y, int64_t ldy, bool stream, __m512& acc) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = Load16(x + i * ldx);
    acc = _mm512_add_ps(acc, _mm512_sub_ps(r[i], r[i]));
  }
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
  for (int i = 0; i < 16; ++i) Store16(y + i * ldy, r[i], stream);
}

// y[:, r0:r1] = x[r0:r1, :]^T for x [R, C], y [C, R] (a strip of at most 16 rows); false on a
// NaN/Inf. The strip's 16 rows of x are read front to back (16 streams the prefetchers follow)
// and each row of y gets one 64-byte line: walking the columns of 64 x 64 tiles instead, with
// 64 rows of x read a line at a time, ran at about half the speed of a copy.
template <typename In, typename Out>
bool TransposeStrip(const In* x, Out* y, int64_t R, int64_t C, int64_t r0, int64_t r1) {
  if (r1 - r0 < 16) return TransposeScalar(x, y, R, C, r0, r1, 0, C);
  const int64_t c16 = C / 16 * 16;
  // Streamed only as whole 64-byte lines of y: every row of y starts on a line (R % 16 == 0).
  const bool stream = sizeof(Out) == 4 && Aligned(y) && R % 16 == 0;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < c16; c += 16) Transpose16(x + r0 * C + c, C, y + c * R + r0, R, stream, acc);
  _mm_sfence();
  return TransposeScalar(x, y, R, C, r0, r1, c16, C) && Finite(acc);  // ragged columns
}
#else
template <typename In, typename Out>
bool Copy(const In* x, Out* y, int64_t n) {
  return CopyScalar(x, y, n);
}
template <typename In, typename Out>
bool TransposeStrip(const In* x, Out* y, int64_t R, int64_t C, int64_t r0, int64_t r1) {
  return TransposeScalar(x, y, R, C, r0, r1, 0, C);
}
#endif

// bf16 -> bf16 copies need no register pass: memcpy, then the exponent bits.
template <>
bool Copy<bf16, bf16>(const bf16* x, bf16* y, int64_t n) {
  std::memcpy(y, x, n * sizeof(bf16));
  bf16 bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<bf16>((x[i] & 0x7F80) == 0x7F80);
  return bad == 0;
}

template <typename In, typename Out>
bool Run(ffi::ThreadPool& pool, const In* x, Out* y, int64_t n, bool transpose, int64_t R, int64_t C) {
  std::atomic<bool> good{true};
  if (!transpose) {
    const int64_t step = kCopyPiece / sizeof(In);
    hotswap::ParallelFor(pool, (n + step - 1) / step, [&](int64_t i) {
      const int64_t lo = i * step;
      if (!Copy(x + lo, y + lo, std::min(step, n - lo))) good.store(false, std::memory_order_relaxed);
    });
  } else {
    hotswap::ParallelFor(pool, (R + kStrip - 1) / kStrip, [&](int64_t i) {
      const int64_t r0 = i * kStrip;
      if (!TransposeStrip(x, y, R, C, r0, std::min(R, r0 + kStrip))) good.store(false, std::memory_order_relaxed);
    });
  }
  return good.load();
}

ffi::Error ConvertFinite(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::U8>> ok, int64_t transpose) {
  using T = ffi::DataType;
  const T in = x.element_type(), out = y->element_type();
  const bool f32 = in == T::F32 && out == T::F32, b16 = in == T::BF16 && out == T::BF16,
             widen = in == T::BF16 && out == T::F32;
  if (!(f32 || b16 || widen)) {
    return ffi::Error::InvalidArgument("hotswap convert_finite: f32 or bf16 into the same dtype, or bf16 into f32");
  }
  if (y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("hotswap convert_finite: y must have x's element count");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  int64_t R = 1, C = n;
  if (transpose) {
    const auto dims = x.dimensions();
    if (dims.size() != 2) return ffi::Error::InvalidArgument("hotswap convert_finite: a transpose takes 2-D x");
    R = dims[0], C = dims[1];
  }
  const void* src = x.untyped_data();
  void* dst = y->untyped_data();
  const bool good = f32   ? Run(pool, static_cast<const float*>(src), static_cast<float*>(dst), n, transpose, R, C)
                    : b16 ? Run(pool, static_cast<const bf16*>(src), static_cast<bf16*>(dst), n, transpose, R, C)
                          : Run(pool, static_cast<const bf16*>(src), static_cast<float*>(dst), n, transpose, R, C);
  *ok->typed_data() = good ? 1 : 0;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapConvertFinite, ConvertFinite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::U8>>()    // ok
                                  .Attr<int64_t>("transpose"));
