// y_i[M, N_i] = x[M, K] @ W_i.T for GGUF block weights W_i [N_i, K] (llama.cpp's q8_0, q4_0,
// q4_1, q4_K, q6_K bytes, one output row per array row: block_formats.h), and the rows an
// embedding lookup takes from such a table (llama.cpp's get_rows); hotswap/kernels/cpu_blocks.py.
//
// Why: a GGUF's weights are served as the file stores them (4.5-8.5 bits a weight), so a decode
// step reads a quarter to a half of what bf16 reads. The blocks are read in place and decoded
// in registers, 32 weights (a group) at a time; no dequantized copy of a weight exists.
//
// Exact (the default): x stays f32 and every weight is decoded to the f32 value
// gguf.quants.dequantize gives it (block_formats.h), so y is x @ dequantize(W).T up to the order
// of f32 sums. Two schedules:
//   - up to DirectRows rows (decode; AVX-512: 16, 8 for the K-quants): each output row's groups
//     are decoded straight into registers and FMA'd into up to 8 x rows (AVX-512 decodes again,
//     from cache, for each further 8); the output rows are split over XLA's intra-op threads in
//     contiguous runs, so each thread streams its own part of the blocks.
//   - more rows (prefill, large batches): a work item decodes a panel of kPanel output rows x up
//     to kChunk of K into a per-thread f32 buffer (kPanel * kChunk * 4 = 128 KB, in L2) and runs
//     register tiles over all x rows: decoding is paid once per weight, not once per x row. On
//     AVX-512 the panel is [k][16 outputs] (each group decoded row-major, then transposed in
//     registers) under small_matmul's broadcast tiles; on AVX2 it is row-major under dot tiles of
//     2 x rows x 4 outputs.
// Not exact (llama.cpp's way): x is quantized per 32 values to int8 with one f32 scale (q8_0),
// and each group's weight codes are multiplied with them in int8 x int8 -> int32 dots
// (vpdpbusd on AVX512_VNNI, vpmaddubsw + vpmaddwd on AVX2), scaled per group in f32.
//
// Paths (cpu/isa.h): AVX512_VNNI (its f32 work is the AVX-512 path's), AVX-512, AVX2 + FMA,
// scalar; each path's functions carry their own target attribute.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "block_formats.h"
#include "isa.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using hotswap::Isa;
using namespace hotswap::blocks;

// One product of a call: W [N, K] blocks -> y [M, N].
struct Product {
  Fmt fmt;
  const uint8_t* w;
  int64_t N, row_bytes;
  float* y;
};

// x and the quantized copy of x (not-exact mode): q8 [M, K] int8 codes, their scale per
// 32-group [M, K/32], and each 16-code half's integer sum [M, K/16] (for the offset of the
// weights' codes).
struct Input {
  const float* x;
  int64_t M, K;
  std::vector<int8_t> q8;
  std::vector<float> scale;
  std::vector<int32_t> sum16;
};

constexpr int64_t kPanel = 16;    // output rows a prefill work item decodes at once
constexpr int64_t kChunk = 2048;  // of K per panel fill: 16 x 2048 f32 = 128 KB, in L2
// Decode (up to 4 rows) touches each block byte once, in order: the lines kPrefetch bytes ahead
// of the output rows being decoded are requested early, so both cores' reads stay in flight
// (q4_1 SmolLM2 chain at 1 row on the shared Zen 4: 16.3-16.6 vs 17.8-18.6 process CPU ms
// without; ~16 rows of K = 576 ahead).
constexpr int64_t kPrefetch = 6144;

// Requests the lines of [p, p + n) into the caches (a hint: never faults, past a buffer's end too).
inline void Prefetch(const uint8_t* p, int64_t n) {
#if defined(__x86_64__)
  for (int64_t b = 0; b < n; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T0);
#endif
}

// The most x rows a path's exact item takes without a panel (ItemZ, ItemY; scalar: any). The
// AVX-512 direct items decode the weights again for each 8 x rows (from L1 or L2) but pay no
// transpose and no panel buffer: in process CPU ms of the SmolLM2 chains on the shared Zen 4,
// q4_1 8 rows 35 vs 49-70 for the panel, 16 rows 68 vs 74, 32 rows 131 vs 111; q8_0 16 rows 67
// vs 75; the K-quants decode dearer (q4_k 8 rows 71 vs 70, 16 rows 148 vs 141; q6_k 8 rows 59
// vs 89).
int64_t DirectRows(Isa path, Fmt f) {
  if (path == Isa::kAvx512Vnni || path == Isa::kAvx512) return f == kQ4K || f == kQ6K ? 8 : 16;
  if (path == Isa::kAvx2Fma) return 2;
  return INT64_MAX;
}

float* PanelBuffer() {
  thread_local std::vector<float> buf(kPanel * kChunk);
  return buf.data();
}

// ---------------------------------------------------------------------------------------------
// Scalar: any CPU. Each group is decoded once (block_formats.h) and dotted with every x row.

void ScalarItem(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  const int64_t groups = in.K / kGroup;
  float w[kGroup];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t r = 0; r < in.M; ++r) p.y[r * p.N + n] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      DecodeGroup(p.fmt, row, g, w);
      for (int64_t r = 0; r < in.M; ++r) {
        const float* xr = in.x + r * in.K + g * kGroup;
        float s = 0.0f;
        for (int t = 0; t < kGroup; ++t) s += w[t] * xr[t];
        p.y[r * p.N + n] += s;
      }
    }
  }
}

