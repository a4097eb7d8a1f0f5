// Paged attention for XLA:CPU, as an XLA FFI custom call (hotswap/kernels/cpu_attention.py).
//
// Why C++: on XLA:CPU the jnp attention gathers every page a row reads into a fresh
// buffer and then runs many tiny batched dots, which at long contexts and large batches
// were most of a decode step. Here each row reads its keys straight from the pages
// through the block table, a page at a time for all its kv heads, once, with an online
// softmax: no gather, no temporaries, and the work is spread over XLA's own intra-op
// thread pool (a pool of our own would compete with XLA's threads for the same cores).
// Consecutive queries of a prefill chunk share each block of keys while it is in L1
// (`QueryRun`), and the q heads of a kv head share each K and V vector loaded (`Fold16`): one head at a time would load a K
// or V vector per FMA and be bound by the load ports. Decode reads each row's pages once
// either way.
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
// Sliding window and softcap (attributes; 0 = none), as reference.py: a query at `pos` sees
// only keys p > pos - window, and a work item starts at the page (or key block) holding the
// first key any of its queries sees: pages wholly before the window are never read, nor their
// table entries looked at. Scores s (q.k * scale) become softcap * tanh(s / softcap).
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

#include "attention_fold.h"
#include "parallel.h"
#include "vec_exp.h"
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
// n values into f32 at dst, copied or widened.
inline void load(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
inline void store(float* dst, const float* src, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store(uint16_t* dst, const float* src, int n) {
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}


struct Shape {
  int64_t b, c, hq, hkv, hd, num_pages, ps, p;
  float scale;
  int64_t window;  // sliding window in keys (the query's own included); 0: none
  float softcap;   // 0: none
};

// The first key a query at `pos` sees: 0, or the start of its window.
inline int64_t WindowStart(const Shape& s, int64_t pos) {
  return s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
}

// A run of consecutive queries of one chunk (flat indices i0 .. i0 + n - 1): their positions
// follow one another and they read the same pages, so a work item folds each block of keys
// into all of them while it is in L1. A query alone per item re-read every key it sees from
// L2 or L3, hundreds of MB of K/V a layer for a 512-token chunk. Runs are up to 8 queries:
// shorter ones re-read more, longer ones gained nothing (docs/en/benchmarks.md).
struct QueryRun {
  int64_t i0, n;
  bool real;  // false: a run of one query that may read nothing (see Real)
};
constexpr int64_t kRunQueries = 8;  // queries a run holds at most (their state: 8 x G x hd floats a head)

// Whether flat query i may read anything: inside its row's kv length, its chunk's own keys
// inside the step, and the chunk start covered by the block table. A query past kv_len is
// padding (zeros out); any other query that fails this makes the call an error.
inline bool Real(const Shape& s, int64_t i, const int32_t* positions, const int32_t* chunk_starts,
                 const int32_t* kv_lens) {
  const int64_t b = i / s.c, pos = positions[i], start = chunk_starts[b];
  return pos < kv_lens[b] && pos >= start && start >= 0 && i - (pos - start) >= 0 &&
         (start + s.ps - 1) / s.ps <= s.p;
}

// Splits the step's B*C queries into runs: query i joins the run of i - 1 when both are real,
// share a chunk start and the block table's pages before it, and i's position is one more.
std::vector<QueryRun> Runs(const Shape& s, const int32_t* block_tables, const int32_t* positions,
                           const int32_t* chunk_starts, const int32_t* kv_lens) {
  std::vector<QueryRun> runs;
  bool prev_real = false;
  for (int64_t i = 0; i < s.b * s.c; ++i) {
    const bool real = Real(s, i, positions, chunk_starts, kv_lens);
    bool join = real && prev_real && runs.back().n < kRunQueries && positions[i] == positions[i - 1] + 1;
    if (join) {
      const int64_t b = i / s.c, a = (i - 1) / s.c, start = chunk_starts[b];
      join = start == chunk_starts[a] &&
             (a == b || std::equal(block_tables + a * s.p, block_tables + a * s.p + (start + s.ps - 1) / s.ps,
                                   block_tables + b * s.p));
    }
    if (join) {
      ++runs.back().n;
    } else {
      runs.push_back({i, 1, real});
    }
    prev_real = real;
  }
  return runs;
}

// A padding run's output rows (its q heads of kv heads [h0, h1)): zeros.
template <typename A>
void ZeroRun(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, A* out) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd;
  const std::vector<float> row(hd, 0.0f);
  for (int64_t h = 0; h < (h1 - h0) * g_n; ++h) store(out + (r.i0 * s.hq + h0 * g_n + h) * hd, row.data(), hd);
}

// The run's queries (its q heads of kv heads [h0, h1)) scaled, as f32 [query][head][hd].
template <typename A>
std::vector<float> ScaledQueries(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, const A* q) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd, nh = (h1 - h0) * g_n;
  std::vector<float> qv(r.n * nh * hd), tmp(hd);
  for (int64_t j = 0; j < r.n; ++j) {
    for (int64_t h = 0; h < nh; ++h) {
      const float* src = as_f32(q + ((r.i0 + j) * s.hq + h0 * g_n + h) * hd, tmp.data(), hd);
      for (int64_t d = 0; d < hd; ++d) qv[(j * nh + h) * hd + d] = src[d] * s.scale;
    }
  }
  return qv;
}

