// The online-softmax step of paged attention (`paged_attention.cc`): fold a block of keys
// into the running max m, sum l and output acc of the q heads of one kv head.
//
// Three f32 paths, picked per call (`isa.h`; the caller passes the path): AVX-512 (16-key blocks,
// a head's scores in one register), AVX2 + FMA (8 keys' dots at once, 16-key blocks in two
// registers) and plain loops the compiler vectorizes as it can. All three fold the same keys in
// the same blocks; they differ only in rounding. A path's code is compiled where the build's
// -march=native has its instructions (the library is rebuilt for each CPU: `cpu_build.py`), so
// the AVX-512 and AVX2 paths exist on every CPU that can run them. bf16 pages read in place
// with AVX512_BF16 are `attention_bf16.h`.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "isa.h"
#include "vec_exp.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// The online-softmax step of GH q heads that share a kv head, over n <= 16 keys (f32 rows
// kstride apart), HD = 64 or 128. q rows, acc rows: HD apart; m, l: one per head. Each K and
// V vector is loaded once for all GH heads: one head at a time loaded one vector per FMA
// and was bound by the load ports, not the FMAs. A head's 16 scores sit in one vector for
// max / exp / sum, and its output stays in registers.
template <int HD, int GH>
inline void Fold16(const float* qg, const float* kb, const float* vb, int64_t kstride, int n, float cap, float* m,
                   float* l, float* acc) {
  constexpr int V = HD / 16;
  alignas(64) float s[GH][16];
  __m512 qv[GH][V];
  for (int h = 0; h < GH; ++h)
    for (int c = 0; c < V; ++c) qv[h][c] = _mm512_loadu_ps(qg + h * HD + 16 * c);
  for (int j = 0; j < n; ++j) {
    const float* kj = kb + j * kstride;
    __m512 kv[V];
    for (int c = 0; c < V; ++c) kv[c] = _mm512_loadu_ps(kj + 16 * c);
    for (int h = 0; h < GH; ++h) {  // two chains per dot, overlapping across heads and keys
      __m512 a0 = _mm512_mul_ps(qv[h][0], kv[0]), a1 = _mm512_mul_ps(qv[h][1], kv[1]);
      for (int c = 2; c < V; c += 2) {
        a0 = _mm512_fmadd_ps(qv[h][c], kv[c], a0);
        a1 = _mm512_fmadd_ps(qv[h][c + 1], kv[c + 1], a1);
      }
      s[h][j] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
  }
  if (cap > 0) {
    for (int h = 0; h < GH; ++h)
      for (int j = 0; j < n; ++j) s[h][j] = cap * std::tanh(s[h][j] / cap);
  }
  const __mmask16 live = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  __m512 o[GH][V];
  for (int h = 0; h < GH; ++h) {
    const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s[h]);
    const float mx = std::max(m[h], _mm512_reduce_max_ps(sv));
    const __m512 pv = _mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
    _mm512_store_ps(s[h], pv);
    const float corr = ExpNonPositive(m[h] - mx);  // m = -inf before the first block: 0
    l[h] = l[h] * corr + _mm512_reduce_add_ps(pv);
    m[h] = mx;
    const __m512 cv = _mm512_set1_ps(corr);
    for (int c = 0; c < V; ++c) o[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * HD + 16 * c), cv);
  }
  for (int j = 0; j < n; ++j) {
    const float* vj = vb + j * kstride;
    __m512 vv[V];
    for (int c = 0; c < V; ++c) vv[c] = _mm512_loadu_ps(vj + 16 * c);
    for (int h = 0; h < GH; ++h) {
      const __m512 pj = _mm512_set1_ps(s[h][j]);
      for (int c = 0; c < V; ++c) o[h][c] = _mm512_fmadd_ps(pj, vv[c], o[h][c]);
    }
  }
  for (int h = 0; h < GH; ++h)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc + h * HD + 16 * c, o[h][c]);
}

// The most heads one Fold16 takes: its GH x HD/16 accumulators, HD/16 K or V vectors and a
// broadcast fit in the 32 zmm registers.
template <int HD>
constexpr int kMaxGH = HD == 64 ? 4 : 2;

// Fold16 for gh (1..G) heads: the compile-time head count for a run-time one.
template <int HD, int G>
inline void FoldGroup(int64_t gh, const float* qg, const float* kb, const float* vb, int64_t kstride, int n,
                      float cap, float* m, float* l, float* acc) {
  if constexpr (G > 1) {
    if (gh < G) return FoldGroup<HD, G - 1>(gh, qg, kb, vb, kstride, n, cap, m, l, acc);
  }
  Fold16<HD, G>(qg, kb, vb, kstride, n, cap, m, l, acc);
}