// Not exact: int codes times x's int8 codes, per group sum * weight scale * x scale.
void ScalarIntItem(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  const int64_t groups = in.K / kGroup;
  int32_t q[kGroup];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t r = 0; r < in.M; ++r) p.y[r * p.N + n] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const Affine A = Codes(p.fmt, row, g, q);
      for (int64_t r = 0; r < in.M; ++r) {
        const int8_t* xq = in.q8.data() + r * in.K + g * kGroup;
        int32_t lo = 0, hi = 0;
        for (int t = 0; t < 16; ++t) lo += q[t] * xq[t], hi += q[t + 16] * xq[t + 16];
        const int32_t* s16 = in.sum16.data() + r * (in.K / 16) + 2 * g;
        const float sx = in.scale[r * groups + g];
        p.y[r * p.N + n] += sx * (A.a[0] * lo + A.a[1] * hi + A.b * static_cast<float>(s16[0] + s16[1]));
      }
    }
  }
}

#if defined(__x86_64__)
// ---------------------------------------------------------------------------------------------
// AVX-512: a group is 2 zmm. 4-bit codes go through a 16-entry table of their f32 values
// (vpermps reads only an index's low 4 bits, so a byte's high nibble needs one shift and no mask).

struct Z2 {
  __m512 v[2];
};

HOTSWAP_TARGET_AVX512 inline __m512 HalfZ(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
}

// The f16 fields at p and p + 2 (q4_1's d and m; q8_0's and q4_0's d and their first code
// bytes, unused) broadcast as f32: one 32-bit load, a 4-lane conversion and two broadcasts.
// Two HalfZ (each a 16-lane conversion) cost 7% more per q4_1 group at 1 row (gate/up from L2,
// one Zen 4 core: 2.02 vs 1.88 ns), where the decode is bound by the vector shuffle pipes.
HOTSWAP_TARGET_AVX512 inline void ScalesZ(const uint8_t* p, __m512* a, __m512* b) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h)));
  *a = _mm512_broadcastss_ps(f);
  *b = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
}

HOTSWAP_TARGET_AVX512 inline __m512i BytesZ(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 16 q6_K codes (0..63) as bytes: 4 bits of ql (shifted by ls) and 2 of qh (shifted by hs).
HOTSWAP_TARGET_AVX2 inline __m128i Q6Codes(const uint8_t* ql, const uint8_t* qh, __m128i ls, __m128i hs) {
  const __m128i lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql)), ls),
                                   _mm_set1_epi8(0xF));
  const __m128i hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh)), hs),
                                   _mm_set1_epi8(3));
  return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
}

// Group g of a row. The K-quants' part is DecodeSubZ (group j of the super-block at p): a loop
// over a super-block's 8 groups with j known at compile time folds their scale unpacking and
// shifts to constants and shares d and dmin (DirectZ; process CPU ms of the SmolLM2-shaped
// chains at 1 row on the shared Zen 4: q4_k 19.2 vs 22.9, q6_k 25.8 vs 27.6).
template <int F>
HOTSWAP_TARGET_AVX512 inline Z2 DecodeSubZ(const uint8_t* p, int j);

// Groups a decode loop takes at once: a K-quant super-block's 8 (DecodeAtZ).
template <int F>
constexpr int kStepZ = F == kQ4K || F == kQ6K ? 8 : 1;

template <int F>
HOTSWAP_TARGET_AVX512 inline Z2 DecodeZ(const uint8_t* row, int64_t g) {
  if constexpr (F == kQ4K || F == kQ6K) {
    return DecodeSubZ<F>(row + (g / 8) * (F == kQ4K ? 144 : 210), static_cast<int>(g % 8));
  } else if constexpr (F == kQ8_0) {
    const uint8_t* p = row + g * 34;
    __m512 d, m;
    ScalesZ(p, &d, &m);
    const __m128i* q = reinterpret_cast<const __m128i*>(p + 2);
    return {{_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d),
             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d)}};
  } else {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* p = row + g * (F == kQ4_1 ? 20 : 18);
    __m512 d, m;
    ScalesZ(p, &d, &m);
    const __m512 b = F == kQ4_1 ? m : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    const __m512 table = _mm512_fmadd_ps(iota, d, b);  // d*q + m, or d*(q - 8): one rounding
    const __m512i i = BytesZ(p + (F == kQ4_1 ? 4 : 2));
    return {{_mm512_permutexvar_ps(i, table), _mm512_permutexvar_ps(_mm512_srli_epi32(i, 4), table)}};
  }
}

template <int F>
HOTSWAP_TARGET_AVX512 inline Z2 DecodeSubZ(const uint8_t* p, int j) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if constexpr (F == kQ4K) {
    int sc, m;
    ScaleMinK4(j, p + 4, &sc, &m);
    const __m512 a = _mm512_mul_ps(HalfZ(p), _mm512_set1_ps(static_cast<float>(sc)));
    const __m512 b = _mm512_mul_ps(HalfZ(p + 2), _mm512_set1_ps(-static_cast<float>(m)));
    const __m512 table = _mm512_fmadd_ps(iota, a, b);
    const uint8_t* qs = p + 16 + 32 * (j / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
    return {{_mm512_permutexvar_ps(_mm512_srl_epi32(BytesZ(qs), shift), table),
             _mm512_permutexvar_ps(_mm512_srl_epi32(BytesZ(qs + 16), shift), table)}};
  } else {  // kQ6K: a 6-bit code is assembled per byte (128-bit ops), then widened once
    const int h = j / 4;
    const uint8_t* ql = p + 64 * h + 32 * (j % 2);
    const uint8_t* qh = p + 128 + 32 * h;
    const __m128i ls = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), hs = _mm_cvtsi32_si128(2 * (j % 4));
    const __m512 d = HalfZ(p + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    Z2 out;
    for (int s = 0; s < 2; ++s) {
      out.v[s] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(Q6Codes(ql + 16 * s, qh + 16 * s, ls, hs)));
      // a * q - 32 a: both products exact in f32, so the one rounding gives a * (q - 32) exactly.
      const __m512 a = _mm512_mul_ps(d, _mm512_set1_ps(static_cast<float>(scales[2 * j + s])));
      out.v[s] = _mm512_fmadd_ps(out.v[s], a, _mm512_mul_ps(a, _mm512_set1_ps(-32.0f)));
    }
    return out;
  }
}

// Group g0 + j of a row, g0 a multiple of kStepZ<F>: the loops that call it unroll j.
template <int F>
HOTSWAP_TARGET_AVX512 inline Z2 DecodeAtZ(const uint8_t* row, int64_t g0, int j) {
  if constexpr (kStepZ<F> == 8) {
    return DecodeSubZ<F>(row + (g0 / 8) * (F == kQ4K ? 144 : 210), j);
  } else {
    return DecodeZ<F>(row, g0 + j);
  }
}

