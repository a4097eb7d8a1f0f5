// The online-softmax step of paged attention on bf16 K/V as they sit in the pages, with
// AVX512_BF16's vdpbf16ps (`Isa::kAvx512Bf16`): the other paths widen every key's K and V to f32
// (a pass over a scratch copy) and then run f32 FMAs; here a K or V vector holds 32 values instead
// of 16 and nothing is copied.
//
// vdpbf16ps adds a[2i] * b[2i] + a[2i+1] * b[2i+1] into f32 lane i. For q.k the pairs run along
// head_dim: q and k rows are already pairs. q is f32 (scaled); rounding it to bf16 made the
// scores' error grow with their size (1.5% on a peaked bf16 prefill test), so each q row is split
// once per call into a bf16 high part and a bf16 remainder (q to 16 mantissa bits) and each score
// is two vdpbf16ps chains, still one K load for both. For p.V the pairs run along the keys: V rows
// j and j + 1 are interleaved (vpunpcklwd / vpunpckhwd, which work within 128-bit lanes, so the
// output sits permuted in the accumulators and is put back in order on the way out) and each
// head's (p_j, p_j+1) is rounded to bf16 and broadcast; the softmax sum l adds the rounded p, so
// each output is still a weighted mean whose weights sum to one. Widening V with a shift and
// folding p.V with f32 FMAs instead (p exact) was slower at the rollout's shapes
// (benchmarks/attention_bf16.py on a busy 2-core Zen 4: 0.79-0.88x the widened "avx512" path's
// time, against 0.56-0.81x for the pairs).
// Against tests/kernels/test_cpu_attention_isa.py's float64 oracle the outputs are as close as
// the f32 paths' (both dominated by the bf16 output's own rounding).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "isa.h"
#include "vec_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// For the p.V accumulators of one 32-value block of V: lo[i] holds output value kLo[i] of the
// block and hi[i] value kLo[i] + 4 (the unpacks' order); the permutations between that order
// and the natural one, as _mm512_permutex2var_ps indices over (lo, hi) and over (r0, r1).
HOTSWAP_TARGET_AVX512_BF16 inline void Unpermute(__m512 lo, __m512 hi, float* out) {
  // out[d] for d in 0..31: d = 8L + k (L the 128-bit lane): k < 4 -> lo[4L + k], else hi[4L + k - 4].
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, i0, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, i1, hi));
}

// The inverse of Unpermute: 32 values in order into (lo, hi).
HOTSWAP_TARGET_AVX512_BF16 inline void Permute(const float* in, __m512& lo, __m512& hi) {
  const __m512 r0 = _mm512_loadu_ps(in), r1 = _mm512_loadu_ps(in + 16);
  // lo[4L + k] = in[8L + k], hi[4L + k] = in[8L + 4 + k] (k < 4); L >= 2 lies in r1 (index 16 +).
  const __m512i il = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i ih = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  lo = _mm512_permutex2var_ps(r0, il, r1);
  hi = _mm512_permutex2var_ps(r0, ih, r1);
}

// Two keys' dot lanes a0, a1 folded into one vector: in each 128-bit lane L, its 64-bit halves
// hold (a0, a1) partial sums of lane L's four values (the first step of Scores16's tree).
HOTSWAP_TARGET_AVX512_BF16 inline __m512 SumPairs(__m512 a0, __m512 a1) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
}

