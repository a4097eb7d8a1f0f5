// Paged attention for XLA:CPU, as an XLA FFI custom call (hotswap/kernels/cpu_attention.py).
//
// Why C++: on XLA:CPU the jnp attention gathers every page a row reads into a fresh
// buffer and then runs many tiny batched dots; at batch 32 that was about 55 ms of an
// 85 ms decode step on bench-100m. Here each row reads its keys straight from the pages
// through the block table, a page at a time for all its kv heads, once, with an online
// softmax: no gather, no temporaries, and the rows are spread over XLA's own intra-op
// thread pool. (A pool of our own spinning threads measured 5-10% slower in the same
// process: it competed with XLA's threads for the two cores.)
//
// Semantics are those of reference.prefill_attention / decode_attention: the pages hold
// the cache as it was *before* the step (read only), and the step's own K/V come in
// k_new / v_new. Row b's chunk starts at chunk_starts[b]; a query at position `pos`
// sees the cached keys [0, chunk_start) through block_tables[b] and the chunk's own
// keys at positions chunk_start..pos, which sit end to end in the flattened [B*C] step
// (a packed prefill lays a chunk's rows out consecutively; a decode row is its own chunk).
// A query with pos >= kv_lens[b] is padding: its output is zero. Slots no query may read
// are never touched, so whatever they hold (NaN included) cannot leak into a result.
//
// Shapes: q [B, C, Hq, hd]; pages [NP, ps, 2*Hkv, hd] (K of head h at 2h, V at 2h+1);
// k_new, v_new [B, C, Hkv, hd]; block_tables int32 [B, P]; positions int32 [B, C];
// chunk_starts, kv_lens int32 [B]; out [B, C, Hq, hd]. f32 or bf16 activations and pages.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec_exp.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// A row of n values as f32: f32 data is read in place, bf16 is widened into `tmp`.
inline const float* as_f32(const float* src, float*, int) { return src; }
inline const float* as_f32(const uint16_t* src, float* tmp, int n) {
  for (int i = 0; i < n; ++i) tmp[i] = bf16_to_f32(src[i]);
  return tmp;
}
inline void store(float* dst, const float* src, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store(uint16_t* dst, const float* src, int n) {
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

#if defined(__AVX512F__)
// One head's online-softmax step over n <= 16 keys (f32 rows kstride apart), HD = 64 or 128.
// The generic loops below spend most of their time in one dependent FMA chain and one
// horizontal sum per dot product; here two chains per dot overlap across keys, the block's
// scores sit in one vector for max / exp / sum, and the head's output stays in registers.
template <int HD>
inline void Fold16(const float* qg, const float* kb, const float* vb, int64_t kstride, int n, float& m, float& l,
                   float* acc) {
  alignas(64) float s[16];
  for (int j = 0; j < n; ++j) {
    const float* kj = kb + j * kstride;
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kj));
    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(qg + 16), _mm512_loadu_ps(kj + 16));
    for (int c = 32; c < HD; c += 32) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c), _mm512_loadu_ps(kj + c), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c + 16), _mm512_loadu_ps(kj + c + 16), a1);
    }
    s[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
  const __mmask16 live = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, s);
  const float mx = std::max(m, _mm512_reduce_max_ps(sv));
  const __m512 pv = _mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
  _mm512_store_ps(s, pv);
  const float corr = ExpNonPositive(m - mx);  // m = -inf before the first block: 0
  l = l * corr + _mm512_reduce_add_ps(pv);
  m = mx;
  __m512 o[HD / 16];
  const __m512 cv = _mm512_set1_ps(corr);
  for (int c = 0; c < HD / 16; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), cv);
  for (int j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(s[j]);
    const float* vj = vb + j * kstride;
    for (int c = 0; c < HD / 16; ++c) o[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * c), o[c]);
  }
  for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}
#endif

struct Shape {
  int64_t b, c, hq, hkv, hd, num_pages, ps, p;
  float scale;
};

