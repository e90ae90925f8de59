// Registry: opaque 64-bit handles -> KV caches. A handle names one KV cache as one buffer
// per device (its shards: a tensor-parallel cache holds a slice of the KV heads on each);
// an FFI handler receives the handle as an attribute and the device ordinal it runs on
// from XLA, and finds that device's buffer here, so a stale or forged handle, or a device
// the cache has no shard on, is an error, not a crash.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv_buffer.h"

namespace kvcached {

// Registers a cache's shards (at least one; distinct device ordinals; the same layout and
// backend). An empty key gets a random handle; a key gets one derived from (key, how many
// times the key was registered in this process): stable across processes, never reused.
// Throws Error on bad shards.
uint64_t register_buffers(std::vector<std::shared_ptr<KVBuffer>> shards, const std::string& key = "");
// The shard on `device_ordinal`, or nullptr with *why set (unknown handle, or no shard on
// that device).
std::shared_ptr<KVBuffer> lookup_buffer(uint64_t handle, int device_ordinal, std::string* why = nullptr);
// The shard of an open cache whose virtual range starts at `data` on `device_ordinal`: how
// the Host handlers find their cache (the view is their operand, so compiled steps do not
// depend on the handle), or nullptr with *why set (not the start of an open cache's range,
// e.g. a copy of a view, or another device's shard).
std::shared_ptr<KVBuffer> lookup_view(const void* data, int device_ordinal, std::string* why = nullptr);
// Whether the handle is registered.
bool is_registered(uint64_t handle);
// Returns false if the handle was not registered.
bool unregister_buffer(uint64_t handle);

}  // namespace kvcached
