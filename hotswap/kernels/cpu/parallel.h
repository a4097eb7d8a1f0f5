// ParallelFor: the work-sharing scheme every hotswap CPU kernel uses on XLA's intra-op pool.
//
// Items are claimed from a shared counter by the calling thread and by helpers scheduled on
// the pool. The caller never waits for a helper that has not started (it may never get a
// thread while the caller holds one): it works through the items itself and waits only for
// items already claimed. The state lives on the heap, so a helper that starts after the call
// returned finds the counter exhausted and touches nothing else; `body` is called only for
// claimed items, all of which finish before ParallelFor returns, so it may capture by
// reference.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace hotswap {

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, std::function<void(int64_t)> body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::function<void(int64_t)> body;
  };
  auto st = std::make_shared<State>();
  st->body = std::move(body);
  auto task = [st, items] {
    for (int64_t i; (i = st->next.fetch_add(1)) < items;) {
      st->body(i);
      st->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([task] { task(); });
  task();
  while (st->done.load() < items) std::this_thread::yield();
}

}  // namespace hotswap
