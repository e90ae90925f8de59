// KVBuffer: one tenant's fixed virtual KV range and its page table.
//
// Layout (row-major): (num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim),
// planes = 2 (K and V) for attention, 1 for a latent cache (MLA: one compressed latent per
// token, its values read from the same plane). Each (layer, plane) is one page-aligned
// range of num_pages * page_size bytes.
// Layers are split into KV cache groups (layer_group; one group unless given): each group
// has its own block-id space over its layers' planes, and KV page p of group g stands for
// the same offset in the planes * |g| planes of g's layers: mapping it takes planes * |g| physical
// pages from the pool. Block b of group g is therefore a different memory from block b of
// another group. Block 0 is every group's null block: never written, it reads zeros, so
// padded (and a sliding window's freed) block-table entries can point at it.
//
// A block's bytes need not divide the page (3 KV heads x 64 x bf16 x 16 tokens is 6 KiB
// against 2 MiB): blocks are laid out densely and a block that straddles two pages is
// never used (as kvcached does), so page p holds blocks
// [ceil(p * page / block), floor((p + 1) * page / block)). The virtual page count is
// rounded up so each plane is a whole number of both pages and blocks, which keeps the
// view one dense array.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "host_arena.h"
#include "page_pool.h"

namespace kvcached {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Who mapped a KV page. The block allocator (host API) and the map_pages / unmap_pages FFI
// ops each unmap only their own pages, so an op can never pull a page from under the
// allocator's blocks (or the reverse) and desynchronise its bookkeeping.
enum class PageOwner : uint8_t { kNone = 0, kAllocator = 1, kOp = 2 };
size_t dtype_size(DType t);
std::string dtype_name(DType t);

struct KVLayout {
  int64_t num_layers;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  DType dtype;
  int64_t num_pages;  // KV pages of virtual space
  // Each layer's KV cache group (ids 0..G-1, every id used); empty: one group.
  std::vector<int32_t> layer_group;
  int64_t planes_per_layer = 2;  // 2: K and V; 1: a latent plane (no separate V)

  // Valid once checked_block_bytes() accepted the layout (no product wraps).
  size_t row_bytes() const { return static_cast<size_t>(num_kv_heads * head_dim) * dtype_size(dtype); }
  size_t block_bytes() const { return row_bytes() * static_cast<size_t>(block_size); }
  // block_size * num_kv_heads * head_dim * itemsize, or 0 when the product overflows.
  size_t checked_block_bytes() const;
  int64_t num_planes() const { return planes_per_layer * num_layers; }
};

class KVBuffer {
 public:
  // device_ordinal: the ordinal XLA passes the FFI calls of the buffer's device (on the
  // CPU the global device id, on a GPU its local ordinal); local_id: the device's local
  // hardware id, which its DLPack export carries. -1: the backend's device (a CUDA
  // buffer's local id must be its backend's device).
  KVBuffer(std::shared_ptr<PagePool> pool, const KVLayout& layout, int device_ordinal = -1,
           int local_id = -1);
  ~KVBuffer();
  KVBuffer(const KVBuffer&) = delete;
  KVBuffer& operator=(const KVBuffer&) = delete;

  const KVLayout& layout() const { return layout_; }
  PagePool& pool() { return *pool_; }
  std::shared_ptr<PagePool> shared_pool() const { return pool_; }
  int device_ordinal() const { return device_ordinal_; }
  int local_id() const { return local_id_; }
  uintptr_t base() const { return base_; }
  size_t page_size() const { return page_size_; }
  size_t plane_bytes() const { return plane_bytes_; }
  size_t total_bytes() const { return plane_bytes_ * static_cast<size_t>(layout_.num_planes()); }
  // The most blocks one page holds (floor(page / block)); a page may hold one fewer.
  int64_t blocks_per_page() const { return blocks_per_page_; }
  int64_t num_blocks() const { return num_blocks_; }
  size_t block_bytes() const { return layout_.block_bytes(); }
  // A block lies wholly inside page_of_block(b) unless it straddles two pages.
  int64_t page_of_block(int64_t b) const {
    return static_cast<int64_t>(static_cast<size_t>(b) * block_bytes() / page_size_);
  }
  bool block_straddles(int64_t b) const {
    const size_t start = static_cast<size_t>(b) * block_bytes();
    return start / page_size_ != (start + block_bytes() - 1) / page_size_;
  }
  int64_t num_slots() const { return num_blocks() * layout_.block_size; }
  // Physical pages per KV page of the whole buffer (every plane) / of one group.
  size_t pages_per_kv_page() const { return static_cast<size_t>(layout_.num_planes()); }
  int num_groups() const { return static_cast<int>(group_planes_.size()); }
  size_t group_pages_per_kv_page(int group) const { return group_planes_.at(static_cast<size_t>(group)).size(); }
  // The planes (planes_per_layer * layer + plane) of one group, ascending (group checked by the caller).
  const std::vector<size_t>& group_planes(int group) const { return group_planes_.at(static_cast<size_t>(group)); }
  int group_of_layer(int64_t layer) const { return layer_group_[static_cast<size_t>(layer)]; }
  const std::vector<int32_t>& layer_groups() const { return layer_group_; }