// Online-softmax step over n keys (f32 rows kstride apart) for one q head: the vector path
// for head_dim 64 / 128, plain loops otherwise. `sc` is scratch of at least n floats.
inline void Fold(int64_t hd, const float* qg, const float* kb, const float* vb, int64_t kstride, int64_t n,
                 float& m, float& l, float* acc, float* sc) {
#if defined(__AVX512F__)
  if (hd == 64 || hd == 128) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int nj = static_cast<int>(std::min<int64_t>(16, n - j0));
      if (hd == 64) {
        Fold16<64>(qg, kb + j0 * kstride, vb + j0 * kstride, kstride, nj, m, l, acc);
      } else {
        Fold16<128>(qg, kb + j0 * kstride, vb + j0 * kstride, kstride, nj, m, l, acc);
      }
    }
    return;
  }
#endif
  float mx = m;
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = kb + j * kstride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < hd; ++d) dot += qg[d] * kj[d];
    sc[j] = dot;
    mx = std::max(mx, dot);
  }
  const float corr = ExpNonPositive(m - mx);  // m = -inf before the first block: 0
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = ExpNonPositive(sc[j] - mx);
    sum += sc[j];
  }
#pragma omp simd
  for (int64_t d = 0; d < hd; ++d) acc[d] *= corr;
  for (int64_t j = 0; j < n; ++j) {
    const float p = sc[j];
    const float* vj = vb + j * kstride;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) acc[d] += p * vj[d];
  }
  m = mx;
  l = l * corr + sum;
}

// One work item: every query of row b, for kv heads [h0, h1) and their G q heads each.
// Keys go a page at a time (then the chunk's own keys, up to ps at a time), and within a
// block every kv head of the item in turn: a slot's K/V for all heads is one contiguous
// record, so a row's pages stream through once instead of once per kv head (one item
// per kv head read them 4x and ran at a third of the speed on bench-100m).
template <typename A, typename K>
bool RowHeads(const Shape& s, int64_t b, int64_t h0, int64_t h1, const A* q, const K* pages, const A* k_new,
              const A* v_new, const int32_t* block_tables, const int32_t* positions, const int32_t* chunk_starts,
              const int32_t* kv_lens, A* out) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd, ps = s.ps, nh = (h1 - h0) * g_n;
  const int64_t kv_len = kv_lens[b], start = chunk_starts[b];
  std::vector<float> qv(nh * hd), acc(nh * hd), m(nh), l(nh), sc(ps), row(hd);
  std::vector<float> kt(ps * hd), vt(ps * hd), tmp(hd);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  bool ok = true;
  // Fold n keys of kv head `kvh` (rows kstride apart, in f32 or not) into its q heads.
  auto fold = [&](int64_t kvh, int64_t n, const auto* kb, const auto* vb, int64_t kstride) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kb)>>;
    const float *kf, *vf;
    int64_t stride = kstride;
    if constexpr (std::is_same_v<T, float>) {
      kf = kb, vf = vb;
    } else {  // widen the block once for all G heads
      for (int64_t j = 0; j < n; ++j) {
        as_f32(kb + j * kstride, kt.data() + j * hd, hd);
        as_f32(vb + j * kstride, vt.data() + j * hd, hd);
      }
      kf = kt.data(), vf = vt.data(), stride = hd;
    }
    for (int64_t g = 0; g < g_n; ++g) {
      const int64_t i = (kvh - h0) * g_n + g;
      Fold(hd, qv.data() + i * hd, kf, vf, stride, n, m[i], l[i], acc.data() + i * hd, sc.data());
    }
  };
  for (int64_t c = 0; c < s.c; ++c) {
    const int64_t i = b * s.c + c;  // flat query index in the step
    const int64_t pos = positions[i];
    A* o = out + (i * s.hq + h0 * g_n) * hd;
    const bool real = pos < kv_len && pos >= start && start >= 0 && i - (pos - start) >= 0 &&
                      (start + s.ps - 1) / s.ps <= s.p;
    if (!real) {
      if (!(pos >= kv_len)) ok = false;  // a real query whose chunk does not fit the inputs
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t h = 0; h < nh; ++h) store(o + h * hd, row.data(), hd);
      continue;
    }
    for (int64_t h = 0; h < nh; ++h) {
      const float* src = as_f32(q + (i * s.hq + h0 * g_n + h) * hd, tmp.data(), hd);
      for (int64_t d = 0; d < hd; ++d) qv[h * hd + d] = src[d] * s.scale;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), neg_inf);
    std::fill(l.begin(), l.end(), 0.0f);
    // Cached keys [0, start), a page at a time through the block table.
    const int32_t* table = block_tables + b * s.p;
    const int64_t slot = 2 * s.hkv * hd;  // one slot's K/V record for every head
    for (int64_t j0 = 0; j0 < start && ok; j0 += ps) {
      const int64_t page = table[j0 / ps];
      if (page < 0 || page >= s.num_pages) {
        ok = false;
        break;
      }
      const int64_t n = std::min(ps, start - j0);
      // Pages sit anywhere in the pool, so the hardware prefetcher restarts at each one:
      // ask for the next page's part of this item while this one is folded in.
      const int64_t next = j0 + ps < start ? table[(j0 + ps) / ps] : -1;
      for (int64_t kvh = h0; kvh < h1; ++kvh) {
        const K* base = pages + page * ps * slot + 2 * kvh * hd;
        if (next > 0 && next < s.num_pages) {
          const char* nb = reinterpret_cast<const char*>(pages + next * ps * slot + 2 * kvh * hd);
          const int64_t bytes = 2 * hd * sizeof(K);
          for (int64_t j = 0; j < ps; ++j) {
            for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(nb + j * slot * sizeof(K) + off);
          }
        }
        fold(kvh, n, base, base + hd, slot);
      }
    }
    // The chunk's own keys: flat indices first..i, positions start..pos.
    const int64_t first = i - (pos - start);
    for (int64_t j0 = first; j0 <= i; j0 += ps) {
      const int64_t n = std::min(ps, i - j0 + 1);
      for (int64_t kvh = h0; kvh < h1; ++kvh) {
        fold(kvh, n, k_new + (j0 * s.hkv + kvh) * hd, v_new + (j0 * s.hkv + kvh) * hd, s.hkv * hd);
      }
    }
    for (int64_t h = 0; h < nh; ++h) {
      const float inv = 1.0f / std::max(l[h], 1e-30f);
      for (int64_t d = 0; d < hd; ++d) row[d] = acc[h * hd + d] * inv;
      store(o + h * hd, row.data(), hd);
    }
  }
  return ok;
}