// Each query head's output: its accumulated values over its softmax sum, in the output's dtype.
template <typename A>
void StoreRun(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, const std::vector<float>& acc,
              const std::vector<float>& l, A* out) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd, nh = (h1 - h0) * g_n;
  std::vector<float> row(hd);
  for (int64_t j = 0; j < r.n; ++j) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t i = j * nh + h;
      const float inv = 1.0f / std::max(l[i], 1e-30f);
      for (int64_t d = 0; d < hd; ++d) row[d] = acc[i * hd + d] * inv;
      store(out + ((r.i0 + j) * s.hq + h0 * g_n + h) * hd, row.data(), hd);
    }
  }
}

// One work item: the queries of run r, for kv heads [h0, h1) and their G q heads each. Keys
// go a page at a time (then the chunk's own keys, up to ps at a time), and within a block
// every kv head of the item in turn, and within a head every query of the run: a slot's K/V
// for all heads is one contiguous record, so the run's pages stream through once instead of
// once per kv head and query.
template <typename A, typename K>
bool RunHeads(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, const A* q, const K* pages, const A* k_new,
              const A* v_new, const int32_t* block_tables, const int32_t* positions, const int32_t* chunk_starts,
              const int32_t* kv_lens, A* out) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd, ps = s.ps, nh = (h1 - h0) * g_n, nq = r.n;
  const int64_t b = r.i0 / s.c, start = chunk_starts[b];
  if (!r.real) {
    ZeroRun(s, r, h0, h1, out);
    return positions[r.i0] >= kv_lens[b];  // padding, or a real query whose chunk does not fit
  }
  std::vector<float> acc(nq * nh * hd, 0.0f), m(nq * nh), l(nq * nh, 0.0f), sc(ps);
  std::vector<float> kt(ps * hd), vt(ps * hd);
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  const std::vector<float> qv = ScaledQueries(s, r, h0, h1, q);
  // Fold n keys of kv head `kvh` (rows kstride apart, in f32 or not) into its q heads of the
  // run's queries, query j taking keys [from_of(j), n_of(j)) of them.
  auto fold = [&](int64_t kvh, int64_t n, const auto* kb, const auto* vb, int64_t kstride, auto from_of,
                  auto n_of) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kb)>>;
    const float *kf, *vf;
    int64_t stride = kstride;
    if constexpr (std::is_same_v<T, float>) {
      kf = kb, vf = vb;
    } else {  // widen the block once for all queries and heads
      for (int64_t j = 0; j < n; ++j) {
        as_f32(kb + j * kstride, kt.data() + j * hd, hd);
        as_f32(vb + j * kstride, vt.data() + j * hd, hd);
      }
      kf = kt.data(), vf = vt.data(), stride = hd;
    }
    for (int64_t j = 0; j < nq; ++j) {
      const int64_t f = from_of(j), nj = n_of(j) - f;
      if (nj <= 0) continue;
      const int64_t i = j * nh + (kvh - h0) * g_n;  // the kv head's first q head of query j
      Fold(hd, g_n, qv.data() + i * hd, kf + f * stride, vf + f * stride, stride, nj, s.softcap, m.data() + i,
           l.data() + i, acc.data() + i * hd, sc.data());
    }
  };
  // Keys before `lo` are in no window of the run's queries (its first query's is the lowest).
  const int64_t lo = WindowStart(s, positions[r.i0]);
  auto from = [&](int64_t j, int64_t j0) {  // query j's first key in a block starting at key j0
    return std::max<int64_t>(0, WindowStart(s, positions[r.i0 + j]) - j0);
  };
  // Cached keys [0, start), a page at a time through the block table: every query sees them all.
  const int32_t* table = block_tables + b * s.p;
  const int64_t slot = 2 * s.hkv * hd;  // one slot's K/V record for every head
  for (int64_t j0 = lo / ps * ps; j0 < start; j0 += ps) {
    const int64_t page = table[j0 / ps];
    if (page < 0 || page >= s.num_pages) return false;
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
      fold(kvh, n, base, base + hd, slot, [&](int64_t j) { return from(j, j0); }, [n](int64_t) { return n; });
    }
  }
  // The chunk's own keys: flat indices first .. i0 + j for query j (positions start .. pos),
  // from the first one in the run's window.
  const int64_t first = r.i0 - (positions[r.i0] - start), last = r.i0 + nq - 1;
  for (int64_t j0 = first + std::max<int64_t>(0, lo - start); j0 <= last; j0 += ps) {
    const int64_t n = std::min(ps, last - j0 + 1), p0 = start + (j0 - first);  // p0: key j0's position
    for (int64_t kvh = h0; kvh < h1; ++kvh) {
      fold(kvh, n, k_new + (j0 * s.hkv + kvh) * hd, v_new + (j0 * s.hkv + kvh) * hd, s.hkv * hd,
           [&](int64_t j) { return from(j, p0); }, [&](int64_t j) { return std::min(n, r.i0 + j - j0 + 1); });
    }
  }
  StoreRun(s, r, h0, h1, acc, l, out);
  return true;
}

