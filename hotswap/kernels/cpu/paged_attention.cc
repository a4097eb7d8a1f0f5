// Paged attention for XLA:CPU, as an XLA FFI custom call (hotswap/kernels/cpu_attention.py).
//
// Why C++: on XLA:CPU the jnp attention gathers every page a row reads into a fresh
// buffer and then runs many tiny batched dots, which at long contexts and large batches
// were most of a decode step. Here each row reads its keys straight from the pages
// through the block table, a page at a time for all its kv heads, once, with an online
// softmax: no gather, no temporaries, and the work is spread over XLA's own intra-op
// thread pool (a pool of our own would compete with XLA's threads for the same cores).
// Consecutive queries of a prefill chunk share each block of keys while it is in L1
// (`QueryRun`), and the q heads of a kv head share each K and V vector loaded
// (`attention_fold.h`): one head at a time would load a K or V vector per FMA and be bound by
// the load ports. Decode rows whose block tables start with the same pages (the n samples of
// one prompt) read those pages once per step for the whole group (`Groups`, `GroupHeads`);
// every other page a decode row reads is its own, read once.
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
// first key any of its queries sees: pages wholly before the window are never read (their
// table entries are only compared, to find shared prefixes). Scores s (q.k * scale) become
// softcap * tanh(s / softcap).
//
// Paths (`isa.h`, the FFI attribute `isa`; "auto" the best): kAvx512Bf16 folds bf16 pages and
// bf16 step K/V as they are with vdpbf16ps (`attention_bf16.h`); kAvx512, kAvx2Fma and kScalar
// (and kAvx512Bf16 for f32 data) fold f32, bf16 widened once per block into scratch first.
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
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "attention_fold.h"
#include "attention_work.h"
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

// Whether this call folds bf16 K/V in place (`attention_bf16.h`): its path and head_dim have a fold.
inline bool FoldsBf16(const Shape& s) {
#if defined(__AVX512F__)
  return s.isa == hotswap::Isa::kAvx512Bf16 && (s.hd == 64 || s.hd == 128);
#else
  return false;
#endif
}

// n rows of K and V (hd values, `stride` apart) into f32 rows hd apart: bf16 widened exactly.
template <typename T>
void WidenRows(float* kt, float* vt, const T* kb, const T* vb, int64_t stride, int64_t n, int64_t hd) {
  for (int64_t j = 0; j < n; ++j) {
    load(kt + j * hd, kb + j * stride, hd);
    load(vt + j * hd, vb + j * stride, hd);
  }
}

// Calls fold(kvh, j0, n, kf, vf, stride) for the keys [j0, j0 + n) of each page of `table` that
// holds keys [from, to) (from page-aligned), for kv heads [h0, h1): K and V of head kvh as rows
// `stride` apart, in place (f32 pages; bf16 pages on a path that folds bf16) or widened once into
// f32 kt / vt. Within a page every
// kv head in turn: a slot's K/V for all heads is one contiguous record, so the pages stream
// through once instead of once per kv head. False when the table names a page outside the cache.
template <typename K, typename F>
bool ForPages(const Shape& s, const int32_t* table, int64_t from, int64_t to, int64_t h0, int64_t h1, const K* pages,
              float* kt, float* vt, F&& fold) {
  const int64_t hd = s.hd, ps = s.ps, slot = 2 * s.hkv * hd;  // slot: one slot's K/V record for every head
  for (int64_t j0 = from; j0 < to; j0 += ps) {
    const int64_t page = table[j0 / ps];
    if (page < 0 || page >= s.num_pages) return false;
    const int64_t n = std::min(ps, to - j0);
    // Pages sit anywhere in the pool, so the hardware prefetcher restarts at each one:
    // ask for the next page's part of this item while this one is folded in.
    const int64_t next = j0 + ps < to ? table[(j0 + ps) / ps] : -1;
    for (int64_t kvh = h0; kvh < h1; ++kvh) {
      const K* base = pages + page * ps * slot + 2 * kvh * hd;
      if (next > 0 && next < s.num_pages) {
        const char* nb = reinterpret_cast<const char*>(pages + next * ps * slot + 2 * kvh * hd);
        const int64_t bytes = 2 * hd * sizeof(K);
        for (int64_t j = 0; j < ps; ++j) {
          for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(nb + j * slot * sizeof(K) + off);
        }
      }
      if (std::is_same_v<K, float> || FoldsBf16(s)) {
        fold(kvh, j0, n, base, base + hd, slot);
      } else {
        WidenRows(kt, vt, base, base + hd, slot, n, hd);
        fold(kvh, j0, n, kt, vt, hd);
      }
    }
  }
  return true;
}

