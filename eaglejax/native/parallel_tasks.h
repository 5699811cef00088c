// Spreads a kernel's independent tasks over XLA's intra-op thread pool.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace {  // internal linkage, as in the kernels: each one is a library of its own

// Runs tasks 0..count-1 on the calling thread and on up to min(pool threads, count) - 1
// pool helpers, each claiming one task at a time from an atomic counter; returns once
// every task is done. Each participating thread calls make_worker() once and runs its
// tasks with the returned worker(task), which may hold that thread's scratch memory.
// The state (make_worker and what it captures) is shared with the helpers, which may
// start after the caller has returned and then find no task left.
template <typename MakeWorker>
void parallel_tasks(xla::ffi::ThreadPool& pool, int64_t count, MakeWorker make_worker) {
  struct State {
    State(MakeWorker make, int64_t n) : make_worker(std::move(make)), count(n) {}
    MakeWorker make_worker;
    int64_t count;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>(std::move(make_worker), count);
  auto work = [](State& s) {
    auto worker = s.make_worker();
    for (int64_t t; (t = s.next.fetch_add(1, std::memory_order_relaxed)) < s.count;) {
      worker(t);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace
