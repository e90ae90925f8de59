#include "kv_buffer.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>

#include "errors.h"

namespace kvcached {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  throw Error("unknown dtype");
}

std::string dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

size_t KVLayout::checked_block_bytes() const {
  uint64_t out = dtype_size(dtype);
  for (int64_t f : {num_kv_heads, head_dim, block_size}) {
    if (f <= 0 || __builtin_mul_overflow(out, static_cast<uint64_t>(f), &out)) return 0;
  }
  return static_cast<size_t>(out);
}

// Calls fn(first_page, count) for each run of consecutive ids in a sorted list.
template <typename F>
static void for_each_run(const std::vector<int32_t>& sorted, F fn);

KVBuffer::KVBuffer(std::shared_ptr<PagePool> pool, const KVLayout& layout, int device_ordinal, int local_id)
    : pool_(std::move(pool)), layout_(layout), page_size_(pool_->page_size()) {
  const int own = pool_->backend().device_id();
  if (device_ordinal < -1 || local_id < -1) {
    throw Error("device_ordinal and local_id must be >= 0 (or -1: the backend's device)");
  }
  if (local_id >= 0 && local_id != own && pool_->backend().device_kind() == DeviceKind::kCuda) {
    throw Error("a CUDA KV buffer lives on its backend's device " + std::to_string(own) + ", not " +
                std::to_string(local_id));
  }
  device_ordinal_ = device_ordinal < 0 ? own : device_ordinal;
  local_id_ = local_id < 0 ? own : local_id;
  if (layout.num_layers <= 0 || layout.num_kv_heads <= 0 || layout.head_dim <= 0 ||
      layout.block_size <= 0 || layout.num_pages <= 0) {
    throw Error("num_layers, num_kv_heads, head_dim, block_size and num_pages must be positive");
  }
  if (layout.planes_per_layer != 1 && layout.planes_per_layer != 2) {
    throw Error("planes_per_layer must be 2 (K and V) or 1 (a latent), got " +
                std::to_string(layout.planes_per_layer));
  }
  const size_t bb = layout.checked_block_bytes();
  if (bb == 0) {
    throw Error("block_size * num_kv_heads * head_dim * itemsize overflows 64 bits");
  }
  if (layout.num_layers > (int64_t{1} << 30)) throw Error("num_layers must be < 2**30");
  if (bb > page_size_) {
    throw Error("a KV block of " + std::to_string(bb) + " bytes (block_size * num_kv_heads * "
                "head_dim * itemsize) is larger than the page size of " +
                std::to_string(page_size_) + " bytes");
  }
  // Round the virtual pages up so a plane holds a whole number of blocks (dense view).
  const int64_t period = static_cast<int64_t>(bb / std::gcd(bb, page_size_));
  layout_.num_pages = (layout.num_pages + period - 1) / period * period;
  blocks_per_page_ = static_cast<int64_t>(page_size_ / bb);
  size_t total = 0;
  if (__builtin_mul_overflow(static_cast<size_t>(layout_.num_pages), page_size_, &plane_bytes_) ||
      __builtin_mul_overflow(plane_bytes_, static_cast<size_t>(layout_.num_planes()), &total)) {
    throw Error("num_pages * page_size * planes * num_layers overflows 64 bits");
  }
  num_blocks_ = static_cast<int64_t>(plane_bytes_ / bb);
  // The groups: every layer in one, ids dense from 0.
  const auto layers = static_cast<size_t>(layout.num_layers);
  if (layout.layer_group.empty()) {
    layer_group_.assign(layers, 0);
  } else if (layout.layer_group.size() != layers) {
    throw Error("layer_group has " + std::to_string(layout.layer_group.size()) + " entries for " +
                std::to_string(layers) + " layers");
  } else {
    layer_group_ = layout.layer_group;
  }
  for (size_t l = 0; l < layers; ++l) {
    const int32_t g = layer_group_[l];
    if (g < 0 || g >= layout.num_layers) {
      throw Error("layer " + std::to_string(l) + "'s group " + std::to_string(g) + " out of range [0, " +
                  std::to_string(layout.num_layers) + ")");
    }
    if (static_cast<size_t>(g) >= group_planes_.size()) group_planes_.resize(static_cast<size_t>(g) + 1);
    for (int64_t x = 0; x < layout.planes_per_layer; ++x) {
      group_planes_[static_cast<size_t>(g)].push_back(static_cast<size_t>(layout.planes_per_layer) * l +
                                                      static_cast<size_t>(x));
    }
  }
  for (size_t g = 0; g < group_planes_.size(); ++g) {
    if (group_planes_[g].empty()) throw Error("KV cache group " + std::to_string(g) + " has no layer");
  }
  layout_.layer_group = layer_group_;
  const size_t slots = group_planes_.size() * static_cast<size_t>(layout_.num_pages);
  size_t map_bytes = 0;
  if (__builtin_mul_overflow(layers, static_cast<size_t>(layout_.num_pages), &map_bytes)) {
    throw Error("num_layers * num_pages overflows 64 bits");
  }
  base_ = pool_->backend().reserve(total_bytes());
  try {
    state_bytes_ = kStateHeader + map_bytes;
    state_ = pool_->backend().alloc_state(state_bytes_);
  } catch (...) {
    pool_->backend().free_range(base_, total_bytes());
    throw;
  }
  phys_.resize(slots);
  owner_.assign(slots, PageOwner::kNone);
  mapped_.assign(group_planes_.size(), 0);
}

