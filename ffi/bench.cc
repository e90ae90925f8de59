#include "bench.h"

#include <chrono>

namespace kvcached {

std::map<std::string, std::vector<double>> bench_backend(PhysicalBackend& backend, size_t iters) {
  using clock = std::chrono::steady_clock;
  auto ns = [](clock::time_point a, clock::time_point b) {
    return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  std::map<std::string, std::vector<double>> out;
  const size_t ps = backend.page_size();
  auto t0 = clock::now();
  const uintptr_t base = backend.reserve(iters * ps);
  out["reserve"].push_back(ns(t0, clock::now()));
  std::vector<PageHandle> pages(iters);
  for (size_t i = 0; i < iters; ++i) {
    t0 = clock::now();
    pages[i] = backend.create_page();
    out["create"].push_back(ns(t0, clock::now()));
  }
  for (size_t i = 0; i < iters; ++i) {
    t0 = clock::now();
    backend.map(base + i * ps, &pages[i], 1);
    out["map"].push_back(ns(t0, clock::now()));
  }
  for (size_t i = 0; i < iters; ++i) {
    t0 = clock::now();
    backend.unmap(base + i * ps, 1);
    out["unmap"].push_back(ns(t0, clock::now()));
  }
  for (size_t i = 0; i < iters; ++i) {
    t0 = clock::now();
    backend.release_page(pages[i]);
    out["release"].push_back(ns(t0, clock::now()));
  }
  backend.free_range(base, iters * ps);
  return out;
}

}  // namespace kvcached