// The online-softmax state of one run's queries for kv heads [h0, h1) and their G q heads
// each: scaled queries (and, on a path that folds bf16, them rounded to bf16), outputs, running
// max and sum, [query][head] (x hd).
template <typename A>
struct RunState {
  const Shape& s;
  const QueryRun& r;
  const int32_t* positions;
  int64_t h0, h1, g_n, nh, start, lo;  // lo: keys before it are in no window of the run's queries
  std::vector<float> qv, acc, m, l, sc;
  std::vector<uint16_t> qb;

  RunState(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, const A* q, const int32_t* positions,
           const int32_t* chunk_starts)
      : s(s), r(r), positions(positions), h0(h0), h1(h1), g_n(s.hq / s.hkv), nh((h1 - h0) * g_n),
        start(chunk_starts[r.i0 / s.c]), lo(WindowStart(s, positions[r.i0])),  // the first query's is the lowest
        qv(ScaledQueries(s, r, h0, h1, q)), acc(r.n * nh * s.hd, 0.0f),
        m(r.n * nh, -std::numeric_limits<float>::infinity()), l(r.n * nh, 0.0f), sc(s.ps) {
    if (FoldsBf16(s)) {  // each q row as bf16 hi then lo (q - hi): hi + lo is q to 16 bits
      qb.resize(2 * qv.size());
      for (size_t i = 0; i < qv.size(); ++i) {
        const size_t row = i / s.hd, d = i % s.hd;
        const uint16_t hi = f32_to_bf16(qv[i]);
        qb[2 * row * s.hd + d] = hi;
        qb[(2 * row + 1) * s.hd + d] = f32_to_bf16(qv[i] - bf16_to_f32(hi));
      }
    }
  }

  // Fold n keys of kv head kvh (rows stride apart, f32 or bf16 when FoldsBf16; the first at
  // position p0) into the run's queries: query j takes them from its window's start up to n_of(j).
  template <typename T, typename NOf>
  void FoldKeys(int64_t kvh, int64_t n, const T* kf, const T* vf, int64_t stride, int64_t p0, NOf n_of) {
    for (int64_t j = 0; j < r.n; ++j) {
      const int64_t f = std::max<int64_t>(0, WindowStart(s, positions[r.i0 + j]) - p0), nj = n_of(j) - f;
      if (nj <= 0) continue;
      const int64_t i = j * nh + (kvh - h0) * g_n;  // the kv head's first q head of query j
      if constexpr (std::is_same_v<T, float>) {
        Fold(s.isa, s.hd, g_n, qv.data() + i * s.hd, kf + f * stride, vf + f * stride, stride, nj, s.softcap,
             m.data() + i, l.data() + i, acc.data() + i * s.hd, sc.data());
      } else {
#if defined(__AVX512F__)
        FoldBf16(s.hd, g_n, qb.data() + 2 * i * s.hd, kf + f * stride, vf + f * stride, stride, nj, s.softcap,
                 m.data() + i, l.data() + i, acc.data() + i * s.hd);
#endif
      }
    }
  }

  // The cached keys [from, start) (from page-aligned) through the row's table, a page at a time.
  template <typename K>
  bool FoldPages(const int32_t* table, int64_t from, const K* pages, float* kt, float* vt) {
    return ForPages(s, table, from, start, h0, h1, pages, kt, vt,
                    [&](int64_t kvh, int64_t j0, int64_t n, auto kf, auto vf, int64_t stride) {
                      FoldKeys(kvh, n, kf, vf, stride, j0, [n](int64_t) { return n; });
                    });
  }

  // The chunk's own keys: flat indices first .. i0 + j for query j (positions start .. pos),
  // from the first one in the run's window, up to ps at a time.
  void FoldOwn(const A* k_new, const A* v_new, float* kt, float* vt) {
    const int64_t hd = s.hd, ps = s.ps, first = r.i0 - (positions[r.i0] - start), last = r.i0 + r.n - 1;
    for (int64_t j0 = first + std::max<int64_t>(0, lo - start); j0 <= last; j0 += ps) {
      const int64_t n = std::min(ps, last - j0 + 1), p0 = start + (j0 - first);  // p0: key j0's position
      for (int64_t kvh = h0; kvh < h1; ++kvh) {
        const A *kb = k_new + (j0 * s.hkv + kvh) * hd, *vb = v_new + (j0 * s.hkv + kvh) * hd;
        auto n_of = [&](int64_t j) { return std::min(n, r.i0 + j - j0 + 1); };
        if (std::is_same_v<A, float> || FoldsBf16(s)) {
          FoldKeys(kvh, n, kb, vb, s.hkv * hd, p0, n_of);
        } else {  // widen the block once for all queries and heads
          WidenRows(kt, vt, kb, vb, s.hkv * hd, n, hd);
          FoldKeys(kvh, n, kt, vt, hd, p0, n_of);
        }
      }
    }
  }

