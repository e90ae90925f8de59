// HostArena: bounded host memory for copies of one KV buffer's blocks (the host tier).
//
// An arena is made for one KV cache group of the buffer (a buffer of one group: every
// plane). num_slots slots, each one block of each of the group's planes, stored plane-major: the bytes of slot s
// in plane p are at data() + (p * num_slots + s) * block_bytes. A run of consecutive
// blocks copied into consecutive slots is then one copy per plane. The memory comes from
// the buffer's backend (page-locked on CUDA, so copies are asynchronous DMA) and is
// allocated once, at construction; the arena never grows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "page_pool.h"

namespace kvcached {

class HostArena {
 public:
  HostArena(std::shared_ptr<PagePool> pool, size_t block_bytes, int64_t num_planes, int64_t num_slots,
            int group = 0);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  PhysicalBackend& backend() { return pool_->backend(); }
  const PagePool* pool() const { return pool_.get(); }
  size_t block_bytes() const { return block_bytes_; }
  int64_t num_planes() const { return num_planes_; }
  int64_t num_slots() const { return num_slots_; }
  int group() const { return group_; }
  // Bytes of one slot (every plane) and of the whole arena.
  size_t slot_bytes() const { return block_bytes_ * static_cast<size_t>(num_planes_); }
  size_t total_bytes() const { return slot_bytes() * static_cast<size_t>(num_slots_); }
  bool pinned() const { return pinned_; }
  char* at(int64_t plane, int64_t slot) {
    return data_ + (static_cast<size_t>(plane) * static_cast<size_t>(num_slots_) +
                    static_cast<size_t>(slot)) * block_bytes_;
  }
  // Copies slot s (every plane, plane order) into dst, which holds slot_bytes() (tests).
  void read_slot(int64_t slot, void* dst);

 private:
  std::shared_ptr<PagePool> pool_;
  size_t block_bytes_;
  int64_t num_planes_;
  int64_t num_slots_;
  int group_;
  char* data_ = nullptr;
  bool pinned_ = false;  // page-locked (CUDA)
};

}  // namespace kvcached
