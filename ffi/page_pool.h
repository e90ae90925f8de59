// PagePool: one physical budget shared by every KV buffer created from it.
//
// Pages are "in use" (mapped into some buffer) or "reserved" (created, unmapped, ready to
// be mapped into any buffer without a new create). The pool keeps between min_reserved
// and max_reserved reserved pages; beyond that, freed pages go back to the OS / driver.
// Invariant: in_use + reserved <= budget. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "backend.h"

namespace kvcached {

struct PoolStats {
  size_t page_size;
  size_t budget_pages;
  size_t in_use_pages;
  size_t reserved_pages;
  size_t min_reserved;
  size_t max_reserved;
  uint64_t creates;   // physical pages created so far
  uint64_t releases;  // physical pages given back so far
  uint64_t reuses;    // acquisitions served from reserved pages
};

class PagePool {
 public:
  PagePool(std::shared_ptr<PhysicalBackend> backend, size_t budget_pages, size_t min_reserved,
           size_t max_reserved);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  PhysicalBackend& backend() { return *backend_; }
  size_t page_size() const { return backend_->page_size(); }

  // Takes n pages, reserved ones first. Throws PoolExhausted (and takes nothing) when
  // in_use + n would exceed the budget or the backend runs out of memory.
  std::vector<PageHandle> acquire(size_t n);
  // Returns pages taken with acquire(); keeps up to max_reserved of them.
  void release(const std::vector<PageHandle>& pages);

  // Changes the budget. Throws Error if below the pages in use; trims reserved pages.
  void set_budget(size_t budget_pages);
  // Changes the reserve bounds and creates / releases pages to honour them.
  void set_reserve(size_t min_reserved, size_t max_reserved);
  // Gives every reserved page back.
  void trim();

  PoolStats stats() const;

 private:
  void rebalance_locked();

  std::shared_ptr<PhysicalBackend> backend_;
  mutable std::mutex mu_;
  size_t budget_;
  size_t min_reserved_;
  size_t max_reserved_;
  size_t in_use_ = 0;
  std::vector<PageHandle> reserved_;
  uint64_t creates_ = 0;
  uint64_t releases_ = 0;
  uint64_t reuses_ = 0;
};

}  // namespace kvcached
