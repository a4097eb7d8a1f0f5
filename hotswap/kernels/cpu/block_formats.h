// llama.cpp's weight blocks as a GGUF file stores them (ggml-common.h's block_q8_0, block_q4_0,
// block_q4_1, block_q4_K, block_q6_K), and a plain-C++ decoder of one 32-element group of a row.
//
// A row of an [N, K] weight is K / elems blocks of `bytes` bytes each. Every path of
// block_matmul.cc reads the blocks where they lie and decodes them group by group (32 weights:
// one q8_0/q4_0/q4_1 block, or an eighth of a q4_K/q6_K super-block); this file's `DecodeGroup`
// is the reference the vector paths follow and the scalar path itself. Each weight is computed
// as gguf.quants.dequantize computes it in f32 (d*q, then + m or - dmin*m), so the decoded
// values are the same floats: d*q is exact in f32 (11-bit f16 mantissa times a <= 14-bit
// integer), and the one rounding is the add.

#pragma once

#include <cstdint>
#include <cstring>

namespace hotswap::blocks {

// The FFI attribute `fmts` / `fmt` (kernels/cpu_blocks.py FORMATS).
enum Fmt : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4K = 3, kQ6K = 4, kFormats = 5 };

struct Layout {
  int64_t elems, bytes;  // per block
};
// Indexed by Fmt: q8_0 {f16 d; int8 q[32]}; q4_0 {f16 d; u8 qs[16]} (element j < 16: low nibble
// of qs[j], j >= 16: high nibble of qs[j-16]; w = d*(q-8)); q4_1 {f16 d, m; u8 qs[16]} (w =
// d*q + m); q4_K {f16 d, dmin; u8 scales[12] (8 6-bit scales and mins); u8 qs[128]}; q6_K
// {u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d}.
constexpr Layout kLayouts[kFormats] = {{32, 34}, {32, 18}, {32, 20}, {256, 144}, {256, 210}};

constexpr int64_t kGroup = 32;  // weights per decoded group

// IEEE half -> float, without F16C (the scalar path runs on any CPU).
inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400u)) man <<= 1, --exp;
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes
// (ggml-quants.c get_scale_min_k4).
inline void ScaleMinK4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The affine map of group g of a row: weight t of the group is a[t / 16] * q[t] + b, q[t] the
// group's integers (`Codes`). Two scales because q6_K scales every 16 weights; the others
// repeat one.
struct Affine {
  float a[2], b;
};

// Group g's integer codes (q8_0: -128..127; q4_0: 0..15 with b = -8a; q4_1, q4_K: 0..15;
// q6_K: 0..63 less 32) and its affine map.
inline Affine Codes(Fmt f, const uint8_t* row, int64_t g, int32_t* q) {
  switch (f) {
    case kQ8_0: {
      const uint8_t* p = row + g * 34;
      const float d = HalfToFloat(p);
      for (int t = 0; t < 32; ++t) q[t] = static_cast<int8_t>(p[2 + t]);
      return {{d, d}, 0.0f};
    }
    case kQ4_0:
    case kQ4_1: {
      const bool one = f == kQ4_1;
      const uint8_t* p = row + g * (one ? 20 : 18);
      const uint8_t* qs = p + (one ? 4 : 2);
      for (int t = 0; t < 16; ++t) q[t] = qs[t] & 0xF, q[t + 16] = qs[t] >> 4;
      const float d = HalfToFloat(p);
      if (one) return {{d, d}, HalfToFloat(p + 2)};
      for (int t = 0; t < 32; ++t) q[t] -= 8;
      return {{d, d}, 0.0f};
    }
    case kQ4K: {
      const uint8_t* p = row + (g / 8) * 144;
      const int j = static_cast<int>(g % 8);
      int sc, m;
      ScaleMinK4(j, p + 4, &sc, &m);
      const uint8_t* qs = p + 16 + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int t = 0; t < 32; ++t) q[t] = (qs[t] >> shift) & 0xF;
      const float a = HalfToFloat(p) * static_cast<float>(sc);
      return {{a, a}, -(HalfToFloat(p + 2) * static_cast<float>(m))};
    }
    default: {  // kQ6K: element e = 32 j + t of the super-block
      const uint8_t* p = row + (g / 8) * 210;
      const int j = static_cast<int>(g % 8), h = j / 4;
      const uint8_t* ql = p + 64 * h + 32 * (j % 2);
      const uint8_t* qh = p + 128 + 32 * h;
      const int lshift = 4 * ((j % 4) / 2), hshift = 2 * (j % 4);
      for (int t = 0; t < 32; ++t) q[t] = (((ql[t] >> lshift) & 0xF) | (((qh[t] >> hshift) & 3) << 4)) - 32;
      const float d = HalfToFloat(p + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      return {{d * static_cast<float>(scales[2 * j]), d * static_cast<float>(scales[2 * j + 1])}, 0.0f};
    }
  }
}

// Group g of a row as 32 floats, as gguf.quants.dequantize gives them.
inline void DecodeGroup(Fmt f, const uint8_t* row, int64_t g, float* w) {
  int32_t q[32];
  const Affine A = Codes(f, row, g, q);
  for (int t = 0; t < 32; ++t) w[t] = A.a[t / 16] * static_cast<float>(q[t]) + A.b;
}

}  // namespace hotswap::blocks