// Deterministic mode: a query folds its keys in blocks of kKeyBlock at fixed absolute positions
// [16a, 16a + 16), whichever of the cache and the step's own K/V hold them. `RunHeads` cuts blocks
// at page and chunk starts instead, and a query's softmax state (its running max, the rescaling
// of what came before, each block's 16-lane sum) depends on where blocks start: so a query's
// output changed with the chunk it came in, with a prefix hit (the chunk then starts later) and
// between a decode step and a prefill of the same tokens. Here it is the same bits in all of them.
constexpr int64_t kKeyBlock = 16;

// One work item as `RunHeads`, with fixed key blocks: a block that lies in one page, or in the
// step's own f32 K/V, is folded in place; any other (it spans the cached keys and the chunk's own,
// or two pages, or is bf16) is first gathered into f32 scratch. The values and the order of a
// block's keys are the same either way.
template <typename A, typename K>
bool RunHeadsFixed(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, const A* q, const K* pages,
                   const A* k_new, const A* v_new, const int32_t* block_tables, const int32_t* positions,
                   const int32_t* chunk_starts, const int32_t* kv_lens, A* out) {
  const int64_t g_n = s.hq / s.hkv, hd = s.hd, ps = s.ps, nh = (h1 - h0) * g_n, nq = r.n;
  const int64_t b = r.i0 / s.c, start = chunk_starts[b];
  if (!r.real) {
    ZeroRun(s, r, h0, h1, out);
    return positions[r.i0] >= kv_lens[b];  // padding, or a real query whose chunk does not fit
  }
  std::vector<float> acc(nq * nh * hd, 0.0f), m(nq * nh), l(nq * nh, 0.0f), sc(kKeyBlock);
  std::vector<float> kt(kKeyBlock * hd), vt(kKeyBlock * hd);
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  const std::vector<float> qv = ScaledQueries(s, r, h0, h1, q);
  const int32_t* table = block_tables + b * s.p;
  const int64_t slot = 2 * s.hkv * hd, own = s.hkv * hd;  // strides of a cached and an own key
  const int64_t pos0 = positions[r.i0], end = positions[r.i0 + nq - 1] + 1;  // keys [0, end)
  // Where key p's K sits (its V is hd further on in a page, at v_new's same offset for an own
  // key): the page slot through the table for p < start, else the chunk's flat index.
  auto cached = [&](int64_t p, int64_t kvh) -> const K* {
    const int64_t page = table[p / ps];
    if (page < 0 || page >= s.num_pages) return nullptr;
    return pages + (page * ps + p % ps) * slot + 2 * kvh * hd;
  };
  auto own_at = [&](int64_t p) { return r.i0 + (p - pos0); };
  const int64_t lo = WindowStart(s, pos0);  // keys before it are in no window of the run
  for (int64_t a = lo / kKeyBlock * kKeyBlock; a < end; a += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - a);
    for (int64_t kvh = h0; kvh < h1; ++kvh) {
      const float *kf = kt.data(), *vf = vt.data();
      int64_t stride = hd;
      bool gather = true;
      if constexpr (std::is_same_v<K, float>) {
        if (a + n <= start && a / ps == (a + n - 1) / ps) {
          const K* base = cached(a, kvh);
          if (base == nullptr) return false;
          kf = base, vf = base + hd, stride = slot, gather = false;
        }
      }
      if constexpr (std::is_same_v<A, float>) {
        if (a >= start) {
          const int64_t i = own_at(a);
          kf = k_new + i * own + kvh * hd, vf = v_new + i * own + kvh * hd, stride = own, gather = false;
        }
      }
      for (int64_t j = 0; gather && j < n; ++j) {
        const int64_t p = a + j;
        if (p < lo) continue;  // seen by no query (its page may be gone)
        if (p < start) {
          const K* base = cached(p, kvh);
          if (base == nullptr) return false;
          load(kt.data() + j * hd, base, hd);
          load(vt.data() + j * hd, base + hd, hd);
        } else {
          const int64_t i = own_at(p);
          load(kt.data() + j * hd, k_new + i * own + kvh * hd, hd);
          load(vt.data() + j * hd, v_new + i * own + kvh * hd, hd);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        // The block's keys query j sees: [f, f + nj), from its window start to its position.
        const int64_t f = std::max<int64_t>(0, WindowStart(s, positions[r.i0 + j]) - a);
        const int64_t nj = std::min(n, positions[r.i0 + j] - a + 1) - f;
        if (nj <= 0) continue;
        const int64_t i = j * nh + (kvh - h0) * g_n;
        Fold(hd, g_n, qv.data() + i * hd, kf + f * stride, vf + f * stride, stride, nj, s.softcap, m.data() + i,
             l.data() + i, acc.data() + i * hd, sc.data());
      }
    }
  }
  StoreRun(s, r, h0, h1, acc, l, out);
  return true;
}