// Every q head of a kv head, kMaxGH at a time.
template <int HD>
inline void FoldHeads16(int64_t g_n, const float* qg, const float* kb, const float* vb, int64_t kstride, int n,
                        float cap, float* m, float* l, float* acc) {
  for (int64_t g = 0; g < g_n; g += kMaxGH<HD>) {
    const int64_t gh = std::min<int64_t>(kMaxGH<HD>, g_n - g);
    FoldGroup<HD, kMaxGH<HD>>(gh, qg + g * HD, kb, vb, kstride, n, cap, m + g, l + g, acc + g * HD);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Lane j of the result: the sum of a[j]'s 8 lanes (a transposing add tree: 8 dots reduced in
// 7 shuffle-adds instead of 8 separate horizontal sums).
inline __m256 Sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float HMax256(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float HSum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The online-softmax step of GH <= 3 q heads that share a kv head, over n <= 16 keys (f32 rows
// kstride apart), HD a multiple of 64. The dots go 4 keys x GH heads at a time, so each K vector
// is loaded once for every head (12 accumulators and 4 K vectors fill the 16 ymm registers), and
// four dots reduce together in one hadd tree. The max / exp / sum of the GH heads then run side
// by side (one exp for every head's rescale), so their dependent horizontal ops overlap. Each
// head's output is accumulated 64 floats (8 registers) at a time, its V block re-read from L1.
template <int HD, int GH>
inline void Fold8(const float* qg, const float* kb, const float* vb, int64_t kstride, int n, float cap, float* m,
                  float* l, float* acc) {
  static_assert(HD % 64 == 0, "Fold8 takes head_dim 64, 128, 256");
  constexpr int V = HD / 8;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live[2] = {_mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ),
                          _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - 8)), _CMP_LT_OQ)};
  alignas(32) float sc[GH][16];
  for (int j0 = 0; j0 < n; j0 += 4) {
    const float* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = kb + std::min(j0 + j, n - 1) * kstride;
    __m256 a[GH][4];
    for (int h = 0; h < GH; ++h)
      for (int j = 0; j < 4; ++j) a[h][j] = _mm256_setzero_ps();
    for (int c = 0; c < V; ++c) {
      __m256 kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = _mm256_loadu_ps(kr[j] + 8 * c);
      for (int h = 0; h < GH; ++h) {
        const __m256 qc = _mm256_loadu_ps(qg + h * HD + 8 * c);
        for (int j = 0; j < 4; ++j) a[h][j] = _mm256_fmadd_ps(qc, kv[j], a[h][j]);
      }
    }
    for (int h = 0; h < GH; ++h) {
      const __m256 t0 = _mm256_hadd_ps(a[h][0], a[h][1]), t1 = _mm256_hadd_ps(a[h][2], a[h][3]);
      const __m256 u = _mm256_hadd_ps(t0, t1);  // [k0 k1 k2 k3 | k0 k1 k2 k3] halves
      _mm_store_ps(sc[h] + j0, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
    }
  }
  __m256 sv[GH][2];
  for (int h = 0; h < GH; ++h) sv[h][0] = _mm256_load_ps(sc[h]), sv[h][1] = n > 8 ? _mm256_load_ps(sc[h] + 8) : ninf;
  alignas(32) float s[GH][16];
  if (cap > 0) {
    for (int h = 0; h < GH; ++h) {
      _mm256_store_ps(s[h], sv[h][0]);
      _mm256_store_ps(s[h] + 8, sv[h][1]);
      for (int j = 0; j < n; ++j) s[h][j] = cap * std::tanh(s[h][j] / cap);
      sv[h][0] = _mm256_load_ps(s[h]), sv[h][1] = _mm256_load_ps(s[h] + 8);
    }
  }
  static_assert(GH <= 8, "one lane per head in the rescale exp");
  alignas(32) float shift[8] = {};  // m - new max per head, for one vector exp
  float mx[GH];
  for (int h = 0; h < GH; ++h) {
    sv[h][0] = _mm256_blendv_ps(ninf, sv[h][0], live[0]);
    sv[h][1] = _mm256_blendv_ps(ninf, sv[h][1], live[1]);
    mx[h] = std::max(m[h], HMax256(_mm256_max_ps(sv[h][0], sv[h][1])));
    shift[h] = m[h] - mx[h];  // m = -inf before the first block: its scale is ~0
  }
  alignas(32) float corr[8];
  _mm256_store_ps(corr, Exp256(_mm256_load_ps(shift)));
  for (int h = 0; h < GH; ++h) {
    const __m256 mv = _mm256_set1_ps(mx[h]);
    const __m256 p0 = _mm256_and_ps(Exp256(_mm256_sub_ps(sv[h][0], mv)), live[0]);
    const __m256 p1 = _mm256_and_ps(Exp256(_mm256_sub_ps(sv[h][1], mv)), live[1]);
    _mm256_store_ps(s[h], p0);
    _mm256_store_ps(s[h] + 8, p1);
    l[h] = l[h] * corr[h] + HSum256(_mm256_add_ps(p0, p1));
    m[h] = mx[h];
  }
  for (int h = 0; h < GH; ++h) {
    const __m256 cv = _mm256_set1_ps(corr[h]);
    float* ah = acc + h * HD;
    for (int c0 = 0; c0 < V; c0 += 8) {
      __m256 o[8];
      for (int c = 0; c < 8; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(ah + 8 * (c0 + c)), cv);
      for (int j = 0; j < n; ++j) {
        const __m256 pj = _mm256_broadcast_ss(&s[h][j]);
        const float* vj = vb + j * kstride + 8 * c0;
        for (int c = 0; c < 8; ++c) o[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), o[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(ah + 8 * (c0 + c), o[c]);
    }
  }
}

// Fold8 for gh (1..G) heads: the compile-time head count for a run-time one.
template <int HD, int G>
inline void FoldGroup8(int64_t gh, const float* qg, const float* kb, const float* vb, int64_t kstride, int n,
                       float cap, float* m, float* l, float* acc) {
  if constexpr (G > 1) {
    if (gh < G) return FoldGroup8<HD, G - 1>(gh, qg, kb, vb, kstride, n, cap, m, l, acc);
  }
  Fold8<HD, G>(qg, kb, vb, kstride, n, cap, m, l, acc);
}

// Every q head of a kv head, 3 at a time, over n keys in blocks of 16.
template <int HD>
inline void FoldHeads8(int64_t g_n, const float* qg, const float* kb, const float* vb, int64_t kstride, int64_t n,
                       float cap, float* m, float* l, float* acc) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nj = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int64_t g = 0; g < g_n; g += 3) {
      const int64_t gh = std::min<int64_t>(3, g_n - g);
      FoldGroup8<HD, 3>(gh, qg + g * HD, kb + j0 * kstride, vb + j0 * kstride, kstride, nj, cap, m + g, l + g,
                        acc + g * HD);
    }
  }
}
#endif  // __AVX2__ && __FMA__