KVBuffer::~KVBuffer() {
  try {
    close();
    pool_->backend().free_state(state_, state_bytes_);
    pool_->backend().free_range(base_, total_bytes());
  } catch (...) {
  }
}

void KVBuffer::set_page_map(const std::vector<int32_t>& sorted, uint8_t value, int group) {
  PhysicalBackend& be = pool_->backend();
  std::vector<uint8_t> bytes;
  const auto pages = static_cast<size_t>(layout_.num_pages);
  for (size_t l = 0; l < layer_group_.size(); ++l) {
    if (layer_group_[l] != group) continue;
    for_each_run(sorted, [&](size_t first, size_t count) {
      bytes.assign(count, value);
      be.write_state(state_ + kStateHeader + l * pages + static_cast<size_t>(sorted[first]), bytes.data(), count);
    });
  }
}

std::pair<int32_t, int32_t> KVBuffer::take_device_error() {
  std::shared_lock<std::shared_mutex> lock(mu_);
  int32_t rec[2] = {0, 0};
  pool_->backend().read_state(rec, state_, sizeof(rec));
  if (rec[0] != 0) {
    const int32_t zero[2] = {0, 0};
    pool_->backend().write_state(state_, zero, sizeof(zero));
  }
  return {rec[0], rec[1]};
}

std::vector<uint8_t> KVBuffer::device_page_map(int64_t layer) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (layer < 0 || layer >= layout_.num_layers) throw Error("layer out of range");
  std::vector<uint8_t> out(static_cast<size_t>(layout_.num_pages));
  pool_->backend().read_state(out.data(), state_ + kStateHeader + static_cast<size_t>(layer) * out.size(),
                              out.size());
  return out;
}

void KVBuffer::check_open() const {
  if (closed_) throw Error("the KV cache is closed");
}

void KVBuffer::check_single_group(const char* what) const {
  if (num_groups() != 1) {
    throw Error(std::string(what) + " moves every plane: it needs a KV cache of one group, this one has " +
                std::to_string(num_groups()));
  }
}

void KVBuffer::check_group(int group) const {
  if (group < 0 || group >= num_groups()) {
    throw Error("KV cache group " + std::to_string(group) + " out of range [0, " + std::to_string(num_groups()) +
                ")");
  }
}

static const char* owner_name(PageOwner o) {
  return o == PageOwner::kOp ? "a map_pages op" : "the block allocator";
}

void KVBuffer::check_ids(const int32_t* ids, size_t n, bool want_mapped, PageOwner owner, int group) const {
  check_group(group);
  std::vector<bool> seen(static_cast<size_t>(layout_.num_pages), false);
  for (size_t i = 0; i < n; ++i) {
    const int64_t p = ids[i];
    if (p < 0 || p >= layout_.num_pages) {
      throw Error("page id " + std::to_string(p) + " out of range [0, " +
                  std::to_string(layout_.num_pages) + ")");
    }
    if (seen[static_cast<size_t>(p)]) throw Error("page id " + std::to_string(p) + " given twice");
    seen[static_cast<size_t>(p)] = true;
    const bool mapped = page_mapped(group, p);
    if (mapped != want_mapped) {
      throw Error("page " + std::to_string(p) + (mapped ? " is already mapped" : " is not mapped") +
                  (num_groups() > 1 ? " in group " + std::to_string(group) : std::string()));
    }
    const PageOwner has = owner_[slot_index(group, p)];
    if (want_mapped && has != owner) {
      throw Error("page " + std::to_string(p) + " was mapped by " + owner_name(has) +
                  " and can only be unmapped by it" +
                  (has == PageOwner::kAllocator ? " (free its blocks instead)" : ""));
    }
  }
}

