// Work spread over XLA's intra-op thread pool: the caller and up to workers - 1 helpers
// take tasks from one counter.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

namespace kvcached {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// `spawn(f)` schedules f on another thread.
using Spawn = std::function<void(std::function<void()>)>;

// Runs fn(i) for every i in [0, n) on up to `workers` threads, the caller included, and
// returns when all have run. Helpers may start late (the pool busy with other work): the
// caller takes tasks too and waits only for tasks taken, never for a helper to start, so
// it cannot deadlock. The shared state outlives the call for helpers that start after it
// returned; such a helper takes no task, so it never touches what fn refers to.
// The caller waits for the last tasks spinning (then yielding), not on a condition
// variable: a sleeping thread's wake-up costs tens of microseconds in a VM, more than a
// decode step's matmul.
inline void parallel_for(int64_t n, int64_t workers, const Spawn& spawn, std::function<void(int64_t)> fn) {
  if (n <= 0) return;
  if (workers <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    std::function<void(int64_t)> fn;
  };
  auto st = std::make_shared<State>();
  st->fn = std::move(fn);
  auto run = [st, n] {
    for (int64_t i = st->next++; i < n; i = st->next++) {
      st->fn(i);
      st->finished.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t w = 1; w < std::min(workers, n); ++w) spawn(run);
  run();
  for (int spins = 0; st->finished.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace kvcached