// x rows [x0, x0 + MR) (MR <= 8) against output rows [n0, n1): up to 4 x rows two output rows
// at a time, two accumulators per (output row, x row) so the FMA chains overlap; more x rows one
// output row at a time (2 * MR accumulators).
template <int F, int MR>
HOTSWAP_TARGET_AVX512 void DirectZ(const Input& in, const Product& p, int64_t n0, int64_t n1, int64_t x0 = 0) {
  const int64_t groups = in.K / kGroup, K = in.K;
  const float* x = in.x + x0 * K;
  float* y = p.y + x0 * p.N;
  int64_t n = n0;
  for (; MR <= 4 && n + 2 <= n1; n += 2) {
    const uint8_t* r0 = p.w + n * p.row_bytes;
    const uint8_t* r1 = r0 + p.row_bytes;
    Prefetch(r0 + kPrefetch, 2 * p.row_bytes);
    __m512 acc[2][MR][2];
    for (int a = 0; a < 2; ++a)
      for (int r = 0; r < MR; ++r) acc[a][r][0] = acc[a][r][1] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += kStepZ<F>) {
#pragma GCC unroll 8
      for (int j = 0; j < kStepZ<F>; ++j) {
        const Z2 w0 = DecodeAtZ<F>(r0, g0, j), w1 = DecodeAtZ<F>(r1, g0, j);
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * K + (g0 + j) * kGroup;
          const __m512 xa = _mm512_loadu_ps(xr), xb = _mm512_loadu_ps(xr + 16);
          acc[0][r][0] = _mm512_fmadd_ps(w0.v[0], xa, acc[0][r][0]);
          acc[0][r][1] = _mm512_fmadd_ps(w0.v[1], xb, acc[0][r][1]);
          acc[1][r][0] = _mm512_fmadd_ps(w1.v[0], xa, acc[1][r][0]);
          acc[1][r][1] = _mm512_fmadd_ps(w1.v[1], xb, acc[1][r][1]);
        }
      }
    }
    for (int a = 0; a < 2; ++a)
      for (int r = 0; r < MR; ++r)
        y[r * p.N + n + a] = _mm512_reduce_add_ps(_mm512_add_ps(acc[a][r][0], acc[a][r][1]));
  }
  for (; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    Prefetch(row + kPrefetch, p.row_bytes);
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += kStepZ<F>) {
#pragma GCC unroll 8
      for (int j = 0; j < kStepZ<F>; ++j) {
        const Z2 w = DecodeAtZ<F>(row, g0, j);
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * K + (g0 + j) * kGroup;
          acc[r][0] = _mm512_fmadd_ps(w.v[0], _mm512_loadu_ps(xr), acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(w.v[1], _mm512_loadu_ps(xr + 16), acc[r][1]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) y[r * p.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
}

// All x rows in blocks of 8 against output rows [n0, n1), 32 output rows at a time: each
// block decodes the 32 rows' weights again, from L1 or L2 (they came from DRAM once).
template <int F>
HOTSWAP_TARGET_AVX512 void DirectBlocksZ(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  constexpr int64_t kRun = 32;
  for (int64_t a = n0; a < n1; a += kRun) {
    const int64_t b = std::min(a + kRun, n1);
    for (int64_t x0 = 0; x0 < in.M; x0 += 8) {
      switch (std::min<int64_t>(8, in.M - x0)) {
        case 8: DirectZ<F, 8>(in, p, a, b, x0); break;
        case 7: DirectZ<F, 7>(in, p, a, b, x0); break;
        case 6: DirectZ<F, 6>(in, p, a, b, x0); break;
        case 5: DirectZ<F, 5>(in, p, a, b, x0); break;
        case 4: DirectZ<F, 4>(in, p, a, b, x0); break;
        case 3: DirectZ<F, 3>(in, p, a, b, x0); break;
        case 2: DirectZ<F, 2>(in, p, a, b, x0); break;
        default: DirectZ<F, 1>(in, p, a, b, x0); break;
      }
    }
  }
}

template <int F, int MR>
HOTSWAP_TARGET_AVX2 void DirectY(const Input& in, const Product& p, int64_t n0, int64_t n1);

// y[r0:r0+MR, 16 outputs] (+)= x[r0:r0+MR, 0:kn] @ buf[kn][16]: one zmm of 16 outputs per x row,
// each k a broadcast of x times one buffer row (small_matmul.cc's tile form: no horizontal sums).
template <int MR>
HOTSWAP_TARGET_AVX512 void BroadcastTileZ(const float* x, int64_t ldx, const float* buf, int64_t kn, float* y,
                                          int64_t ldy, __mmask16 cols, bool first) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(cols, y + r * ldy);
  for (int64_t k = 0; k < kn; ++k) {
    const __m512 w = _mm512_loadu_ps(buf + 16 * k);
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, cols, acc[r]);
}

// r[i] <- column i of the 16 x 16 matrix whose row j is r[j]: 64 in-lane and 128-bit-lane
// shuffles (unpack, shuffle_ps, two shuffle_f32x4), a quarter of a cycle a float on Zen 4,
// where scattering each decoded weight to its column cost about one.
HOTSWAP_TARGET_AVX512 inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int b = 0; b < 16; b += 4) {
    r[b] = _mm512_shuffle_ps(t[b], t[b + 2], 0x44);
    r[b + 1] = _mm512_shuffle_ps(t[b], t[b + 2], 0xEE);
    r[b + 2] = _mm512_shuffle_ps(t[b + 1], t[b + 3], 0x44);
    r[b + 3] = _mm512_shuffle_ps(t[b + 1], t[b + 3], 0xEE);
  }
  for (int b = 0; b < 16; b += 8)
    for (int j = 0; j < 4; ++j) {
      t[b + j] = _mm512_shuffle_f32x4(r[b + j], r[b + 4 + j], 0x88);
      t[b + 4 + j] = _mm512_shuffle_f32x4(r[b + j], r[b + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

// buf[kn][16] <- the panel's output rows [n0, n1) (at most 16; lanes past them 0) over the
// groups [g0, g0 + kn / 32): each group of the 16 rows is decoded into a 2 KB row-major
// scratch (L1), then its two 16 x 16 halves are transposed in registers.
template <int F>
HOTSWAP_TARGET_AVX512 void FillPanelT(const Product& p, int64_t n0, int64_t rows, int64_t g0, int64_t kn,
                                      float* buf) {
  alignas(64) float scratch[kPanel][kGroup];
  if (rows < kPanel) std::memset(scratch, 0, sizeof(scratch));
  const uint8_t* first = p.w + n0 * p.row_bytes;
  for (int64_t g = 0; g < kn / kGroup; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      const Z2 w = DecodeZ<F>(first + i * p.row_bytes, g0 + g);
      _mm512_store_ps(scratch[i], w.v[0]);
      _mm512_store_ps(scratch[i] + 16, w.v[1]);
    }
    for (int h = 0; h < 2; ++h) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(scratch[i] + 16 * h);
      Transpose16(r);
      float* out = buf + (g * kGroup + 16 * h) * kPanel;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + 16 * i, r[i]);
    }
  }
}

// Panel of output rows [n0, n1) (at most kPanel = 16) for all x rows: kChunk of K at a time is
// decoded into buf[kn][16] (output row i of the panel in lane i), then tiles of up to 8 x rows
// run over it.
template <int F>
HOTSWAP_TARGET_AVX512 void PanelBroadcastZ(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  static_assert(kPanel == 16, "one zmm of outputs per panel");
  float* buf = PanelBuffer();
  const int64_t K = in.K, rows = n1 - n0;
  const __mmask16 cols = static_cast<__mmask16>((1u << rows) - 1);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t kn = std::min(kChunk, K - k0);
    FillPanelT<F>(p, n0, rows, k0 / kGroup, kn, buf);
    for (int64_t r0 = 0; r0 < in.M; r0 += 8) {
      const float* xr = in.x + r0 * K + k0;
      float* y = p.y + r0 * p.N + n0;
      switch (std::min<int64_t>(8, in.M - r0)) {
        case 8: BroadcastTileZ<8>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        case 7: BroadcastTileZ<7>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        case 6: BroadcastTileZ<6>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        case 5: BroadcastTileZ<5>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        case 4: BroadcastTileZ<4>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        case 3: BroadcastTileZ<3>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        case 2: BroadcastTileZ<2>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
        default: BroadcastTileZ<1>(xr, K, buf, kn, y, p.N, cols, k0 == 0); break;
      }
    }
  }
}

