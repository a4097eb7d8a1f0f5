// How paged attention (`paged_attention.cc`) splits a step's queries into work: runs of
// consecutive queries of one chunk, and groups of decode rows whose block tables start with the
// same pages (a prompt sampled n times: `PagePool.share`). A group's shared pages are read once
// per step for all its rows, each row keeping its own softmax state; the rows fold the same
// blocks in the same order as they would alone, so their outputs are the same bits.

#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "isa.h"

namespace {

struct Shape {
  int64_t b, c, hq, hkv, hd, num_pages, ps, p;
  float scale;
  int64_t window;  // sliding window in keys (the query's own included); 0: none
  float softcap;   // 0: none
  hotswap::Isa isa = hotswap::Isa::kScalar;  // the call's path (`attention_fold.h`: kFoldPaths)
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

// A work item's rows: runs (indices into the step's runs, ascending) and the leading pages of
// their block tables they all share; one run, or none shared, is a run alone.
constexpr int64_t kGroupRows = 16;  // rows a group holds at most

struct Group {
  std::vector<int64_t> runs;
  int64_t pages = 0;
};

// Pages of its table a decode row reads keys from: those before its chunk start.
inline int64_t CachedPages(const Shape& s, int64_t start) { return (start + s.ps - 1) / s.ps; }

// The step's runs as work items. A real single-query run (a decode row) with cached keys may
// share: such rows are sorted by their tables' cached pages, so rows with a common prefix sit
// together, and cut into groups of at most `max_rows` where each row's table starts with the
// group's shared pages. A group takes no row that would shorten its shared prefix, nor one that
// shares more with the row after it: that row starts a group of its own (a prompt's n samples
// stay together when other rows share only a system prompt's first page with them). Every other
// run is a group of its own. Groups come in the order of their first run.
std::vector<Group> Groups(const Shape& s, const std::vector<QueryRun>& runs, const int32_t* block_tables,
                          const int32_t* chunk_starts, int64_t max_rows) {
  std::vector<Group> groups;
  std::vector<int64_t> cand;
  for (int64_t i = 0; i < static_cast<int64_t>(runs.size()); ++i) {
    const QueryRun& r = runs[i];
    if (max_rows > 1 && r.real && r.n == 1 && chunk_starts[r.i0 / s.c] > 0) {
      cand.push_back(i);
    } else {
      groups.push_back({{i}, 0});
    }
  }
  auto table = [&](int64_t i) { return block_tables + runs[i].i0 / s.c * s.p; };
  auto pages = [&](int64_t i) { return CachedPages(s, chunk_starts[runs[i].i0 / s.c]); };
  auto lcp = [&](int64_t a, int64_t b) {  // leading pages both read and hold alike
    const int64_t n = std::min(pages(a), pages(b));
    return static_cast<int64_t>(std::mismatch(table(a), table(a) + n, table(b)).first - table(a));
  };
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(table(a), table(a) + pages(a), table(b), table(b) + pages(b));
  });
  const int64_t nc = static_cast<int64_t>(cand.size());
  std::vector<int64_t> adj(nc, 0);  // adj[k]: lcp of candidates k - 1 and k
  for (int64_t k = 1; k < nc; ++k) adj[k] = lcp(cand[k - 1], cand[k]);
  for (int64_t k = 0; k < nc; ++k) {
    Group* g = groups.empty() || k == 0 ? nullptr : &groups.back();
    const bool join = g != nullptr && g->runs.size() < static_cast<size_t>(max_rows) && adj[k] > 0 &&
                      (g->runs.size() == 1 || adj[k] >= g->pages) && !(k + 1 < nc && adj[k + 1] > adj[k]);
    if (join) {
      g->pages = g->runs.size() > 1 ? g->pages : adj[k];
      g->runs.push_back(cand[k]);
    } else {
      groups.push_back({{cand[k]}, 0});
    }
  }
  for (Group& g : groups) {
    std::sort(g.runs.begin(), g.runs.end());
    if (g.runs.size() == 1) g.pages = 0;
  }
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) { return a.runs[0] < b.runs[0]; });
  return groups;
}

}  // namespace
