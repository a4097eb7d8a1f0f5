// bf16 as the CPU kernels see it: XLA FFI hands bf16 buffers over as their 16-bit storage.
// Widening is exact (the bits are an f32's top half); narrowing rounds to nearest even, as
// XLA's f32 -> bf16 convert does, so a kernel's bf16 results are the bits XLA would write.

#pragma once

#include <cstdint>

namespace hotswap {

using bf16 = uint16_t;

inline float Widen(float v) { return v; }
inline float Widen(bf16 v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }

// f32 -> the nearest bf16's bits (ties to even); a NaN stays a (quiet) NaN.
inline bf16 ToBf16(float v) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40);
  return static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace hotswap