template <typename A, typename K>
ffi::Error Run(ffi::ThreadPool pool, const Shape& s, const void* q, const void* pages,
               const void* k_new, const void* v_new, const int32_t* bt, const int32_t* pos,
               const int32_t* cs, const int32_t* kl, void* out, bool fixed) {
  // Runs x chunks of kv heads: whole runs when there are enough to share out, else a run's
  // heads split so that a batch-1 step still uses every thread. The last runs of a prefill
  // chunk see the most keys, so items go from the last run back: the short ones even out
  // the threads at the end.
  const std::vector<QueryRun> runs = Runs(s, bt, pos, cs, kl);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1), nr = static_cast<int64_t>(runs.size());
  const int64_t chunks = std::clamp<int64_t>((2 * threads + nr - 1) / nr, 1, s.hkv);
  std::atomic<bool> ok{true};
  hotswap::ParallelFor(pool, nr * chunks, [&](int64_t it) {
    const QueryRun& r = runs[nr - 1 - it / chunks];
    const int64_t c = it % chunks;
    auto heads = fixed ? RunHeadsFixed<A, K> : RunHeads<A, K>;
    if (!heads(s, r, s.hkv * c / chunks, s.hkv * (c + 1) / chunks, static_cast<const A*>(q),
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
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Result<ffi::AnyBuffer> out, float scale,
                          bool fixed, int64_t window, float softcap) {
  auto qd = q.dimensions(), pd = pages.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("hotswap paged attention: q and pages must be 4-D, tables 2-D");
  }
  Shape s{qd[0], qd[1], qd[2], pd[2] / 2, qd[3], pd[0], pd[1], td[1], scale, window, softcap};
  if (window < 0 || !(softcap >= 0)) {
    return ffi::Error::InvalidArgument("hotswap paged attention: window and softcap must be >= 0 (0: none)");
  }
  if (pd[3] != s.hd || s.hkv == 0 || s.hq % s.hkv != 0 || td[0] != s.b) {
    return ffi::Error::InvalidArgument("hotswap paged attention: q, pages and tables disagree on shape");
  }
  const void* args[] = {q.untyped_data(), pages.untyped_data(), k_new.untyped_data(), v_new.untyped_data()};
  const int32_t* ints[] = {block_tables.typed_data(), positions.typed_data(), chunk_starts.typed_data(),
                           kv_lens.typed_data()};
  void* o = out->untyped_data();
  auto run = WithDtypes(q.element_type(), pages.element_type(), [&](auto a, auto k) {
    return Run<decltype(a), decltype(k)>(pool, s, args[0], args[1], args[2], args[3], ints[0], ints[1], ints[2],
                                         ints[3], o, fixed);
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
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> pages_out, float scale,
                               bool fixed, int64_t window, float softcap) {
  if (pages_out->untyped_data() != pages.untyped_data()) {
    return ffi::Error::InvalidArgument("hotswap paged attention: the page output must alias the page input");
  }
  auto qd = q.dimensions();
  if (qd.size() != 4 || static_cast<int64_t>(slots.element_count()) != qd[0] * qd[1]) {
    return ffi::Error::InvalidArgument("hotswap paged attention: slots must hold one entry per query token");
  }
  ffi::Error err = PagedAttention(pool, q, pages, k_new, v_new, block_tables, positions, chunk_starts, kv_lens, out,
                                  scale, fixed, window, softcap);
  if (err.failure()) return err;  // shapes and dtypes are checked there
  auto pd = pages.dimensions();
  Shape s{qd[0], qd[1], qd[2], pd[2] / 2, qd[3], pd[0], pd[1], block_tables.dimensions()[1], scale, 0, 0.0f};
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
                                  .Attr<float>("scale")
                                  .Attr<bool>("fixed")       // deterministic mode: RunHeadsFixed
                                  .Attr<int64_t>("window")   // sliding window; 0: none
                                  .Attr<float>("softcap"));  // logit softcap; 0: none

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
                                  .Attr<float>("scale")
                                  .Attr<bool>("fixed")       // deterministic mode: RunHeadsFixed
                                  .Attr<int64_t>("window")   // sliding window; 0: none
                                  .Attr<float>("softcap"));  // logit softcap; 0: none