// Calls fn(first_page, count) for each run of consecutive ids in a sorted list.
template <typename F>
static void for_each_run(const std::vector<int32_t>& sorted, F fn) {
  size_t i = 0;
  while (i < sorted.size()) {
    size_t j = i + 1;
    while (j < sorted.size() && sorted[j] == sorted[j - 1] + 1) ++j;
    fn(i, j - i);
    i = j;
  }
}

void KVBuffer::map_locked(const std::vector<int32_t>& sorted, const std::vector<PageHandle>& phys, int group) {
  const std::vector<size_t>& planes = group_planes_[static_cast<size_t>(group)];
  const size_t np = planes.size();
  PhysicalBackend& be = pool_->backend();
  std::vector<PageHandle> run;
  size_t done = 0;
  try {
    for (; done < np; ++done) {
      const size_t plane = planes[done];
      for_each_run(sorted, [&](size_t first, size_t count) {
        run.clear();
        for (size_t k = 0; k < count; ++k) run.push_back(phys[(first + k) * np + done]);
        be.map(base_ + plane * plane_bytes_ + static_cast<size_t>(sorted[first]) * page_size_,
               run.data(), count);
      });
    }
  } catch (...) {
    // Roll back whole planes already mapped; the failing plane rolled back its own runs
    // only partially, so unmapping it fully (zero backing) is safe as well.
    for (size_t i = 0; i <= done && i < np; ++i) {
      for_each_run(sorted, [&](size_t first, size_t count) {
        be.unmap(base_ + planes[i] * plane_bytes_ + static_cast<size_t>(sorted[first]) * page_size_, count);
      });
    }
    throw;
  }
}

void KVBuffer::map_pages(const int32_t* ids, size_t n, PageOwner owner, int group) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  check_open();
  check_ids(ids, n, /*want_mapped=*/false, owner, group);
  if (n == 0) return;
  std::vector<int32_t> sorted(ids, ids + n);
  std::sort(sorted.begin(), sorted.end());
  const size_t planes = group_pages_per_kv_page(group);
  std::vector<PageHandle> phys = pool_->acquire(n * planes);
  try {
    map_locked(sorted, phys, group);
  } catch (...) {
    pool_->release(phys);
    throw;
  }
  for (size_t k = 0; k < n; ++k) {
    const size_t at = slot_index(group, sorted[k]);
    phys_[at].assign(phys.begin() + static_cast<std::ptrdiff_t>(k * planes),
                     phys.begin() + static_cast<std::ptrdiff_t>((k + 1) * planes));
    owner_[at] = owner;
  }
  mapped_[static_cast<size_t>(group)] += n;
  // Last (a failure leaves the device map saying unmapped: the safe side): kernels
  // enqueued from now on may write these pages.
  set_page_map(sorted, 1, group);
}

void KVBuffer::unmap_locked(const std::vector<int32_t>& sorted, int group, bool synchronize) {
  const std::vector<size_t>& planes = group_planes_[static_cast<size_t>(group)];
  PhysicalBackend& be = pool_->backend();
  be.sync_copies();  // a host-tier copy out of these pages finishes before they go
  set_page_map(sorted, 0, group);  // before the unmap: a later kernel skips and reports them
  for (size_t plane : planes) {
    for_each_run(sorted, [&](size_t first, size_t count) {
      be.unmap(base_ + plane * plane_bytes_ + static_cast<size_t>(sorted[first]) * page_size_, count,
               synchronize);
      synchronize = false;  // once is enough
    });
  }
  std::vector<PageHandle> phys;
  phys.reserve(sorted.size() * planes.size());
  for (int32_t p : sorted) {
    const size_t at = slot_index(group, p);
    auto& v = phys_[at];
    phys.insert(phys.end(), v.begin(), v.end());
    v.clear();
    owner_[at] = PageOwner::kNone;
  }
  mapped_[static_cast<size_t>(group)] -= sorted.size();
  pool_->release(phys);
}