// Lane j: the full sum of key j's dot lanes, from SumPairs of keys (0, 1), (2, 3), ... (14, 15).
HOTSWAP_TARGET_AVX512_BF16 inline __m512 Scores16(const __m512* x) {
  __m512 y[4];  // y[i], 128-bit lane L: keys 4i..4i+3's partial sums of their lane L
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Lanes 0, 2 plus lanes 1, 3 of two vectors: twice, and each 128-bit lane is one y's total.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// The online-softmax step of GH q heads that share a kv head over n <= 16 keys: bf16 K and V rows
// kstride apart, HD = 64 or 128; qg: the heads' scaled queries as bf16, HD apart; acc rows HD
// apart; m, l one per head. Each K and V vector is loaded once for all GH heads, as in Fold16.
template <int HD, int GH>
HOTSWAP_TARGET_AVX512_BF16 inline void Fold16Bf16(const uint16_t* qg, const uint16_t* kb, const uint16_t* vb,
                                                  int64_t kstride, int n, float cap, float* m, float* l, float* acc) {
  constexpr int V = HD / 32;  // 512-bit vectors of a bf16 row
  alignas(64) float s[GH][16];
  __m512bh qv[GH][V], ql[GH][V];
  for (int h = 0; h < GH; ++h)
    for (int c = 0; c < V; ++c) {
      qv[h][c] = (__m512bh)_mm512_loadu_si512(qg + 2 * h * HD + 32 * c);
      ql[h][c] = (__m512bh)_mm512_loadu_si512(qg + (2 * h + 1) * HD + 32 * c);
    }
  // A score is a sum of 16 lanes: rather than one horizontal sum per key and head, the keys'
  // lane vectors are summed in a transposing tree (SumPairs, then Scores16): 16 keys' scores
  // land in one vector in about a third of the shuffles and adds.
  __m512 x[GH][8];
  for (int j = 0; j < 16; j += 2) {
    if (j >= n) {
      for (int h = 0; h < GH; ++h) x[h][j / 2] = _mm512_setzero_ps();
      continue;
    }
    __m512bh k0[V], k1[V];
    for (int c = 0; c < V; ++c) {
      k0[c] = (__m512bh)_mm512_loadu_si512(kb + j * kstride + 32 * c);
      // An odd last key pairs with zeros, never with the next slot (no query may read it: NaN).
      k1[c] = (__m512bh)(j + 1 < n ? _mm512_loadu_si512(kb + (j + 1) * kstride + 32 * c) : _mm512_setzero_si512());
    }
    for (int h = 0; h < GH; ++h) {
      __m512 a0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], k0[0]);
      __m512 a1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], k1[0]);
      a0 = _mm512_dpbf16_ps(a0, ql[h][0], k0[0]), a1 = _mm512_dpbf16_ps(a1, ql[h][0], k1[0]);
      for (int c = 1; c < V; ++c) {
        a0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a0, qv[h][c], k0[c]), ql[h][c], k0[c]);
        a1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a1, qv[h][c], k1[c]), ql[h][c], k1[c]);
      }
      x[h][j / 2] = SumPairs(a0, a1);
    }
  }
  for (int h = 0; h < GH; ++h) _mm512_store_ps(s[h], Scores16(x[h]));
  if (cap > 0) {
    for (int h = 0; h < GH; ++h)
      for (int j = 0; j < n; ++j) s[h][j] = cap * std::tanh(s[h][j] / cap);
  }
  // p as bf16 pairs along the keys (p_j, p_j+1) per head, 0 past n; corr per head.
  const __mmask16 live = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  alignas(64) uint32_t pp[GH][8];
  float corr[GH];
  for (int h = 0; h < GH; ++h) {
    const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s[h]);
    const float mx = std::max(m[h], _mm512_reduce_max_ps(sv));
    const __m512 pv = _mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
    const __m256bh pb = _mm512_cvtneps_pbh(pv);  // round to nearest even, as the pairs will be used
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp[h]), (__m256i)pb);
    const __m512 used = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16));
    corr[h] = ExpNonPositive(m[h] - mx);  // m = -inf before the first block: 0
    l[h] = l[h] * corr[h] + _mm512_reduce_add_ps(used);
    m[h] = mx;
  }
  __m512 o[GH][2 * V];  // per 32-value block c: o[2c] the unpacklo order, o[2c + 1] the unpackhi
  for (int h = 0; h < GH; ++h) {
    const __m512 cv = _mm512_set1_ps(corr[h]);
    for (int c = 0; c < V; ++c) {
      Permute(acc + h * HD + 32 * c, o[h][2 * c], o[h][2 * c + 1]);
      o[h][2 * c] = _mm512_mul_ps(o[h][2 * c], cv);
      o[h][2 * c + 1] = _mm512_mul_ps(o[h][2 * c + 1], cv);
    }
  }
  for (int j = 0; j < n; j += 2) {
    const uint16_t* v0 = vb + j * kstride;
    const uint16_t* v1 = v0 + kstride;
    __m512bh vlo[V], vhi[V];
    for (int c = 0; c < V; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
      // An odd last key pairs with zeros, never with the next slot (no query may read it: NaN).
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
      vlo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      vhi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int h = 0; h < GH; ++h) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[h][j / 2]));
      for (int c = 0; c < V; ++c) {
        o[h][2 * c] = _mm512_dpbf16_ps(o[h][2 * c], pj, vlo[c]);
        o[h][2 * c + 1] = _mm512_dpbf16_ps(o[h][2 * c + 1], pj, vhi[c]);
      }
    }
  }
  for (int h = 0; h < GH; ++h)
    for (int c = 0; c < V; ++c) Unpermute(o[h][2 * c], o[h][2 * c + 1], acc + h * HD + 32 * c);
}

// Fold16Bf16 for gh (1..G) heads: the compile-time head count for a run-time one.
template <int HD, int G>
HOTSWAP_TARGET_AVX512_BF16 inline void FoldGroupBf16(int64_t gh, const uint16_t* qg, const uint16_t* kb,
                                                     const uint16_t* vb, int64_t kstride, int n, float cap, float* m,
                                                     float* l, float* acc) {
  if constexpr (G > 1) {
    if (gh < G) return FoldGroupBf16<HD, G - 1>(gh, qg, kb, vb, kstride, n, cap, m, l, acc);
  }
  Fold16Bf16<HD, G>(qg, kb, vb, kstride, n, cap, m, l, acc);
}

// Every q head of a kv head over n keys in 16-key blocks (the blocks of Fold16), kMaxGH heads at
// a time. False for a head_dim it has no fold for (the caller widens and folds in f32).
HOTSWAP_TARGET_AVX512_BF16 inline bool FoldBf16(int64_t hd, int64_t g_n, const uint16_t* qg, const uint16_t* kb,
                                                const uint16_t* vb, int64_t kstride, int64_t n, float cap, float* m,
                                                float* l, float* acc) {
  if (hd != 64 && hd != 128) return false;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nj = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int64_t g = 0; g < g_n; g += (hd == 64 ? 4 : 2)) {
      const int64_t gh = std::min<int64_t>(hd == 64 ? 4 : 2, g_n - g);
      const uint16_t *k = kb + j0 * kstride, *v = vb + j0 * kstride;
      if (hd == 64) {
        FoldGroupBf16<64, 4>(gh, qg + g * 128, k, v, kstride, nj, cap, m + g, l + g, acc + g * 64);
      } else {
        FoldGroupBf16<128, 2>(gh, qg + g * 256, k, v, kstride, nj, cap, m + g, l + g, acc + g * 128);
      }
    }
  }
  return true;
}

}  // namespace

#endif  // __AVX512F__