template <typename A, typename K>
ffi::Error Run(ffi::ThreadPool pool, const Shape& s, const void* q, const void* pages,
               const void* k_new, const void* v_new, const int32_t* bt, const int32_t* pos,
               const int32_t* cs, const int32_t* kl, void* out) {
  // Rows x chunks of kv heads: whole rows when there are enough to share out, else a row's
  // heads split so that a batch-1 step still uses every thread.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t chunks = std::clamp<int64_t>((2 * threads + s.b - 1) / s.b, 1, s.hkv);
  std::atomic<bool> ok{true};
  hotswap::ParallelFor(pool, s.b * chunks, [&](int64_t it) {
    const int64_t b = it / chunks, c = it % chunks;
    if (!RowHeads<A, K>(s, b, s.hkv * c / chunks, s.hkv * (c + 1) / chunks, static_cast<const A*>(q),
                        static_cast<const K*>(pages), static_cast<const A*>(k_new), static_cast<const A*>(v_new),
                        bt, pos, cs, kl, static_cast<A*>(out))) {
      ok = false;
    }
  });
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "hotswap paged attention: a block table names a page outside the cache, or a chunk "
        "does not fit its row's table or the step");
  }
  return ffi::Error::Success();
}

// Calls f(A{}, K{}) with the C++ types of the activation and page dtypes (float for f32,
// uint16_t for bf16); nullopt when either is another dtype.
template <typename F>
auto WithDtypes(ffi::DataType at, ffi::DataType kt, F&& f) -> std::optional<decltype(f(float{}, float{}))> {
  using D = ffi::DataType;
  if (at == D::F32 && kt == D::F32) return f(float{}, float{});
  if (at == D::F32 && kt == D::BF16) return f(float{}, uint16_t{});
  if (at == D::BF16 && kt == D::F32) return f(uint16_t{}, float{});
  if (at == D::BF16 && kt == D::BF16) return f(uint16_t{}, uint16_t{});
  return std::nullopt;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer pages, ffi::AnyBuffer k_new,
                          ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> chunk_starts,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Result<ffi::AnyBuffer> out, float scale) {
  auto qd = q.dimensions(), pd = pages.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("hotswap paged attention: q and pages must be 4-D, tables 2-D");
  }
  Shape s{qd[0], qd[1], qd[2], pd[2] / 2, qd[3], pd[0], pd[1], td[1], scale};
  if (pd[3] != s.hd || s.hkv == 0 || s.hq % s.hkv != 0 || td[0] != s.b) {
    return ffi::Error::InvalidArgument("hotswap paged attention: q, pages and tables disagree on shape");
  }
  const void* args[] = {q.untyped_data(), pages.untyped_data(), k_new.untyped_data(), v_new.untyped_data()};
  const int32_t* ints[] = {block_tables.typed_data(), positions.typed_data(), chunk_starts.typed_data(),
                           kv_lens.typed_data()};
  void* o = out->untyped_data();
  auto run = WithDtypes(q.element_type(), pages.element_type(), [&](auto a, auto k) {
    return Run<decltype(a), decltype(k)>(pool, s, args[0], args[1], args[2], args[3], ints[0], ints[1], ints[2],
                                         ints[3], o);
  });
  if (run) return *run;
  return ffi::Error::InvalidArgument("hotswap paged attention: activations and pages must be f32 or bf16");
}