void KVBuffer::unmap_pages(const int32_t* ids, size_t n, PageOwner owner, bool synchronize, int group) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  check_open();
  check_ids(ids, n, /*want_mapped=*/true, owner, group);
  if (n == 0) return;
  std::vector<int32_t> sorted(ids, ids + n);
  std::sort(sorted.begin(), sorted.end());
  unmap_locked(sorted, group, synchronize);
}

bool KVBuffer::is_mapped(int64_t page, int group) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  check_group(group);
  if (page < 0 || page >= layout_.num_pages) throw Error("page id out of range");
  return page_mapped(group, page);
}

size_t KVBuffer::num_mapped_pages(int group) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (group < 0) return std::accumulate(mapped_.begin(), mapped_.end(), size_t{0});
  check_group(group);
  return mapped_[static_cast<size_t>(group)];
}

size_t KVBuffer::num_mapped_physical_pages() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  size_t out = 0;
  for (size_t g = 0; g < mapped_.size(); ++g) out += mapped_[g] * group_planes_[g].size();
  return out;
}

std::vector<int32_t> KVBuffer::mapped_pages(int group) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  check_group(group);
  std::vector<int32_t> out;
  for (int64_t p = 0; p < layout_.num_pages; ++p) {
    if (page_mapped(group, p)) out.push_back(static_cast<int32_t>(p));
  }
  return out;
}

void KVBuffer::close() {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (closed_) return;
  for (int g = 0; g < num_groups(); ++g) {
    std::vector<int32_t> all;
    for (int64_t p = 0; p < layout_.num_pages; ++p) {
      if (page_mapped(g, p)) all.push_back(static_cast<int32_t>(p));
    }
    if (!all.empty()) unmap_locked(all, g);
  }
  closed_ = true;
}

bool KVBuffer::closed() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return closed_;
}

std::string KVBuffer::check_write(int64_t layer, int64_t num_layers, const int32_t* slots,
                                  size_t n) const {
  if (closed_) return "the KV cache is closed";
  if (layer < 0 || num_layers < 1 || layer + num_layers > layout_.num_layers) {
    return "layer " + std::to_string(layer) +
           (num_layers > 1 ? " (+" + std::to_string(num_layers) + " layers)" : std::string()) +
           " out of range [0, " + std::to_string(layout_.num_layers) + ")";
  }
  const int group = group_of_layer(layer);
  for (int64_t j = 1; j < num_layers; ++j) {
    if (group_of_layer(layer + j) != group) {
      return "layers " + std::to_string(layer) + ".." + std::to_string(layer + num_layers - 1) +
             " span several KV cache groups (their slots differ): write each group apart";
    }
  }
  const int64_t total = num_slots();
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = slots[i];
    if (s == -1) continue;
    if (s < 0 || s >= total) {
      return "slot " + std::to_string(s) + " (index " + std::to_string(i) + ") out of range [0, " +
             std::to_string(total) + "); use -1 to skip a padded token";
    }
    const int64_t b = s / layout_.block_size;
    if (b == 0) {
      return "slot " + std::to_string(s) + " (index " + std::to_string(i) +
             ") is in the null block 0, which is never written";
    }
    if (block_straddles(b)) {
      return "slot " + std::to_string(s) + " (index " + std::to_string(i) + ") is in block " +
             std::to_string(b) + ", which straddles two pages and is never used";
    }
    if (!page_mapped(group, page_of_block(b))) {
      return "slot " + std::to_string(s) + " (index " + std::to_string(i) + ") is in unmapped page " +
             std::to_string(page_of_block(b)) +
             (num_groups() > 1 ? " of group " + std::to_string(group) : std::string());
    }
  }
  return {};
}

