// Paged attention for XLA:CPU, as an XLA FFI custom call (hotswap/kernels/cpu_attention.py).
//
// Why C++: on XLA:CPU the jnp attention gathers every page a row reads into a fresh
// buffer and then runs many tiny batched dots; at batch 32 that was about 55 ms of an
// 85 ms decode step on bench-100m. Here each (row, kv head) reads its keys straight from
// the pages through the block table, once, with an online softmax: no gather, no
// temporaries, and the work is spread over XLA's own intra-op thread pool.
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
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

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

struct Shape {
  int64_t b, c, hq, hkv, hd, num_pages, ps, p;
  float scale;
};

// One (row, kv head) work item: every query of the row, for the G q heads of that kv head.
// Keys are taken a block at a time (a page of cached keys, then the chunk's own keys in
// blocks of up to `ps`): scores for the block, one rescale of the running sums per block.
template <typename A, typename K>
bool RowHead(const Shape& s, int64_t b, int64_t kvh, const A* q, const K* pages, const A* k_new,
             const A* v_new, const int32_t* block_tables, const int32_t* positions,
             const int32_t* chunk_starts, const int32_t* kv_lens, A* out) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd, ps = s.ps;
  const int64_t kv_len = kv_lens[b], start = chunk_starts[b];
  std::vector<float> qv(g_n * hd), acc(g_n * hd), m(g_n), l(g_n), sc(g_n * ps), row(hd);
  std::vector<float> kt(ps * hd), vt(ps * hd), tmp(hd);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  bool ok = true;
  for (int64_t c = 0; c < s.c; ++c) {
    const int64_t i = b * s.c + c;  // flat query index in the step
    const int64_t pos = positions[i];
    A* o = out + (i * s.hq + kvh * g_n) * hd;
    const bool real = pos < kv_len && pos >= start && start >= 0 && i - (pos - start) >= 0 &&
                      (start + s.ps - 1) / s.ps <= s.p;
    if (!real) {
      if (!(pos >= kv_len)) ok = false;  // a real query whose chunk does not fit the inputs
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t g = 0; g < g_n; ++g) store(o + g * hd, row.data(), hd);
      continue;
    }
    for (int64_t g = 0; g < g_n; ++g) {
      const float* src = as_f32(q + (i * s.hq + kvh * g_n + g) * hd, tmp.data(), hd);
      for (int64_t d = 0; d < hd; ++d) qv[g * hd + d] = src[d] * s.scale;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), neg_inf);
    std::fill(l.begin(), l.end(), 0.0f);
    // Fold a block of n keys (rows of kb / vb, hd apart) into the running softmax.
    auto block = [&](int64_t n, const float* kb, const float* vb, int64_t kstride) {
      for (int64_t g = 0; g < g_n; ++g) {
        const float* qg = qv.data() + g * hd;
        float* sg = sc.data() + g * ps;
        float mx = m[g];
        for (int64_t j = 0; j < n; ++j) {
          const float* kj = kb + j * kstride;
          float dot = 0.0f;
          for (int64_t d = 0; d < hd; ++d) dot += qg[d] * kj[d];
          sg[j] = dot;
          mx = std::max(mx, dot);
        }
        const float corr = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first block
        float* ag = acc.data() + g * hd;
        float sum = l[g] * corr;
        for (int64_t d = 0; d < hd; ++d) ag[d] *= corr;
        for (int64_t j = 0; j < n; ++j) {
          const float p = std::exp(sg[j] - mx);
          sum += p;
          const float* vj = vb + j * kstride;
          for (int64_t d = 0; d < hd; ++d) ag[d] += p * vj[d];
        }
        m[g] = mx;
        l[g] = sum;
      }
    };
    // Cached keys [0, start), a page at a time through the block table.
    const int32_t* table = block_tables + b * s.p;
    for (int64_t j0 = 0; j0 < start; j0 += ps) {
      const int64_t page = table[j0 / ps];
      if (page < 0 || page >= s.num_pages) {
        ok = false;
        break;
      }
      const int64_t n = std::min(ps, start - j0);
      const K* base = pages + ((page * ps) * 2 * s.hkv + 2 * kvh) * hd;
      const int64_t stride = 2 * s.hkv * hd;  // next slot of the same head
      if constexpr (std::is_same_v<K, float>) {
        block(n, base, base + hd, stride);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          as_f32(base + j * stride, kt.data() + j * hd, hd);
          as_f32(base + j * stride + hd, vt.data() + j * hd, hd);
        }
        block(n, kt.data(), vt.data(), hd);
      }
    }
    // The chunk's own keys: flat indices first..i, positions start..pos.
    const int64_t first = i - (pos - start);
    for (int64_t j0 = first; j0 <= i; j0 += ps) {
      const int64_t n = std::min(ps, i - j0 + 1);
      const int64_t stride = s.hkv * hd;
      const A* kb = k_new + (j0 * s.hkv + kvh) * hd;
      const A* vb = v_new + (j0 * s.hkv + kvh) * hd;
      if constexpr (std::is_same_v<A, float>) {
        block(n, kb, vb, stride);
      } else {
        for (int64_t j = 0; j < n; ++j) {
          as_f32(kb + j * stride, kt.data() + j * hd, hd);
          as_f32(vb + j * stride, vt.data() + j * hd, hd);
        }
        block(n, kt.data(), vt.data(), hd);
      }
    }
    for (int64_t g = 0; g < g_n; ++g) {
      const float inv = 1.0f / std::max(l[g], 1e-30f);
      for (int64_t d = 0; d < hd; ++d) row[d] = acc[g * hd + d] * inv;
      store(o + g * hd, row.data(), hd);
    }
  }
  return ok;
}