  // Maps / unmaps KV pages of one group. All ids are validated before anything changes:
  // each must be in range, unique, and unmapped (map) or mapped by the same owner (unmap).
  // Throws Error / PoolExhausted.
  void map_pages(const int32_t* ids, size_t n, PageOwner owner = PageOwner::kAllocator, int group = 0);
  // synchronize=false: the caller waited for every read of the pages (a fence), so the
  // backend need not wait for the whole device (see PhysicalBackend::unmap).
  void unmap_pages(const int32_t* ids, size_t n, PageOwner owner = PageOwner::kAllocator,
                   bool synchronize = true, int group = 0);
  // The FFI ops' entry points (owner kOp; a buffer of one group only).
  void map_pages_op(const int32_t* ids, size_t n) {
    check_single_group("map_pages");
    map_pages(ids, n, PageOwner::kOp);
  }
  // The op's handler has waited for its stream (the ids travel through the host).
  void unmap_pages_op(const int32_t* ids, size_t n) {
    check_single_group("unmap_pages");
    unmap_pages(ids, n, PageOwner::kOp, false);
  }
  bool is_mapped(int64_t page, int group = 0) const;
  // KV pages mapped in one group (group -1: in all groups together).
  size_t num_mapped_pages(int group = -1) const;
  // Physical pages mapped, every group (sum of each group's KV pages x its planes).
  size_t num_mapped_physical_pages() const;
  std::vector<int32_t> mapped_pages(int group = 0) const;
  // Unmaps every page; later map calls fail. The virtual range stays reserved until the
  // last reference (views included) is dropped.
  void close();
  bool closed() const;

  // Readers/writers of the mapped memory hold this shared lock while they touch it;
  // map and unmap hold it exclusively, so a write never races with an unmap.
  std::shared_mutex& mutex() const { return mu_; }

  // Checks (under the caller's shared lock) a write of n slots into layers
  // [layer, layer + num_layers): every slot is -1 (skipped) or a slot of a mapped page
  // outside the null block. Returns an empty string when valid, else the reason.
  std::string check_write(int64_t layer, int64_t num_layers, const int32_t* slots, size_t n) const;
  // Checks (under the caller's shared lock) a read of `batch` sequences through block
  // tables (batch, nb): ctx_lens[b] in [0, nb * block_size], and every block holding one of
  // the first ctx_lens[b] tokens in range, not the null block, not straddling two pages,
  // in a mapped page. Returns an empty string when valid, else the reason. first_read
  // (optional, per sequence): the first position read (a sliding window's); blocks wholly
  // below it are not read and not checked (a window's freed blocks are the null block).
  std::string check_read(int64_t layer, const int32_t* tables, int64_t batch, int64_t nb,
                         const int32_t* ctx_lens, const int64_t* first_read = nullptr) const;
  // Checks block copies: src and dst in range and mapped, dst not the null block, no
  // destination repeated or also used as a source (so copy order never matters). Copies
  // move every plane: a buffer of one group only.
  // Block copies within one KV cache group (its planes only; blocks mapped in its pages).
  std::string check_copy(const int32_t* src, const int32_t* dst, size_t n, int64_t group) const;