std::string KVBuffer::check_read(int64_t layer, const int32_t* tables, int64_t batch, int64_t nb,
                                 const int32_t* ctx_lens, const int64_t* first_read) const {
  if (closed_) return "the KV cache is closed";
  if (layer < 0 || layer >= layout_.num_layers) {
    return "layer " + std::to_string(layer) + " out of range [0, " + std::to_string(layout_.num_layers) + ")";
  }
  const int64_t bs = layout_.block_size;
  const int group = group_of_layer(layer);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t ctx = ctx_lens[b];
    if (ctx < 0 || ctx > nb * bs) {
      return "ctx_lens[" + std::to_string(b) + "] = " + std::to_string(ctx) + " out of range [0, " +
             std::to_string(nb * bs) + "] (the block table's width x block size)";
    }
    const int64_t lo = first_read != nullptr ? std::max<int64_t>(0, first_read[b]) / bs : 0;
    for (int64_t i = lo; i < (ctx + bs - 1) / bs; ++i) {
      const int64_t blk = tables[b * nb + i];
      const std::string where = "block_tables[" + std::to_string(b) + ", " + std::to_string(i) + "] = " +
                                std::to_string(blk);
      if (blk <= 0 || blk >= num_blocks()) return where + " is not a block of this cache";
      if (block_straddles(blk)) return where + " straddles two pages";
      if (!page_mapped(group, page_of_block(blk))) return where + " is in an unmapped page";
    }
  }
  return {};
}

std::string KVBuffer::check_copy(const int32_t* src, const int32_t* dst, size_t n, int64_t group) const {
  if (closed_) return "the KV cache is closed";
  if (group < 0 || group >= num_groups()) {
    return "KV cache group " + std::to_string(group) + " out of range [0, " + std::to_string(num_groups()) + ")";
  }
  std::vector<int32_t> dsts(dst, dst + n), srcs(src, src + n);
  std::sort(dsts.begin(), dsts.end());
  std::sort(srcs.begin(), srcs.end());
  for (size_t i = 0; i + 1 < n; ++i) {
    if (dsts[i] == dsts[i + 1]) return "destination block " + std::to_string(dsts[i]) + " given twice";
  }
  for (int32_t d : dsts) {
    if (std::binary_search(srcs.begin(), srcs.end(), d)) {
      return "block " + std::to_string(d) + " is both a source and a destination";
    }
  }
  for (size_t i = 0; i < n; ++i) {
    for (int which = 0; which < 2; ++which) {
      const int64_t b = which == 0 ? src[i] : dst[i];
      if (which == 1 && b == 0) return "destination block 0 is the null block";
      std::string err = check_block(b, i, which == 0 ? "source block " : "destination block ", static_cast<int>(group));
      if (!err.empty()) return err;
    }
  }
  return {};
}

std::string KVBuffer::check_block(int64_t b, size_t index, const std::string& what, int group) const {
  const int64_t nb = num_blocks();
  if (b < 0 || b >= nb) {
    return what + std::to_string(b) + " (index " + std::to_string(index) + ") out of range [0, " +
           std::to_string(nb) + ")";
  }
  if (block_straddles(b)) return what + std::to_string(b) + " straddles two pages";
  if (!page_mapped(group, page_of_block(b))) {
    return what + std::to_string(b) + " is in an unmapped page";
  }
  return {};
}

void KVBuffer::write_kv_host(int64_t layer, int64_t num_layers, const void* key, const void* value,
                             const int32_t* slots, size_t n) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  const std::string err = check_write(layer, num_layers, slots, n);
  if (!err.empty()) throw Error(err);
  const size_t row = layout_.row_bytes();
  for (int64_t j = 0; j < num_layers; ++j) {
    auto* k_plane = reinterpret_cast<char*>(
        base_ + static_cast<size_t>(layout_.planes_per_layer * (layer + j)) * plane_bytes_);
    char* v_plane = layout_.planes_per_layer == 2 ? k_plane + plane_bytes_ : nullptr;  // 1: no V
    const auto* k = static_cast<const char*>(key) + static_cast<size_t>(j) * n * row;
    const auto* v = static_cast<const char*>(value) + static_cast<size_t>(j) * n * row;
    for (size_t i = 0; i < n; ++i) {
      if (slots[i] < 0) continue;
      const size_t off = static_cast<size_t>(slots[i]) * row;
      std::memcpy(k_plane + off, k + i * row, row);
      if (v_plane != nullptr) std::memcpy(v_plane + off, v + i * row, row);
    }
  }
}

