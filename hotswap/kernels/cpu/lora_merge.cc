// out = w + scale * (a @ b) for every leaf a LoRA adapter adapts, in one call: the merged RL
// sync on one CPU device (hotswap/kernels/cpu_lora.py, used by model/lora.py's `merge`).
//
// Why: a merged sync reads each adapted weight and writes its merged copy once, with
// 2 * r FLOP per element between (rank 64: 128 FLOP per 4-byte weight, far above what DRAM
// bounds). XLA:CPU ran it as a dot into a temporary, then an add and a convert over that
// temporary, one leaf after another; here each output tile is summed in registers and
// written once, with every leaf's tiles shared out over XLA's intra-op threads in one
// parallel region.
//
// Inputs: n triples (w [M, N] f32 or bf16, a [M, r] f32, b [r, N] f32), row-major; outputs:
// n arrays [M, N] of w's dtype. Attr scale (f32). Each product is summed in f32; the sum is
// added to w (widened, for bf16) with one rounding (an FMA), and a bf16 result is rounded to
// nearest even, as XLA's convert rounds it.
//
// Register tiles (AVX2 + FMA): kMR = 6 rows x 16 columns, 12 ymm accumulators, 2 b vectors and
// one broadcast of a in the 16 ymm registers, so each k step is 12 FMAs for 2 loads of b.
// A work item is a block of kRowBlock rows x kColBlock columns of one leaf. It packs its
// columns of b into 16-column panels first (r x 64 B each: 4 KB at rank 64, in L1 while every
// row tile of the block uses it); its rows of a (48 KB at rank 64) stay in L2. Without AVX2 a
// portable scalar loop.
//
// The merged leaves are fresh buffers, never w's: the engine keeps the base weights for the
// next sync, so w cannot be donated.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HOTSWAP_LORA_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

using hotswap::bf16;
using hotswap::Widen;

constexpr int64_t kMR = 6;          // rows of a register tile
constexpr int64_t kNR = 16;         // columns of a register tile (two ymm)
constexpr int64_t kRowBlock = 192;  // rows of a work item: 32 tiles share each packed panel of b
constexpr int64_t kColBlock = 256;  // columns of a work item: 16 panels

template <typename W>
W Narrow(float v);
template <>
inline float Narrow<float>(float v) {
  return v;
}
template <>
inline bf16 Narrow<bf16>(float v) {
  return hotswap::ToBf16(v);
}

struct Leaf {
  const void* w;
  const float* a;
  const float* b;
  void* out;
  int64_t M, N, R;
  bool bf16;
};

// Rows [m0, m1) x columns [n0, n1) of a leaf, one value at a time (the fallback, and the
// ragged edges of the vector path).
template <typename W>
void BlockScalar(const Leaf& L, float scale, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const W* w = static_cast<const W*>(L.w);
  W* out = static_cast<W*>(L.out);
  std::vector<float> acc(n1 - n0);
  for (int64_t m = m0; m < m1; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < L.R; ++k) {
      const float av = L.a[m * L.R + k];
      const float* bk = L.b + k * L.N;
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) acc[n - n0] += av * bk[n];
    }
    for (int64_t n = n0; n < n1; ++n)
      out[m * L.N + n] = Narrow<W>(std::fma(scale, acc[n - n0], Widen(w[m * L.N + n])));
  }
}

#if HOTSWAP_LORA_AVX2
inline void Load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void Load16(const bf16* p, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)), 16));
}
inline void Store16(float* p, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
}
// 8 f32 -> their bf16 bits in the low halves of 8 int32 lanes (Narrow<bf16>, vectorised).
inline __m256i Round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(nan));
}
inline void Store16(bf16* p, __m256 lo, __m256 hi) {
  // packus works within 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7], put back in order by 64-bit quarters.
  const __m256i packed = _mm256_packus_epi32(Round8(lo), Round8(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

// out[m0:m0+MR, n:n+16] = w + scale * a[m0:m0+MR, :] @ b[:, n:n+16], the sum in registers.
// `panel`: b[:, n:n+16] packed, [r, 16] contiguous. The accumulators are named variables, not
// an array: GCC kept an array of __m256 on the stack and stored all 12 every k step.
template <int MR, typename W>
inline void Tile(const Leaf& L, const float* panel, __m256 scale, int64_t m0, int64_t n) {
  const int64_t R = L.R, N = L.N;
  const W* w = static_cast<const W*>(L.w) + m0 * N + n;
  W* out = static_cast<W*>(L.out) + m0 * N + n;
  // The tile's w lines are fetched while its FMAs run (~400 cycles at rank 64).
  for (int i = 0; i < MR; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i * N), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + i * N + kNR) - 1, _MM_HINT_T0);
  }
  const float* a = L.a + m0 * R;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < R; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kNR), b1 = _mm256_loadu_ps(panel + k * kNR + 8);
#define HOTSWAP_ROW(i)                                       \
  if constexpr (MR > i) {                                    \
    const __m256 av = _mm256_broadcast_ss(a + i * R + k);    \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);              \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);              \
  }
    HOTSWAP_ROW(0) HOTSWAP_ROW(1) HOTSWAP_ROW(2) HOTSWAP_ROW(3) HOTSWAP_ROW(4) HOTSWAP_ROW(5)
