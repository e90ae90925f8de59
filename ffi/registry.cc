#include "registry.h"

#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace kvcached {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<KVBuffer>> buffers;
  std::unordered_map<std::string, uint64_t> generations;  // registrations per key
  std::mt19937_64 rng{std::random_device{}()};
};

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: handlers may run at exit
  return *r;
}

}  // namespace

uint64_t register_buffer(std::shared_ptr<KVBuffer> buffer, const std::string& key) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  uint64_t h;
  if (key.empty()) {
    do {
      // Random handles make a stale or made-up handle fail the lookup.
      h = r.rng() >> 1;
    } while (h == 0 || r.buffers.count(h) != 0);
  } else {
    // The same key's n-th registration gets the same handle in every process, so
    // compiled steps (the handle is an attribute) hit the persistent compilation cache;
    // a stale handle of an earlier registration of the key still fails the lookup.
    const uint64_t generation = ++r.generations[key];
    h = mix64(fnv1a64(key) ^ mix64(generation)) >> 1;
    if (h == 0 || r.buffers.count(h) != 0) throw std::runtime_error("KV buffer handle collision for " + key);
  }
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
