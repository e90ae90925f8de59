#include "registry.h"

#include <mutex>
#include <random>
#include <unordered_map>

namespace kvcached {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<KVBuffer>> buffers;
  std::mt19937_64 rng{std::random_device{}()};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handlers may run at exit
  return *r;
}

}  // namespace

uint64_t register_buffer(std::shared_ptr<KVBuffer> buffer) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  uint64_t h;
  do {
    // Random handles make a stale or made-up handle fail the lookup.
    h = r.rng() >> 1;
  } while (h == 0 || r.buffers.count(h) != 0);
  r.buffers.emplace(h, std::move(buffer));
  return h;
}

std::shared_ptr<KVBuffer> lookup_buffer(uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.buffers.find(handle);
  return it == r.buffers.end() ? nullptr : it->second;
}

bool unregister_buffer(uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.buffers.erase(handle) != 0;
}

}  // namespace kvcached