// Work items are claimed from a shared counter by the calling thread and by helpers on
// XLA's intra-op pool. The caller never waits for a helper that has not started (it may
// never get a thread while the caller holds one): it waits only for items already claimed.
// The state lives on the heap so a helper that starts after the call returned finds the
// counter exhausted and touches nothing else.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> ok{true};
};

template <typename A, typename K>
ffi::Error Run(ffi::ThreadPool pool, const Shape& s, const void* q, const void* pages,
               const void* k_new, const void* v_new, const int32_t* bt, const int32_t* pos,
               const int32_t* cs, const int32_t* kl, void* out) {
  const int64_t items = s.b * s.hkv;
  auto work = std::make_shared<Work>();
  auto task = [=](Work& w) {
    for (int64_t it; (it = w.next.fetch_add(1)) < items;) {
      const bool ok = RowHead<A, K>(s, it / s.hkv, it % s.hkv, static_cast<const A*>(q),
                                    static_cast<const K*>(pages), static_cast<const A*>(k_new),
                                    static_cast<const A*>(v_new), bt, pos, cs, kl, static_cast<A*>(out));
      if (!ok) w.ok = false;
      w.done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work, task] { task(*work); });
  task(*work);
  while (work->done.load() < items) std::this_thread::yield();
  if (!work->ok) {
    return ffi::Error::InvalidArgument(
        "hotswap paged attention: a block table names a page outside the cache, or a chunk "
        "does not fit its row's table or the step");
  }
  return ffi::Error::Success();
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
  const auto at = q.element_type(), kt = pages.element_type();
  const void* args[] = {q.untyped_data(), pages.untyped_data(), k_new.untyped_data(), v_new.untyped_data()};
  const int32_t* ints[] = {block_tables.typed_data(), positions.typed_data(), chunk_starts.typed_data(),
                           kv_lens.typed_data()};
  void* o = out->untyped_data();
#define HOTSWAP_RUN(A, K) \
  Run<A, K>(pool, s, args[0], args[1], args[2], args[3], ints[0], ints[1], ints[2], ints[3], o)
  if (at == ffi::DataType::F32 && kt == ffi::DataType::F32) return HOTSWAP_RUN(float, float);
  if (at == ffi::DataType::F32 && kt == ffi::DataType::BF16) return HOTSWAP_RUN(float, uint16_t);
  if (at == ffi::DataType::BF16 && kt == ffi::DataType::F32) return HOTSWAP_RUN(uint16_t, float);
  if (at == ffi::DataType::BF16 && kt == ffi::DataType::BF16) return HOTSWAP_RUN(uint16_t, uint16_t);
#undef HOTSWAP_RUN
  return ffi::Error::InvalidArgument("hotswap paged attention: activations and pages must be f32 or bf16");
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
