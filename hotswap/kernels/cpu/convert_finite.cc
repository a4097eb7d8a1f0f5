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
// Inputs: x, f32 or bf16, [R, C] when transposing (any shape otherwise).
// Attr transpose: 1 for y[c, r] = x[r, c] (y's bytes are x^T's, whatever y's shape), 0 for a
// copy. Outputs: y (x's dtype, x's element count), ok uint8 [] = 1 when x holds no NaN/Inf.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCopyPiece = 1 << 20;  // bytes of a copy's work item
constexpr int64_t kStrip = 16;           // rows of x in a transpose's work item

// f32: x - x is 0 for a finite value and NaN for NaN or Inf, and a sum keeps the NaN.
// bf16: NaN and Inf are the values whose 8 exponent bits are all ones.
inline bool BadF32(float v) { return (v - v) != 0.0f; }
inline bool BadBF16(uint16_t v) { return (v & 0x7F80) == 0x7F80; }

#if defined(__AVX512F__)
inline bool Aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

// Copies n f32 and returns false on a NaN/Inf. Streams the stores when dst is line-aligned.
bool CopyF32(const float* x, float* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  const bool stream = Aligned(y);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_add_ps(acc, _mm512_sub_ps(v, v));
    if (stream) {
      _mm512_stream_ps(y + i, v);
    } else {
      _mm512_storeu_ps(y + i, v);
    }
  }
  bool ok = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0;
  for (; i < n; ++i) ok &= !BadF32(y[i] = x[i]);
  _mm_sfence();  // the streamed stores are visible before the work item counts as done
  return ok;
}

// y[0:16, 0:16] (row stride ldy) = x[0:16, 0:16]^T (row stride ldx); acc collects x - x.
// The 16 x 16 transpose in registers: pairs of rows interleaved (unpack), then pairs of
// pairs (shuffle), then 128-bit lanes twice (shuffle_f32x4).
template <bool kStream>
inline void Transpose16(const float* x, int64_t ldx, float* y, int64_t ldy, __m512& acc) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_ps(x + i * ldx);
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
  for (int i = 0; i < 16; ++i) {
    if (kStream) {
      _mm512_stream_ps(y + i * ldy, r[i]);
    } else {
      _mm512_storeu_ps(y + i * ldy, r[i]);
    }
  }
}
#else
bool CopyF32(const float* x, float* y, int64_t n) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= BadF32(y[i] = x[i]);
  return !bad;
}
#endif

// y[c0:c1, r0:r1] = x[r0:r1, c0:c1]^T for x [R, C], y [C, R]; false on a NaN/Inf.
template <typename T, bool (*Bad)(T)>
bool TransposeScalar(const T* x, T* y, int64_t R, int64_t C, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  bool bad = false;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) bad |= Bad(y[c * R + r] = x[r * C + c]);
  return !bad;
}

// y[:, r0:r1] = x[r0:r1, :]^T for x [R, C], y [C, R] (a strip of at most 16 rows); false on a
// NaN/Inf. The strip's 16 rows of x are read front to back (16 streams the prefetchers follow)
// and each row of y gets one 64-byte line: walking the columns of 64 x 64 tiles instead, with
// 64 rows of x read a line at a time, ran at about half the speed of a copy.
bool TransposeStripF32(const float* x, float* y, int64_t R, int64_t C, int64_t r0, int64_t r1) {
#if defined(__AVX512F__)
  if (r1 - r0 < 16) return TransposeScalar<float, BadF32>(x, y, R, C, r0, r1, 0, C);
  const int64_t c16 = C / 16 * 16;
  __m512 acc = _mm512_setzero_ps();
  // Whole 64-byte lines of y only when every row of y starts on a line: R % 16 == 0.
  if (Aligned(y) && R % 16 == 0) {
    for (int64_t c = 0; c < c16; c += 16) Transpose16<true>(x + r0 * C + c, C, y + c * R + r0, R, acc);
  } else {
    for (int64_t c = 0; c < c16; c += 16) Transpose16<false>(x + r0 * C + c, C, y + c * R + r0, R, acc);
  }
  _mm_sfence();  // the streamed stores are visible before the work item counts as done
  const bool ok = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) == 0;
  return TransposeScalar<float, BadF32>(x, y, R, C, r0, r1, c16, C) && ok;  // ragged columns
#else
  return TransposeScalar<float, BadF32>(x, y, R, C, r0, r1, 0, C);
#endif
}

bool CopyBF16(const uint16_t* x, uint16_t* y, int64_t n) {
  std::memcpy(y, x, n * sizeof(uint16_t));
  uint16_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint16_t>((x[i] & 0x7F80) == 0x7F80);
  return bad == 0;
}

ffi::Error ConvertFinite(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Buffer<ffi::U8>> ok, int64_t transpose) {
  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("hotswap convert_finite: x must be f32 or bf16");
  }
  if (y->element_type() != t || y->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("hotswap convert_finite: y must match x's dtype and size");
  }
  const bool bf16 = t == ffi::DataType::BF16;
  const int64_t size = bf16 ? 2 : 4, n = static_cast<int64_t>(x.element_count());
  const void* src = x.untyped_data();
  void* dst = y->untyped_data();
  std::atomic<bool> good{true};
  if (!transpose) {
    const int64_t step = kCopyPiece / size, items = (n + step - 1) / step;
    hotswap::ParallelFor(pool, items, [&](int64_t i) {
      const int64_t lo = i * step, m = std::min(step, n - lo);
      const bool fine = bf16 ? CopyBF16(static_cast<const uint16_t*>(src) + lo, static_cast<uint16_t*>(dst) + lo, m)
                             : CopyF32(static_cast<const float*>(src) + lo, static_cast<float*>(dst) + lo, m);
      if (!fine) good.store(false, std::memory_order_relaxed);
    });
  } else {
    const auto dims = x.dimensions();
    if (dims.size() != 2) return ffi::Error::InvalidArgument("hotswap convert_finite: a transpose takes 2-D x");
    const int64_t R = dims[0], C = dims[1];
    hotswap::ParallelFor(pool, (R + kStrip - 1) / kStrip, [&](int64_t i) {
      const int64_t r0 = i * kStrip, r1 = std::min(R, r0 + kStrip);
      const bool fine =
          bf16 ? TransposeScalar<uint16_t, BadBF16>(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst),
                                                    R, C, r0, r1, 0, C)
               : TransposeStripF32(static_cast<const float*>(src), static_cast<float*>(dst), R, C, r0, r1);
      if (!fine) good.store(false, std::memory_order_relaxed);
    });
  }
  *ok->typed_data() = good.load() ? 1 : 0;
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
