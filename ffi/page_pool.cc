#include "page_pool.h"

#include <algorithm>
#include <string>

#include "errors.h"

namespace kvcached {

PagePool::PagePool(std::shared_ptr<PhysicalBackend> backend, size_t budget_pages,
                   size_t min_reserved, size_t max_reserved)
    : backend_(std::move(backend)), budget_(budget_pages) {
  if (budget_pages == 0) throw Error("the pool budget must be at least one page");
  if (min_reserved > max_reserved) {
    throw Error("min_reserved (" + std::to_string(min_reserved) + ") > max_reserved (" +
                std::to_string(max_reserved) + ")");
  }
  min_reserved_ = min_reserved;
  max_reserved_ = max_reserved;
  std::lock_guard<std::mutex> lock(mu_);
  rebalance_locked(/*fill=*/true);
}

PagePool::~PagePool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (refiller_.joinable()) refiller_.join();
  for (PageHandle p : reserved_) {
    try {
      backend_->release_page(p);
    } catch (...) {
    }
  }
}

std::vector<PageHandle> PagePool::acquire(size_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  if (in_use_ + n > budget_) {
    throw PoolExhausted("pool budget exhausted: " + std::to_string(n) + " pages requested, " +
                        std::to_string(budget_ - in_use_) + " of " + std::to_string(budget_) +
                        " free");
  }
  // A page being made joins the reserve first (and creating our own beside it could
  // pass the budget).
  cv_.wait(lock, [&] { return creating_ == 0 || reserved_.size() >= n; });
  std::vector<PageHandle> out;
  out.reserve(n);
  const size_t from_reserve = std::min(n, reserved_.size());
  out.assign(reserved_.end() - static_cast<std::ptrdiff_t>(from_reserve), reserved_.end());
  reserved_.resize(reserved_.size() - from_reserve);
  try {
    while (out.size() < n) {
      out.push_back(backend_->create_page());
      ++creates_;
    }
  } catch (...) {
    // Nothing leaks: what was taken goes back to the reserve (created pages included).
    reserved_.insert(reserved_.end(), out.begin(), out.end());
    rebalance_locked(/*fill=*/false);
    throw;
  }
  reuses_ += from_reserve;
  in_use_ += n;
  rebalance_locked(/*fill=*/false);
  return out;
}

void PagePool::release(const std::vector<PageHandle>& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pages.size() > in_use_) throw Error("release of more pages than are in use");
  in_use_ -= pages.size();
  reserved_.insert(reserved_.end(), pages.begin(), pages.end());
  refill_failed_ = false;  // memory came back: refilling may succeed again
  rebalance_locked(/*fill=*/false);
}

void PagePool::set_budget(size_t budget_pages) {
  std::lock_guard<std::mutex> lock(mu_);
  if (budget_pages < in_use_) {
    throw Error("budget of " + std::to_string(budget_pages) + " pages is below the " +
                std::to_string(in_use_) + " pages in use");
  }
  if (budget_pages == 0) throw Error("the pool budget must be at least one page");
  budget_ = budget_pages;
  rebalance_locked(/*fill=*/false);
}

void PagePool::set_reserve(size_t min_reserved, size_t max_reserved) {
  if (min_reserved > max_reserved) throw Error("min_reserved > max_reserved");
  std::lock_guard<std::mutex> lock(mu_);
  min_reserved_ = min_reserved;
  max_reserved_ = max_reserved;
  rebalance_locked(/*fill=*/true);
}

void PagePool::trim() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return creating_ == 0; });
  for (PageHandle p : reserved_) {
    backend_->release_page(p);
    ++releases_;
  }
  reserved_.clear();
}

void PagePool::rebalance_locked(bool fill) {
  const size_t room = budget_ - in_use_;
  const size_t high = std::min(max_reserved_, room);
  while (reserved_.size() > high) {
    backend_->release_page(reserved_.back());
    reserved_.pop_back();
    ++releases_;
  }
  const size_t low = std::min(min_reserved_, room);
  if (!fill) {
    if (reserved_.size() + creating_ < low && !refill_failed_) {
      if (!refiller_.joinable()) refiller_ = std::thread([this] { refill_loop(); });
      cv_.notify_all();
    }
    return;
  }
  while (reserved_.size() < low) {
    try {
      reserved_.push_back(backend_->create_page());
      ++creates_;
    } catch (const PoolExhausted&) {
      break;  // Pre-creating is an optimisation; acquire() reports real shortage.
    }
  }
}

void PagePool::refill_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] {
      return stop_ || (!refill_failed_ &&
                       reserved_.size() + creating_ < std::min(min_reserved_, budget_ - in_use_));
    });
    if (stop_) return;
    ++creating_;  // counted against the budget from now on
    lock.unlock();
    PageHandle page = 0;
    bool made = true;
    try {
      page = backend_->create_page();
    } catch (...) {
      made = false;  // an optimisation only: acquire() reports a real shortage
    }
    lock.lock();
    --creating_;
    if (made) {
      ++creates_;
      ++refills_;
      reserved_.push_back(page);
      rebalance_locked(/*fill=*/false);  // (a trim or a smaller budget meanwhile)
    } else {
      refill_failed_ = true;
    }
    cv_.notify_all();
  }
}

PoolStats PagePool::stats() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return creating_ == 0; });
  return PoolStats{backend_->page_size(), budget_,  in_use_,   reserved_.size(), min_reserved_,
                   max_reserved_,          creates_, refills_,  releases_,       reuses_,
                   backend_->committed_bytes()};
}

}  // namespace kvcached

namespace kvcached {

size_t PagePool::committed_bytes() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return creating_ == 0; });
  return backend_->committed_bytes();
}

}  // namespace kvcached