  template <typename O>
  void Store(O* out) const {
    StoreRun(s, r, h0, h1, acc, l, out);
  }
};

// One work item: the queries of run r, for kv heads [h0, h1) and their G q heads each. Keys
// go a page at a time (then the chunk's own keys, up to ps at a time), and within a block
// every kv head of the item in turn, and within a head every query of the run.
template <typename A, typename K>
bool RunHeads(const Shape& s, const QueryRun& r, int64_t h0, int64_t h1, const A* q, const K* pages, const A* k_new,
              const A* v_new, const int32_t* block_tables, const int32_t* positions, const int32_t* chunk_starts,
              const int32_t* kv_lens, A* out) {
  const int64_t b = r.i0 / s.c;
  if (!r.real) {
    ZeroRun(s, r, h0, h1, out);
    return positions[r.i0] >= kv_lens[b];  // padding, or a real query whose chunk does not fit
  }
  std::vector<float> kt(s.ps * s.hd), vt(s.ps * s.hd);
  RunState<A> st(s, r, h0, h1, q, positions, chunk_starts);
  if (!st.FoldPages(block_tables + b * s.p, st.lo / s.ps * s.ps, pages, kt.data(), vt.data())) return false;
  st.FoldOwn(k_new, v_new, kt.data(), vt.data());
  st.Store(out);
  return true;
}