  // State for kernels that validate on the device (write_kv_async): an error record
  // (int32 code, int32 slot; code 0 = none) followed by one byte per KV page, 1 while
  // mapped, per layer (byte layer * num_pages + page: a layer sees its group's pages);
  // set after a map and cleared before an unmap, so a kernel enqueued later sees the
  // host's view. Error codes: 1 out of range, 2 null block, 3 straddling block,
  // 4 unmapped page, 5 layer out of range.
  static constexpr size_t kStateHeader = 8;
  uintptr_t device_state() const { return state_; }
  // Reads the device error record and clears it (synchronous; call at a host sync point).
  std::pair<int32_t, int32_t> take_device_error();
  // One layer's device page map as the device sees it (tests).
  std::vector<uint8_t> device_page_map(int64_t layer = 0) const;

  // Host-memory implementations (the CUDA handlers launch kernels instead). They take
  // the shared lock and validate first; they throw Error on bad input.
  // key / value hold num_layers consecutive (n, heads, head_dim) arrays.
  void write_kv_host(int64_t layer, int64_t num_layers, const void* key, const void* value,
                     const int32_t* slots, size_t n);
  void copy_blocks_host(const int32_t* src, const int32_t* dst, size_t n, int64_t group);

  // The host tier (host_arena.h): copies blocks[i] of the arena's KV cache group (each of
  // the group's planes) to / from slot slots[i] of an arena made for this buffer and group
  // (its pool, block bytes, group and the group's plane count). Both validate first
  // (blocks in range, not the null block, not straddling, in pages the group has mapped;
  // slots in range; no block or slot twice) and throw Error, copying nothing. copy_to_host
  // enqueues (asynchronous on CUDA) and returns a ticket for copies_done(); an unmap
  // waits for every enqueued copy first. copy_from_host returns once its copies are done.
  uint64_t copy_to_host(const int32_t* blocks, const int64_t* slots, size_t n, HostArena& arena);
  void copy_from_host(HostArena& arena, const int64_t* slots, const int32_t* blocks, size_t n);
  bool copies_done(uint64_t ticket) { return pool_->backend().copies_done(ticket); }

 private:
  void check_open() const;
  void check_single_group(const char* what) const;
  void check_group(int group) const;
  void check_ids(const int32_t* ids, size_t n, bool want_mapped, PageOwner owner, int group) const;
  // Maps (or unmaps) page runs of one group plane by plane.
  void map_locked(const std::vector<int32_t>& sorted, const std::vector<PageHandle>& phys, int group);
  void unmap_locked(const std::vector<int32_t>& sorted, int group, bool synchronize = true);
  void set_page_map(const std::vector<int32_t>& sorted, uint8_t value, int group);
  size_t slot_index(int group, int64_t page) const {
    return static_cast<size_t>(group) * static_cast<size_t>(layout_.num_pages) + static_cast<size_t>(page);
  }
  bool page_mapped(int group, int64_t page) const { return !phys_[slot_index(group, page)].empty(); }
  // Block b (the index-th given) in range, not straddling, in a page the group has mapped;
  // else why ("<what><b> ...").
  std::string check_block(int64_t b, size_t index, const std::string& what, int group = 0) const;
  std::string check_host_copy(const int32_t* blocks, const int64_t* slots, size_t n,
                              const HostArena& arena) const;
  // Calls copy(arena_plane, plane, block, slot, count) per plane of a group for each run
  // of consecutive blocks going to consecutive slots (arena_plane: its index in the group).
  template <typename F>
  void for_each_host_run(int group, const int32_t* blocks, const int64_t* slots, size_t n, F copy) const;

  std::shared_ptr<PagePool> pool_;
  KVLayout layout_;
  size_t page_size_;
  size_t plane_bytes_;
  int64_t blocks_per_page_;
  int64_t num_blocks_;
  int device_ordinal_;
  int local_id_;
  uintptr_t base_ = 0;
  uintptr_t state_ = 0;  // see device_state()
  size_t state_bytes_ = 0;
  mutable std::shared_mutex mu_;
  bool closed_ = false;
  std::vector<int32_t> layer_group_;                // per layer
  std::vector<std::vector<size_t>> group_planes_;  // per group: its planes, ascending
  // phys_[slot_index(g, p)] holds the 2|g| physical pages of group g's KV page p (its
  // planes' order), empty if unmapped.
  std::vector<std::vector<PageHandle>> phys_;
  std::vector<PageOwner> owner_;  // per (group, KV page); kNone while unmapped
  std::vector<size_t> mapped_;    // KV pages mapped per group
};

}  // namespace kvcached