template <int F>
HOTSWAP_TARGET_AVX512 void ItemZ(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  // q8_0 widens 16 bytes to a zmm of int32 per 16 weights (vpmovsxbd across 512 bits); the
  // ymm form decoded 1.4-2x the weights a second on Zen 4, so 1-2 rows take the AVX2 code.
  if constexpr (F == kQ8_0) {
    if (in.M == 1) return DirectY<F, 1>(in, p, n0, n1);
    if (in.M == 2) return DirectY<F, 2>(in, p, n0, n1);
  }
  if (in.M <= DirectRows(Isa::kAvx512, static_cast<Fmt>(F))) return DirectBlocksZ<F>(in, p, n0, n1);
  // More rows: the panel is decoded once and transposed to [k][16 outputs] for broadcast tiles
  // (no horizontal sums); 4 x 4 dot tiles over a row-major panel were 1.1-1.6x its process CPU
  // time at 5-32 rows (q4_1, q6_k SmolLM2 chains, Zen 4).
  return PanelBroadcastZ<F>(in, p, n0, n1);
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: a group is 4 ymm (weights 0-7, 8-15, 16-23, 24-31).

struct Y4 {
  __m256 v[4];
};

HOTSWAP_TARGET_AVX2 inline __m256 HalfY(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

HOTSWAP_TARGET_AVX2 inline __m256i Bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int F>
HOTSWAP_TARGET_AVX2 inline Y4 DecodeY(const uint8_t* row, int64_t g) {
  Y4 out;
  if constexpr (F == kQ8_0) {
    const uint8_t* p = row + g * 34;
    const __m256 d = HalfY(p);
    for (int s = 0; s < 4; ++s) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * s));
      out.v[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    const uint8_t* p = row + g * (F == kQ4_1 ? 20 : 18);
    const uint8_t* qs = p + (F == kQ4_1 ? 4 : 2);
    const __m256 d = HalfY(p);
    const __m256 b = F == kQ4_1 ? HalfY(p + 2) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    const __m256i low = _mm256_set1_epi32(0xF);
    for (int s = 0; s < 2; ++s) {
      const __m256i i = Bytes8(qs + 8 * s);
      out.v[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(i, low)), d, b);
      out.v[s + 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(i, 4)), d, b);
    }
  } else if constexpr (F == kQ4K) {
    const uint8_t* p = row + (g / 8) * 144;
    const int j = static_cast<int>(g % 8);
    int sc, m;
    ScaleMinK4(j, p + 4, &sc, &m);
    const __m256 a = _mm256_mul_ps(HalfY(p), _mm256_set1_ps(static_cast<float>(sc)));
    const __m256 b = _mm256_mul_ps(HalfY(p + 2), _mm256_set1_ps(-static_cast<float>(m)));
    const uint8_t* qs = p + 16 + 32 * (j / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
    const __m256i low = _mm256_set1_epi32(0xF);
    for (int s = 0; s < 4; ++s) {
      const __m256i q = _mm256_and_si256(_mm256_srl_epi32(Bytes8(qs + 8 * s), shift), low);
      out.v[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), a, b);
    }
  } else {  // kQ6K (see DecodeZ)
    const uint8_t* p = row + (g / 8) * 210;
    const int j = static_cast<int>(g % 8), h = j / 4;
    const uint8_t* ql = p + 64 * h + 32 * (j % 2);
    const uint8_t* qh = p + 128 + 32 * h;
    const __m128i ls = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), hs = _mm_cvtsi32_si128(2 * (j % 4));
    const __m256 d = HalfY(p + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    for (int s = 0; s < 2; ++s) {
      const __m128i q = Q6Codes(ql + 16 * s, qh + 16 * s, ls, hs);
      const __m256 a = _mm256_mul_ps(d, _mm256_set1_ps(static_cast<float>(scales[2 * j + s])));
      const __m256 b = _mm256_mul_ps(a, _mm256_set1_ps(-32.0f));
      out.v[2 * s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), a, b);
      out.v[2 * s + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), a, b);
    }
  }
  return out;
}

HOTSWAP_TARGET_AVX2 inline float SumY(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Up to 2 x rows (16 ymm registers): two accumulators per x row.
template <int F, int MR>
HOTSWAP_TARGET_AVX2 void DirectY(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  const int64_t groups = in.K / kGroup, K = in.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    Prefetch(row + kPrefetch, p.row_bytes);
    // One accumulator per ymm of a group: with two, each took two dependent FMAs a group and
    // the loop waited on FMA latency (q8_0, 1 row, gate/up's shape from L2 on one Zen 4 core:
    // 1.88 vs 2.03 ns a group).
    __m256 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int s = 0; s < 4; ++s) acc[r][s] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const Y4 w = DecodeY<F>(row, g);
      for (int r = 0; r < MR; ++r) {
        const float* xr = in.x + r * K + g * kGroup;
        for (int s = 0; s < 4; ++s) acc[r][s] = _mm256_fmadd_ps(w.v[s], _mm256_loadu_ps(xr + 8 * s), acc[r][s]);
      }
    }
    for (int r = 0; r < MR; ++r)
      p.y[r * p.N + n] = SumY(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
  }
}