// One work item of a group of decode rows (`Groups`): each shared page is read once, a kv head
// at a time, and folded into every row of the group while it is in L1 (a row folds only its
// keys: those before its chunk start, from its window's start); then each row goes on alone
// over its own pages and key. A row folds the same blocks in the same order as `RunHeads`.
template <typename A, typename K>
bool GroupHeads(const Shape& s, const std::vector<QueryRun>& runs, const Group& g, int64_t h0, int64_t h1,
                const A* q, const K* pages, const A* k_new, const A* v_new, const int32_t* block_tables,
                const int32_t* positions, const int32_t* chunk_starts, A* out) {
  const int64_t ps = s.ps, shared = g.pages * ps;
  std::vector<float> kt(ps * s.hd), vt(ps * s.hd);
  std::vector<RunState<A>> rows;
  rows.reserve(g.runs.size());
  int64_t lo = shared, end = 0;  // the shared keys some row reads: [lo, end)
  for (int64_t i : g.runs) {
    rows.emplace_back(s, runs[i], h0, h1, q, positions, chunk_starts);
    lo = std::min(lo, rows.back().lo / ps * ps);
    end = std::max(end, std::min(shared, rows.back().start));
  }
  const int32_t* table = block_tables + runs[g.runs[0]].i0 / s.c * s.p;  // the shared pages: alike in every row
  const bool ok = ForPages(s, table, lo, end, h0, h1, pages, kt.data(), vt.data(),
                           [&](int64_t kvh, int64_t j0, int64_t n, auto kf, auto vf, int64_t stride) {
                             for (RunState<A>& st : rows) {
                               const int64_t nr = std::min(n, st.start - j0);
                               if (nr > 0) st.FoldKeys(kvh, nr, kf, vf, stride, j0, [nr](int64_t) { return nr; });
                             }
                           });
  if (!ok) return false;
  for (RunState<A>& st : rows) {
    const int32_t* own = block_tables + st.r.i0 / s.c * s.p;
    if (!st.FoldPages(own, std::max(shared, st.lo / ps * ps), pages, kt.data(), vt.data())) return false;
    st.FoldOwn(k_new, v_new, kt.data(), vt.data());
    st.Store(out);
  }
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
        Fold(s.isa, hd, g_n, qv.data() + i * hd, kf + f * stride, vf + f * stride, stride, nj, s.softcap, m.data() + i,
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
  // Groups (a run, or decode rows sharing their first pages) x chunks of kv heads: whole groups
  // when there are enough to share out, else a group's heads split so that a batch-1 step still
  // uses every thread. The last runs of a prefill chunk see the most keys, so items go from the
  // last group back: the short ones even out the threads at the end. A group holds at most as
  // many rows as leaves an item a thread (rows x kv heads / threads), at least 2 and at most 16:
  // a larger group reads its shared pages fewer times, but one item does all its rows' work.
  const std::vector<QueryRun> runs = Runs(s, bt, pos, cs, kl);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t decode = std::count_if(runs.begin(), runs.end(), [](const QueryRun& r) { return r.real && r.n == 1; });
  const int64_t max_rows = fixed ? 1 : std::clamp<int64_t>(decode * s.hkv / threads, 2, kGroupRows);
  const std::vector<Group> groups = Groups(s, runs, bt, cs, max_rows);
  const int64_t ng = static_cast<int64_t>(groups.size());
  const int64_t chunks = std::clamp<int64_t>((2 * threads + ng - 1) / ng, 1, s.hkv);
  std::atomic<bool> ok{true};
  hotswap::ParallelFor(pool, ng * chunks, [&](int64_t it) {
    const Group& g = groups[ng - 1 - it / chunks];
    const int64_t c = it % chunks, h0 = s.hkv * c / chunks, h1 = s.hkv * (c + 1) / chunks;
    const A *qa = static_cast<const A*>(q), *ka = static_cast<const A*>(k_new), *va = static_cast<const A*>(v_new);
    const K* pk = static_cast<const K*>(pages);
    A* o = static_cast<A*>(out);
    bool done;
    if (g.runs.size() > 1) {
      done = GroupHeads<A, K>(s, runs, g, h0, h1, qa, pk, ka, va, bt, pos, cs, o);
    } else {
      auto heads = fixed ? RunHeadsFixed<A, K> : RunHeads<A, K>;
      done = heads(s, runs[g.runs[0]], h0, h1, qa, pk, ka, va, bt, pos, cs, kl, o);
    }
    if (!done) ok = false;
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
                          bool fixed, int64_t window, float softcap, int32_t isa) {
  const hotswap::Isa path = hotswap::Pick(isa, kFoldPaths);
  if (path == hotswap::Isa::kAuto) {
    return ffi::Error::InvalidArgument("hotswap paged attention: isa " + std::to_string(isa) +
                                       " is not a path of this kernel that this CPU runs");
  }
  auto qd = q.dimensions(), pd = pages.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("hotswap paged attention: q and pages must be 4-D, tables 2-D");
  }
  Shape s{qd[0], qd[1], qd[2], pd[2] / 2, qd[3], pd[0], pd[1], td[1], scale, window, softcap, path};
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
                               bool fixed, int64_t window, float softcap, int32_t isa) {
  if (pages_out->untyped_data() != pages.untyped_data()) {
    return ffi::Error::InvalidArgument("hotswap paged attention: the page output must alias the page input");
  }
  auto qd = q.dimensions();
  if (qd.size() != 4 || static_cast<int64_t>(slots.element_count()) != qd[0] * qd[1]) {
    return ffi::Error::InvalidArgument("hotswap paged attention: slots must hold one entry per query token");
  }
  ffi::Error err = PagedAttention(pool, q, pages, k_new, v_new, block_tables, positions, chunk_starts, kv_lens, out,
                                  scale, fixed, window, softcap, isa);
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

// The groups `Run` makes of a step's runs with at most max_rows rows each, for tests to check
// the sharing decision itself: group_of[i] is flat query i's group (in the groups' order) and
// pages_of[i] the pages that group shares (0 for a run alone).
extern "C" void HotswapAttentionGroups(int64_t b, int64_t c, int64_t p, int64_t ps, const int32_t* block_tables,
                                       const int32_t* positions, const int32_t* chunk_starts,
                                       const int32_t* kv_lens, int64_t max_rows, int64_t* group_of,
                                       int64_t* pages_of) {
  const Shape s{b, c, 1, 1, 1, 0, ps, p, 1.0f, 0, 0.0f};
  const std::vector<QueryRun> runs = Runs(s, block_tables, positions, chunk_starts, kv_lens);
  const std::vector<Group> groups = Groups(s, runs, block_tables, chunk_starts, max_rows);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int64_t r : groups[g].runs) {
      for (int64_t i = runs[r].i0; i < runs[r].i0 + runs[r].n; ++i) {
        group_of[i] = static_cast<int64_t>(g);
        pages_of[i] = groups[g].pages;
      }
    }
  }
}

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
                                  .Attr<float>("softcap")    // logit softcap; 0: none
                                  .Attr<int32_t>("isa"));    // cpu_isa.attribute(...)

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
                                  .Attr<float>("softcap")    // logit softcap; 0: none
                                  .Attr<int32_t>("isa"));    // cpu_isa.attribute(...)
