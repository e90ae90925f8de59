// Registry: opaque 64-bit handles -> KV buffers. FFI handlers receive a handle as an
// attribute and look it up here, so a stale or forged handle is an error, not a crash.
#pragma once

#include <cstdint>
#include <memory>

#include "kv_buffer.h"

namespace kvcached {

uint64_t register_buffer(std::shared_ptr<KVBuffer> buffer);
// Returns nullptr for an unknown handle.
std::shared_ptr<KVBuffer> lookup_buffer(uint64_t handle);
// Returns false if the handle was not registered.
bool unregister_buffer(uint64_t handle);

}  // namespace kvcached