#undef HOTSWAP_ROW
  }
  const __m256 acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < MR; ++i) {
    __m256 w0, w1;
    Load16(w + i * N, w0, w1);
    Store16(out + i * N, _mm256_fmadd_ps(scale, acc[i][0], w0), _mm256_fmadd_ps(scale, acc[i][1], w1));
  }
}

// b's rows are N floats apart, often a multiple of 4 KB (2,048 columns: 8 KB): read in place,
// a panel's r lines would fall in a few L1 sets and evict each other. Each item packs its
// columns' panels first ([panel][r][16], 64 KB at rank 64 and 256 columns: L2), so a tile reads
// one contiguous 4 KB panel.
template <typename W>
void Block(const Leaf& L, float scale, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  thread_local std::vector<float> packed;
  const __m256 s = _mm256_set1_ps(scale);
  const int64_t panels = (n1 - n0) / kNR, n16 = n0 + panels * kNR;
  const int64_t mt = m0 + (m1 - m0) / kMR * kMR;
  packed.resize(std::max<int64_t>(panels * L.R * kNR, 1));
  for (int64_t k = 0; k < L.R; ++k)
    for (int64_t p = 0; p < panels; ++p)
      std::memcpy(packed.data() + (p * L.R + k) * kNR, L.b + k * L.N + n0 + p * kNR, kNR * sizeof(float));
  for (int64_t p = 0; p < panels; ++p) {
    const float* panel = packed.data() + p * L.R * kNR;
    const int64_t n = n0 + p * kNR;
    for (int64_t m = m0; m < mt; m += kMR) Tile<kMR, W>(L, panel, s, m, n);
    switch (m1 - mt) {  // the rows left over, in one narrower tile
      case 1: Tile<1, W>(L, panel, s, mt, n); break;
      case 2: Tile<2, W>(L, panel, s, mt, n); break;
      case 3: Tile<3, W>(L, panel, s, mt, n); break;
      case 4: Tile<4, W>(L, panel, s, mt, n); break;
      case 5: Tile<5, W>(L, panel, s, mt, n); break;
      default: break;
    }
  }
  if (n16 < n1) BlockScalar<W>(L, scale, m0, m1, n16, n1);  // fewer than 16 columns left
}
#else
template <typename W>
void Block(const Leaf& L, float scale, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  BlockScalar<W>(L, scale, m0, m1, n0, n1);
}
#endif

ffi::Error LoraMerge(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, float scale) {
  using T = ffi::DataType;
  if (args.size() == 0 || args.size() != 3 * rets.size()) {
    return ffi::Error::InvalidArgument("hotswap lora_merge: need (w, a, b) per leaf and one result each");
  }
  std::vector<Leaf> leaves;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto w = args.get<ffi::AnyBuffer>(3 * i);
    auto a = args.get<ffi::Buffer<ffi::F32>>(3 * i + 1);
    auto b = args.get<ffi::Buffer<ffi::F32>>(3 * i + 2);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !a.has_value() || !b.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("hotswap lora_merge: w f32 or bf16, a and b f32");
    }
    const T dt = w->element_type();
    if ((dt != T::F32 && dt != T::BF16) || (*out)->element_type() != dt) {
      return ffi::Error::InvalidArgument("hotswap lora_merge: w f32 or bf16, and the result of w's dtype");
    }
    const auto wd = w->dimensions(), ad = a->dimensions(), bd = b->dimensions(), od = (*out)->dimensions();
    if (wd.size() != 2 || ad.size() != 2 || bd.size() != 2 || od.size() != 2 || ad[0] != wd[0] ||
        bd[1] != wd[1] || ad[1] != bd[0] || od[0] != wd[0] || od[1] != wd[1]) {
      return ffi::Error::InvalidArgument("hotswap lora_merge: need w [M, N], a [M, r], b [r, N], out [M, N]");
    }
    leaves.push_back({w->untyped_data(), a->typed_data(), b->typed_data(), (*out)->untyped_data(), wd[0], wd[1],
                      ad[1], dt == T::BF16});
  }
  struct Item {
    int32_t leaf;
    int64_t m0, n0;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < leaves.size(); ++i)
    for (int64_t m = 0; m < leaves[i].M; m += kRowBlock)
      for (int64_t n = 0; n < leaves[i].N; n += kColBlock) items.push_back({static_cast<int32_t>(i), m, n});
  hotswap::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    const Leaf& L = leaves[it.leaf];
    const int64_t m1 = std::min(L.M, it.m0 + kRowBlock), n1 = std::min(L.N, it.n0 + kColBlock);
    if (L.bf16) {
      Block<bf16>(L, scale, it.m0, m1, it.n0, n1);
    } else {
      Block<float>(L, scale, it.m0, m1, it.n0, n1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapLoraMerge, LoraMerge,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()  // (w, a, b) per leaf
                                  .RemainingRets()  // out per leaf
                                  .Attr<float>("scale"));
