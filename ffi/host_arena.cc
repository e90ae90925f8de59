#include "host_arena.h"

#include <cstring>
#include <limits>
#include <string>

#include "errors.h"

namespace kvcached {

HostArena::HostArena(std::shared_ptr<PagePool> pool, size_t block_bytes, int64_t num_planes,
                     int64_t num_slots, int group)
    : pool_(std::move(pool)),
      block_bytes_(block_bytes),
      num_planes_(num_planes),
      num_slots_(num_slots),
      group_(group) {
  if (block_bytes == 0 || num_planes <= 0 || num_slots <= 0 || group < 0) {
    throw Error("a host arena needs positive block bytes, planes and slots, and a group >= 0");
  }
  const size_t max = std::numeric_limits<size_t>::max();
  if (static_cast<size_t>(num_planes) > max / block_bytes ||
      static_cast<size_t>(num_slots) > max / (block_bytes * static_cast<size_t>(num_planes))) {
    throw Error("a host arena of " + std::to_string(num_slots) + " slots overflows its size");
  }
  data_ = static_cast<char*>(backend().alloc_host(total_bytes()));
  pinned_ = backend().device_kind() == DeviceKind::kCuda;
}

HostArena::~HostArena() {
  if (data_ != nullptr) backend().free_host(data_, total_bytes());
}

void HostArena::read_slot(int64_t slot, void* dst) {
  if (slot < 0 || slot >= num_slots_) {
    throw Error("slot " + std::to_string(slot) + " out of range [0, " + std::to_string(num_slots_) + ")");
  }
  char* out = static_cast<char*>(dst);
  for (int64_t p = 0; p < num_planes_; ++p) {
    std::memcpy(out + static_cast<size_t>(p) * block_bytes_, at(p, slot), block_bytes_);
  }
}

}  // namespace kvcached