void KVBuffer::copy_blocks_host(const int32_t* src, const int32_t* dst, size_t n, int64_t group) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  const std::string err = check_copy(src, dst, n, group);
  if (!err.empty()) throw Error(err);
  const size_t bb = layout_.block_bytes();
  for (size_t plane : group_planes(static_cast<int>(group))) {
    char* p = reinterpret_cast<char*>(base_ + static_cast<size_t>(plane) * plane_bytes_);
    for (size_t i = 0; i < n; ++i) {
      std::memmove(p + static_cast<size_t>(dst[i]) * bb, p + static_cast<size_t>(src[i]) * bb, bb);
    }
  }
}

std::string KVBuffer::check_host_copy(const int32_t* blocks, const int64_t* slots, size_t n,
                                      const HostArena& arena) const {
  if (closed_) return "the KV cache is closed";
  const int g = arena.group();
  if (g < 0 || g >= num_groups()) {
    return "the host arena's KV cache group " + std::to_string(g) + " is not one of this buffer's " +
           std::to_string(num_groups());
  }
  if (arena.pool() != pool_.get() || arena.block_bytes() != block_bytes() ||
      static_cast<size_t>(arena.num_planes()) != group_pages_per_kv_page(g)) {
    return "the host arena was not made for this KV buffer (its pool, block bytes or planes differ)";
  }
  std::vector<int64_t> seen_blocks(blocks, blocks + n), seen_slots(slots, slots + n);
  std::sort(seen_blocks.begin(), seen_blocks.end());
  std::sort(seen_slots.begin(), seen_slots.end());
  for (size_t i = 0; i + 1 < n; ++i) {
    if (seen_blocks[i] == seen_blocks[i + 1]) return "block " + std::to_string(seen_blocks[i]) + " given twice";
    if (seen_slots[i] == seen_slots[i + 1]) return "host slot " + std::to_string(seen_slots[i]) + " given twice";
  }
  for (size_t i = 0; i < n; ++i) {
    if (blocks[i] == 0) return "block 0 is the null block";
    std::string err = check_block(blocks[i], i, "block ", g);
    if (!err.empty()) return err;
    if (slots[i] < 0 || slots[i] >= arena.num_slots()) {
      return "host slot " + std::to_string(slots[i]) + " (index " + std::to_string(i) +
             ") out of range [0, " + std::to_string(arena.num_slots()) + ")";
    }
  }
  return "";
}

template <typename F>
void KVBuffer::for_each_host_run(int group, const int32_t* blocks, const int64_t* slots, size_t n,
                                 F copy) const {
  const std::vector<size_t>& planes = group_planes_[static_cast<size_t>(group)];
  size_t i = 0;
  while (i < n) {
    size_t j = i + 1;
    while (j < n && blocks[j] == blocks[j - 1] + 1 && slots[j] == slots[j - 1] + 1) ++j;
    for (size_t a = 0; a < planes.size(); ++a) {
      copy(static_cast<int64_t>(a), static_cast<int64_t>(planes[a]), blocks[i], slots[i], j - i);
    }
    i = j;
  }
}

uint64_t KVBuffer::copy_to_host(const int32_t* blocks, const int64_t* slots, size_t n, HostArena& arena) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  const std::string err = check_host_copy(blocks, slots, n, arena);
  if (!err.empty()) throw Error("copy to host: " + err);
  PhysicalBackend& be = pool_->backend();
  const size_t bb = block_bytes();
  for_each_host_run(arena.group(), blocks, slots, n,
                    [&](int64_t a, int64_t plane, int64_t block, int64_t slot, size_t count) {
    be.copy_to_host(arena.at(a, slot),
                    base_ + static_cast<size_t>(plane) * plane_bytes_ + static_cast<size_t>(block) * bb,
                    count * bb);
  });
  return be.record_copies();
}

void KVBuffer::copy_from_host(HostArena& arena, const int64_t* slots, const int32_t* blocks, size_t n) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  const std::string err = check_host_copy(blocks, slots, n, arena);
  if (!err.empty()) throw Error("copy from host: " + err);
  PhysicalBackend& be = pool_->backend();
  const size_t bb = block_bytes();
  for_each_host_run(arena.group(), blocks, slots, n,
                    [&](int64_t a, int64_t plane, int64_t block, int64_t slot, size_t count) {
    be.copy_to_device(base_ + static_cast<size_t>(plane) * plane_bytes_ + static_cast<size_t>(block) * bb,
                      arena.at(a, slot), count * bb);
  });
  be.sync_copies();
}

}  // namespace kvcached