// s[MR][4] = x[MR rows, 0:kn] . buf[4 rows, 0:kn]: 4 x MR ymm accumulators (MR <= 2).
template <int MR>
HOTSWAP_TARGET_AVX2 void TileY(const float* x, int64_t ldx, const float* buf, int64_t ldb, int64_t kn,
                               float s[][4]) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kn; k += 8) {
    __m256 w[4];
    for (int c = 0; c < 4; ++c) w[c] = _mm256_loadu_ps(buf + c * ldb + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = SumY(acc[r][c]);
}

template <int F>
HOTSWAP_TARGET_AVX2 void PanelY(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  float* buf = PanelBuffer();
  const int64_t K = in.K, rows = n1 - n0;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t kn = std::min(kChunk, K - k0), g0 = k0 / kGroup;
    for (int64_t i = 0; i < kPanel; ++i) {
      float* b = buf + i * kn;
      if (i >= rows) {
        std::fill(b, b + kn, 0.0f);
        continue;
      }
      const uint8_t* row = p.w + (n0 + i) * p.row_bytes;
      for (int64_t g = 0; g < kn / kGroup; ++g) {
        const Y4 w = DecodeY<F>(row, g0 + g);
        for (int s = 0; s < 4; ++s) _mm256_storeu_ps(b + g * kGroup + 8 * s, w.v[s]);
      }
    }
    for (int64_t r0 = 0; r0 < in.M; r0 += 2) {
      const int64_t mr = std::min<int64_t>(2, in.M - r0);
      for (int64_t c0 = 0; c0 < rows; c0 += 4) {
        float s[2][4];
        const float* xr = in.x + r0 * K + k0;
        const float* br = buf + c0 * kn;
        if (mr == 2) {
          TileY<2>(xr, K, br, kn, kn, s);
        } else {
          TileY<1>(xr, K, br, kn, kn, s);
        }
        for (int64_t r = 0; r < mr; ++r)
          for (int64_t c = 0; c < std::min<int64_t>(4, rows - c0); ++c) {
            float& y = p.y[(r0 + r) * p.N + n0 + c0 + c];
            y = k0 == 0 ? s[r][c] : y + s[r][c];
          }
      }
    }
  }
}

template <int F>
HOTSWAP_TARGET_AVX2 void ItemY(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  switch (in.M) {
    case 1: return DirectY<F, 1>(in, p, n0, n1);
    case 2: return DirectY<F, 2>(in, p, n0, n1);
    default: return PanelY<F>(in, p, n0, n1);
  }
}
#endif  // __x86_64__

// ---------------------------------------------------------------------------------------------
// Dispatch: one work item is a run of output rows of one product.

using ItemFn = void (*)(const Input&, const Product&, int64_t, int64_t);

template <template <int> class T>
ItemFn ByFormat(Fmt f) {
  switch (f) {
    case kQ8_0: return T<kQ8_0>::fn;
    case kQ4_0: return T<kQ4_0>::fn;
    case kQ4_1: return T<kQ4_1>::fn;
    case kQ4K: return T<kQ4K>::fn;
    default: return T<kQ6K>::fn;
  }
}
#if defined(__x86_64__)
template <int F>
struct Z {
  static constexpr ItemFn fn = ItemZ<F>;
};
template <int F>
struct Y {
  static constexpr ItemFn fn = ItemY<F>;
};
#endif

ItemFn Exact(Isa path, Fmt f) {
#if defined(__x86_64__)
  if (path == Isa::kAvx512Vnni || path == Isa::kAvx512) return ByFormat<Z>(f);
  if (path == Isa::kAvx2Fma) return ByFormat<Y>(f);
#endif
  return ScalarItem;
}


// ---------------------------------------------------------------------------------------------
// Not exact: int8 x int8 dots. A group's weight codes as 32 unsigned bytes u (q = u - offset),
// so one u8 x s8 instruction takes every format: vpdpbusd (AVX512_VNNI) or vpmaddubsw +
// vpmaddwd (AVX2; a u8 x s8 pair sum stays below 2^15 for u <= 63). q8_0's signed codes go
// as |q| against x's codes with q's sign (llama.cpp's trick), offset 0. The int32 lanes of
// the result are 4-code sums: lanes 0-3 cover codes 0-15, lanes 4-7 codes 16-31 (q6_K's two
// scales).

#if defined(__x86_64__)
struct Codes8 {
  __m256i u, xs;  // weight codes (u8) and the x codes they multiply (s8)
  int32_t offset;
};

template <int F>
HOTSWAP_TARGET_AVX2 inline Codes8 CodesY(const uint8_t* row, int64_t g, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i low = _mm256_set1_epi8(0xF);
  if constexpr (F == kQ8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 34 + 2));
    return {_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q), 0};
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * (F == kQ4_1 ? 20 : 18) + (F == kQ4_1 ? 4 : 2)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
    return {_mm256_and_si256(both, low), x, F == kQ4_0 ? 8 : 0};
  } else if constexpr (F == kQ4K) {
    const uint8_t* qs = row + (g / 8) * 144 + 16 + 32 * ((g % 8) / 2);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i u = (g % 2) ? _mm256_srli_epi16(q, 4) : q;
    return {_mm256_and_si256(u, low), x, 0};
  } else {  // kQ6K
    const uint8_t* p = row + (g / 8) * 210;
    const int j = static_cast<int>(g % 8), h = j / 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (j % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m128i ls = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), hs = _mm_cvtsi32_si128(2 * (j % 4));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, ls), low);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, hs), _mm256_set1_epi8(3));
    return {_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), x, 32};
  }
}

