// PagePool: one physical budget shared by every KV buffer created from it.
//
// Pages are "in use" (mapped into some buffer) or "reserved" (created, unmapped, ready to
// be mapped into any buffer without a new create). The pool keeps between min_reserved
// and max_reserved reserved pages; beyond that, freed pages go back to the OS / driver.
// Pages taken from the reserve are made again by a background thread, one at a time, so
// an acquire pays only for pages the reserve lacked (creating a page commits and zeroes
// it: ~1 ms a 2 MiB page on a host, a KV page being one per layer plane).
// Invariant: in_use + reserved + creating <= budget. Thread-safe.
#pragma once

#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
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
  uint64_t refills;   // of which by the background thread (not in an acquire)
  uint64_t releases;  // physical pages given back so far
  uint64_t reuses;    // acquisitions served from reserved pages
  size_t committed_bytes;  // the backend's, at the same moment
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
  // Gives every reserved page back (the reserve is made again at the next acquire or
  // release).
  void trim();

  // A consistent snapshot: taken when no page is being created.
  PoolStats stats() const;
  // The backend's committed bytes, consistent with stats() (no page being created).
  size_t committed_bytes() const;

 private:
  // Gives back reserved pages above max_reserved; refills up to min_reserved here when
  // `fill`, else by waking the background thread.
  void rebalance_locked(bool fill);
  void refill_loop();

  std::shared_ptr<PhysicalBackend> backend_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;  // a creation ended, or the reserve wants refilling
  std::thread refiller_;  // started by the first refill it is asked for
  bool stop_ = false;
  bool refill_failed_ = false;  // the backend refused a page: wait for a release
  size_t creating_ = 0;  // pages the background thread is creating (0 or 1)
  size_t budget_;
  size_t min_reserved_;
  size_t max_reserved_;
  size_t in_use_ = 0;
  std::vector<PageHandle> reserved_;
  uint64_t creates_ = 0;
  uint64_t refills_ = 0;
  uint64_t releases_ = 0;
  uint64_t reuses_ = 0;
};

}  // namespace kvcached
