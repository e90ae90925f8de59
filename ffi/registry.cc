#include "registry.h"

#include "errors.h"

#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace kvcached {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<uint64_t, std::vector<std::shared_ptr<KVBuffer>>> buffers;
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

void check_shards(const std::vector<std::shared_ptr<KVBuffer>>& shards) {
  if (shards.empty()) throw Error("a KV cache needs at least one buffer");
  for (const auto& s : shards) {
    if (!s) throw Error("a KV cache shard is null");
  }
  std::unordered_set<int> ordinals;
  const KVLayout& a = shards[0]->layout();
  for (const auto& s : shards) {
    if (!ordinals.insert(s->device_ordinal()).second) {
      throw Error("two shards of one KV cache on device ordinal " + std::to_string(s->device_ordinal()));
    }
    const KVLayout& b = s->layout();
    if (b.num_layers != a.num_layers || b.num_kv_heads != a.num_kv_heads || b.head_dim != a.head_dim ||
        b.block_size != a.block_size || b.dtype != a.dtype || b.num_pages != a.num_pages ||
        s->page_size() != shards[0]->page_size()) {
      throw Error("the shards of one KV cache must have the same layout and page size");
    }
    if (s->pool().backend().device_kind() != shards[0]->pool().backend().device_kind()) {
      throw Error("the shards of one KV cache must be on one backend");
    }
  }
}

}  // namespace

uint64_t register_buffers(std::vector<std::shared_ptr<KVBuffer>> shards, const std::string& key) {
  check_shards(shards);
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
  r.buffers.emplace(h, std::move(shards));
  return h;
}

std::shared_ptr<KVBuffer> lookup_buffer(uint64_t handle, int device_ordinal, std::string* why) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.buffers.find(handle);
  if (it == r.buffers.end()) {
    if (why) *why = "unknown or closed KV cache handle " + std::to_string(handle);
    return nullptr;
  }
  std::string on;
  for (const auto& s : it->second) {
    if (s->device_ordinal() == device_ordinal) return s;
    on += (on.empty() ? "" : ", ") + std::to_string(s->device_ordinal());
  }
  if (why) {
    *why = "KV cache handle " + std::to_string(handle) + " has no shard on device ordinal " +
           std::to_string(device_ordinal) + " (its shards are on " + on + ")";
  }
  return nullptr;
}

std::shared_ptr<KVBuffer> lookup_view(const void* data, int device_ordinal, std::string* why) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto addr = reinterpret_cast<uintptr_t>(data);
  for (const auto& [handle, shards] : r.buffers) {
    for (const auto& s : shards) {
      if (s->base() != addr) continue;
      if (s->device_ordinal() == device_ordinal) return s;
      if (why) {
        *why = "the view operand is KV cache " + std::to_string(handle) + "'s shard on device ordinal " +
               std::to_string(s->device_ordinal()) + ", not on " + std::to_string(device_ordinal);
      }
      return nullptr;
    }
  }
  if (why) {
    *why = "the view operand is not an open KV cache's view (a copy, or a closed cache): pass the "
           "cache (or cache.view) to the jitted function as an argument, do not close over it";
  }
  return nullptr;
}

bool is_registered(uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.buffers.count(handle) != 0;
}

bool unregister_buffer(uint64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.buffers.erase(handle) != 0;
}

}  // namespace kvcached
