// Registry: opaque 64-bit handles -> KV buffers. FFI handlers receive a handle as an
// attribute and look it up here, so a stale or forged handle is an error, not a crash.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kv_buffer.h"

namespace kvcached {

// An empty key gets a random handle; a key gets one derived from (key, how many times the
// key was registered in this process): stable across processes, never reused.
uint64_t register_buffer(std::shared_ptr<KVBuffer> buffer, const std::string& key = "");
// Returns nullptr for an unknown handle.
std::shared_ptr<KVBuffer> lookup_buffer(uint64_t handle);
// Returns false if the handle was not registered.
bool unregister_buffer(uint64_t handle);

}  // namespace kvcached