// The f32 paths this build has, best first (kScalar: always). kAvx512Bf16 folds f32 keys with
// the AVX-512 path; `attention_bf16.h` has its bf16 fold.
constexpr hotswap::Isa kFoldPaths[] = {
#if defined(__AVX512F__)
    hotswap::Isa::kAvx512Bf16, hotswap::Isa::kAvx512,
#endif
#if defined(__AVX2__) && defined(__FMA__)
    hotswap::Isa::kAvx2Fma,
#endif
    hotswap::Isa::kScalar,
};

// Online-softmax step over n keys (f32 rows kstride apart) for the g_n q heads of one kv
// head (q and acc rows hd apart; m, l one per head) on path `isa` (one of kFoldPaths): AVX-512
// for head_dim 64 / 128, AVX2 for head_dim 64 / 128 / 256, plain loops otherwise and on kScalar.
// Scores are softcapped when cap > 0. `sc` is scratch of at least n floats.
inline void Fold(hotswap::Isa isa, int64_t hd, int64_t g_n, const float* qg, const float* kb, const float* vb,
                 int64_t kstride, int64_t n, float cap, float* m, float* l, float* acc, float* sc) {
  using hotswap::Isa;
#if defined(__AVX512F__)
  if ((isa == Isa::kAvx512Bf16 || isa == Isa::kAvx512) && (hd == 64 || hd == 128)) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int nj = static_cast<int>(std::min<int64_t>(16, n - j0));
      if (hd == 64) {
        FoldHeads16<64>(g_n, qg, kb + j0 * kstride, vb + j0 * kstride, kstride, nj, cap, m, l, acc);
      } else {
        FoldHeads16<128>(g_n, qg, kb + j0 * kstride, vb + j0 * kstride, kstride, nj, cap, m, l, acc);
      }
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  // The AVX-512 build kept head_dim 256 on the plain loops: so does its AVX-512 path here.
  if (isa == Isa::kAvx2Fma) {
    switch (hd) {
      case 64:
        return FoldHeads8<64>(g_n, qg, kb, vb, kstride, n, cap, m, l, acc);
      case 128:
        return FoldHeads8<128>(g_n, qg, kb, vb, kstride, n, cap, m, l, acc);
      case 256:
        return FoldHeads8<256>(g_n, qg, kb, vb, kstride, n, cap, m, l, acc);
      default:
        break;
    }
  }
#endif
  for (int64_t g = 0; g < g_n; ++g) {
    const float* qh = qg + g * hd;
    float* ah = acc + g * hd;
    float mx = m[g];
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = kb + j * kstride;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < hd; ++d) dot += qh[d] * kj[d];
      if (cap > 0) dot = cap * std::tanh(dot / cap);
      sc[j] = dot;
      mx = std::max(mx, dot);
    }
    const float corr = ExpNonPositive(m[g] - mx);  // m = -inf before the first block: 0
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sc[j] = ExpNonPositive(sc[j] - mx);
      sum += sc[j];
    }
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) ah[d] *= corr;
    for (int64_t j = 0; j < n; ++j) {
      const float p = sc[j];
      const float* vj = vb + j * kstride;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) ah[d] += p * vj[d];
    }
    m[g] = mx;
    l[g] = l[g] * corr + sum;
  }
}

}  // namespace