// The group's affine map (block_formats.h's Codes, without decoding the codes).
template <int F>
inline Affine ScalesOf(const uint8_t* row, int64_t g) {
  if constexpr (F == kQ8_0 || F == kQ4_0) {
    const float d = HalfToFloat(row + g * (F == kQ8_0 ? 34 : 18));
    return {{d, d}, 0.0f};
  } else if constexpr (F == kQ4_1) {
    return {{HalfToFloat(row + g * 20), HalfToFloat(row + g * 20)}, HalfToFloat(row + g * 20 + 2)};
  } else if constexpr (F == kQ4K) {
    const uint8_t* p = row + (g / 8) * 144;
    int sc, m;
    ScaleMinK4(static_cast<int>(g % 8), p + 4, &sc, &m);
    const float a = HalfToFloat(p) * static_cast<float>(sc);
    return {{a, a}, -(HalfToFloat(p + 2) * static_cast<float>(m))};
  } else {
    const uint8_t* p = row + (g / 8) * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 2 * (g % 8);
    const float d = HalfToFloat(p + 208);
    return {{d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1])}, 0.0f};
  }
}

// One group of one (output row, x row): sum_t w[t] x[t] ~ sx * (a . dots - a * offset * s16 + b * s16),
// dots: the 8 int32 lanes. The lane sums are scaled as a vector (acc), the offset and min
// terms as a scalar (extra).
struct IntAcc {
  __m256 acc;
  float extra;
};

template <int F>
HOTSWAP_TARGET_AVX2 inline void AddGroupY(IntAcc& a, __m256i dots, const Affine& A, int32_t offset, const Input& in,
                                          int64_t r, int64_t g) {
  const int64_t groups = in.K / kGroup;
  const float sx = in.scale[r * groups + g];
  const int32_t* s16 = in.sum16.data() + r * (in.K / 16) + 2 * g;
  const __m256 scale = _mm256_setr_m128(_mm_set1_ps(sx * A.a[0]), _mm_set1_ps(sx * A.a[1]));
  a.acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, a.acc);
  a.extra += sx * ((A.b - A.a[0] * offset) * s16[0] + (A.b - A.a[1] * offset) * s16[1]);
}

template <int F>
HOTSWAP_TARGET_AVX2 void IntItemY(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t r = 0; r < in.M; ++r) {
      IntAcc a{_mm256_setzero_ps(), 0.0f};
      const int8_t* xq = in.q8.data() + r * in.K;
      for (int64_t g = 0; g < in.K / kGroup; ++g) {
        const Codes8 c = CodesY<F>(row, g, xq + g * kGroup);
        const __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(c.u, c.xs), ones);
        AddGroupY<F>(a, dots, ScalesOf<F>(row, g), c.offset, in, r, g);
      }
      p.y[r * p.N + n] = SumY(a.acc) + a.extra;
    }
  }
}

template <int F>
HOTSWAP_TARGET_AVX512_VNNI void IntItemVnni(const Input& in, const Product& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t r = 0; r < in.M; ++r) {
      IntAcc a{_mm256_setzero_ps(), 0.0f};
      const int8_t* xq = in.q8.data() + r * in.K;
      for (int64_t g = 0; g < in.K / kGroup; ++g) {
        const Codes8 c = CodesY<F>(row, g, xq + g * kGroup);
        const __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c.u, c.xs);
        AddGroupY<F>(a, dots, ScalesOf<F>(row, g), c.offset, in, r, g);
      }
      p.y[r * p.N + n] = SumY(a.acc) + a.extra;
    }
  }
}

template <int F>
struct IntY {
  static constexpr ItemFn fn = IntItemY<F>;
};
template <int F>
struct IntZ {
  static constexpr ItemFn fn = IntItemVnni<F>;
};
#endif

// Not exact: AVX512_VNNI's vpdpbusd; AVX-512 without VNNI and AVX2 take vpmaddubsw + vpmaddwd.
ItemFn IntDots(Isa path, Fmt f) {
#if defined(__x86_64__)
  if (path == Isa::kAvx512Vnni) return ByFormat<IntZ>(f);
  if (path == Isa::kAvx512 || path == Isa::kAvx2Fma) return ByFormat<IntY>(f);
#endif
  return ScalarIntItem;
}

// x's int8 codes per 32-group (q8_0: scale amax / 127, round to nearest) and each half's sum.
void QuantizeInput(Input& in) {
  const int64_t groups = in.K / kGroup;
  in.q8.resize(in.M * in.K);
  in.scale.resize(in.M * groups);
  in.sum16.resize(in.M * (in.K / 16));
  for (int64_t r = 0; r < in.M; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = in.x + r * in.K + g * kGroup;
      float amax = 0.0f;
      for (int t = 0; t < kGroup; ++t) amax = std::max(amax, std::fabs(x[t]));
      const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = in.q8.data() + r * in.K + g * kGroup;
      int32_t s[2] = {0, 0};
      for (int t = 0; t < kGroup; ++t) {
        q[t] = static_cast<int8_t>(std::nearbyint(x[t] * inv));
        s[t / 16] += q[t];
      }
      in.scale[r * groups + g] = d;
      in.sum16[r * (in.K / 16) + 2 * g] = s[0];
      in.sum16[r * (in.K / 16) + 2 * g + 1] = s[1];
    }
}