// The step's K/V into their slots (flat page * page_size + offset; padding tokens name slot 0
// in the null page), converted to the page dtype with round-to-nearest-even as XLA's convert
// does. Runs after every row's attention has read the pages: read-then-write, as the jnp
// reference steps are.
template <typename A, typename K>
bool WriteKV(const Shape& s, const A* k_new, const A* v_new, const int32_t* slots, K* pages) {
  const int64_t tokens = s.b * s.c, record = 2 * s.hkv * s.hd;
  std::vector<float> tmp(s.hd);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= s.num_pages * s.ps) return false;
    for (int64_t h = 0; h < s.hkv; ++h) {
      const int64_t src = (t * s.hkv + h) * s.hd;
      for (int part = 0; part < 2; ++part) {
        const A* from = (part == 0 ? k_new : v_new) + src;
        K* to = pages + slot * record + (2 * h + part) * s.hd;
        if constexpr (std::is_same_v<A, K>) {
          std::memcpy(to, from, s.hd * sizeof(K));
        } else {
          store(to, as_f32(from, tmp.data(), static_cast<int>(s.hd)), static_cast<int>(s.hd));
        }
      }
    }
  }
  return true;
}

// Attention as PagedAttention, then the step's K/V written into the same page buffer, which
// XLA aliases to the output (input_output_aliases, pages donated by the step): one custom
// call instead of a forward call plus a separate donated write call per step.
ffi::Error PagedAttentionWrite(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer pages, ffi::AnyBuffer k_new,
                               ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> block_tables,
                               ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> chunk_starts,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> slots,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> pages_out, float scale) {
  if (pages_out->untyped_data() != pages.untyped_data()) {
    return ffi::Error::InvalidArgument("hotswap paged attention: the page output must alias the page input");
  }
  auto qd = q.dimensions();
  if (qd.size() != 4 || static_cast<int64_t>(slots.element_count()) != qd[0] * qd[1]) {
    return ffi::Error::InvalidArgument("hotswap paged attention: slots must hold one entry per query token");
  }
  ffi::Error err = PagedAttention(pool, q, pages, k_new, v_new, block_tables, positions, chunk_starts, kv_lens, out, scale);
  if (err.failure()) return err;  // shapes and dtypes are checked there
  auto pd = pages.dimensions();
  Shape s{qd[0], qd[1], qd[2], pd[2] / 2, qd[3], pd[0], pd[1], block_tables.dimensions()[1], scale};
  const bool ok = *WithDtypes(q.element_type(), pages.element_type(), [&](auto a, auto k) {
    using A = decltype(a);
    using K = decltype(k);
    return WriteKV(s, static_cast<const A*>(k_new.untyped_data()), static_cast<const A*>(v_new.untyped_data()),
                   slots.typed_data(), static_cast<K*>(pages_out->untyped_data()));
  });
  if (!ok) return ffi::Error::InvalidArgument("hotswap paged attention: a KV slot lies outside the cache");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // pages
                                  .Arg<ffi::AnyBuffer>()         // k_new
                                  .Arg<ffi::AnyBuffer>()         // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // chunk_starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotswapPagedAttentionWrite, PagedAttentionWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // pages (aliased to pages_out)
                                  .Arg<ffi::AnyBuffer>()         // k_new
                                  .Arg<ffi::AnyBuffer>()         // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // chunk_starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::AnyBuffer>()         // pages_out
                                  .Attr<float>("scale"));