// ---------------------------------------------------------------------------------------------
// FFI

constexpr Isa kOffered[] = {Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2Fma};

// The row bytes of a K-column row of `fmt`, or -1 when K is not a whole number of blocks.
int64_t RowBytes(Fmt f, int64_t K) {
  const Layout l = kLayouts[f];
  return K % l.elems == 0 ? K / l.elems * l.bytes : -1;
}

ffi::Error BlockMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                       ffi::Span<const int32_t> fmts, int32_t isa, bool exact) {
  const Isa path = hotswap::Pick(isa, kOffered);
  if (path == Isa::kAuto) {
    return ffi::Error::InvalidArgument("hotswap block matmul: isa " + std::to_string(isa) +
                                       " is not a path this kernel has or this CPU runs");
  }
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != ys.size() || fmts.size() != ws.size()) {
    return ffi::Error::InvalidArgument("hotswap block matmul: need x [M, K], one result and one format per weight");
  }
  Input in{x.typed_data(), xd[0], xd[1]};
  std::vector<Product> ps;
  std::vector<ItemFn> fns;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value() || fmts[i] < 0 || fmts[i] >= kFormats) {
      return ffi::Error::InvalidArgument("hotswap block matmul: uint8 blocks of a known format, f32 results");
    }
    const Fmt f = static_cast<Fmt>(fmts[i]);
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 2 || RowBytes(f, in.K) != wd[1] || yd.size() != 2 || yd[0] != in.M || yd[1] != wd[0]) {
      return ffi::Error::InvalidArgument("hotswap block matmul: need blocks [N, K/elems*bytes], y [M, N] for x [M, K]");
    }
    ps.push_back(Product{f, w->typed_data(), wd[0], wd[1], (*y)->typed_data()});
    fns.push_back(exact ? Exact(path, f) : IntDots(path, f));
  }
  if (in.M == 0) return ffi::Error::Success();
  if (!exact) QuantizeInput(in);
  // Work items: runs of output rows. Up to the path's direct rows, ~8 runs a thread over all
  // the products (contiguous blocks per run, balanced to within a run); more rows, kPanel-row
  // panels (a panel item handles at most kPanel output rows).
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t total_rows = 0;
  for (const Product& p : ps) total_rows += p.N;
  const int64_t direct = std::max<int64_t>(2, (total_rows + 8 * threads - 1) / (8 * threads) / 2 * 2);
  std::vector<int64_t> runs, first{0};  // each product's run, and the items before it
  for (const Product& p : ps) {
    runs.push_back(exact && in.M > DirectRows(path, p.fmt) ? kPanel : direct);
    first.push_back(first.back() + (p.N + runs.back() - 1) / runs.back());
  }
  hotswap::ParallelFor(pool, first.back(), [&](int64_t item) {
    size_t j = 0;
    while (item >= first[j + 1]) ++j;
    const int64_t n0 = (item - first[j]) * runs[j];
    fns[j](in, ps[j], n0, std::min(n0 + runs[j], ps[j].N));
  });
  return ffi::Error::Success();
}

// out[T, K] = the rows `ids` of blocks [V, bytes], decoded (llama.cpp's get_rows).
ffi::Error BlockRows(ffi::Buffer<ffi::U8> blocks, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> out,
                     int32_t fmt) {
  auto bd = blocks.dimensions(), od = out->dimensions();
  if (fmt < 0 || fmt >= kFormats || bd.size() != 2 || od.size() != 2 || od[0] != ids.element_count() ||
      RowBytes(static_cast<Fmt>(fmt), od[1]) != bd[1]) {
    return ffi::Error::InvalidArgument("hotswap block rows: need blocks [V, K/elems*bytes] and out [T, K]");
  }
  const int64_t K = od[1], V = bd[0];
  for (int64_t t = 0; t < od[0]; ++t) {
    const int32_t id = ids.typed_data()[t];
    if (id < 0 || id >= V) {
      return ffi::Error::InvalidArgument("hotswap block rows: id " + std::to_string(id) + " outside [0, " +
                                         std::to_string(V) + ")");
    }
    const uint8_t* row = blocks.typed_data() + id * bd[1];
    for (int64_t g = 0; g < K / kGroup; ++g) DecodeGroup(static_cast<Fmt>(fmt), row, g, out->typed_data() + t * K + g * kGroup);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapBlockMatmul, BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .RemainingArgs()               // blocks [N_i, bytes_i], uint8
                                  .RemainingRets()               // y_i [M, N_i] f32
                                  .Attr<ffi::Span<const int32_t>>("fmts")  // block_formats.h Fmt, one a weight
                                  .Attr<int32_t>("isa")                    // cpu_isa.attribute(...)
                                  .Attr<bool>("exact"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapBlockRows, BlockRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // blocks [V, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [T, K]
                                  .Attr<int32_t>("fmt"));
