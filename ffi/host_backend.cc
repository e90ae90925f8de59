// HostBackend: Linux virtual memory as the analog of CUDA VMM.
//
//   reserve   mmap(PROT_READ, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE): no memory is
//             committed and reads see the kernel's shared zero page.
//   create    a page-sized slot of one memfd, committed with fallocate.
//   map       mmap(MAP_FIXED|MAP_SHARED) of the memfd slot over the reserved range.
//   unmap     mmap(MAP_FIXED) of a fresh zero-reading anonymous mapping: atomic, so a
//             concurrent reader sees either the data or zeros, never a fault.
//   release   fallocate(PUNCH_HOLE) gives the memory back to the OS at once.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "backend.h"
#include "errors.h"

namespace kvcached {
namespace {

constexpr size_t kDefaultPageSize = size_t{2} << 20;

std::string errno_text(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

class HostBackend final : public PhysicalBackend {
 public:
  explicit HostBackend(size_t page_size) : page_size_(page_size) {
    const size_t os_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    granularity_ = os_page;
    if (page_size_ == 0 || page_size_ % os_page != 0) {
      throw Error("page_size must be a positive multiple of the OS page size (" +
                  std::to_string(os_page) + " bytes), got " + std::to_string(page_size_));
    }
    fd_ = memfd_create("jax_kvcached", MFD_CLOEXEC);
    if (fd_ < 0) throw BackendError(errno_text("memfd_create"));
  }

  ~HostBackend() override {
    if (fd_ >= 0) close(fd_);
  }

  std::string name() const override { return "host"; }
  DeviceKind device_kind() const override { return DeviceKind::kHost; }
  int device_id() const override { return 0; }
  size_t page_size() const override { return page_size_; }
  size_t granularity() const override { return granularity_; }

  uintptr_t reserve(size_t bytes) override {
    check_multiple(bytes, "reserve");
    // Over-reserve by one page and trim, so the base is page_size aligned.
    const size_t total = bytes + page_size_;
    void* p = mmap(nullptr, total, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw BackendError(errno_text("mmap(reserve)"));
    const uintptr_t raw = reinterpret_cast<uintptr_t>(p);
    const uintptr_t base = (raw + page_size_ - 1) / page_size_ * page_size_;
    if (base > raw) munmap(p, base - raw);
    const uintptr_t end = base + bytes;
    if (raw + total > end) munmap(reinterpret_cast<void*>(end), raw + total - end);
    return base;
  }

  void free_range(uintptr_t base, size_t bytes) override {
    if (munmap(reinterpret_cast<void*>(base), bytes) != 0) {
      throw BackendError(errno_text("munmap"));
    }
  }

  PageHandle create_page() override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = num_slots_++;
      if (ftruncate(fd_, static_cast<off_t>(num_slots_ * page_size_)) != 0) {
        --num_slots_;
        throw BackendError(errno_text("ftruncate(memfd)"));
      }
    }
    const off_t off = static_cast<off_t>(slot * page_size_);
    if (fallocate(fd_, 0, off, static_cast<off_t>(page_size_)) != 0) {
      const int err = errno;
      free_slots_.push_back(slot);
      errno = err;
      if (err == ENOSPC || err == ENOMEM) throw PoolExhausted(errno_text("host memory exhausted"));
      throw BackendError(errno_text("fallocate(memfd)"));
    }
    return static_cast<PageHandle>(slot);
  }

  void release_page(PageHandle page) override {
    std::lock_guard<std::mutex> lock(mu_);
    const off_t off = static_cast<off_t>(page * page_size_);
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off,
                  static_cast<off_t>(page_size_)) != 0) {
      throw BackendError(errno_text("fallocate(PUNCH_HOLE)"));
    }
    free_slots_.push_back(static_cast<size_t>(page));
  }

  size_t committed_bytes() const override {
    struct stat st;
    if (fstat(fd_, &st) != 0) throw BackendError(errno_text("fstat(memfd)"));
    return static_cast<size_t>(st.st_blocks) * 512;
  }

  void map(uintptr_t addr, const PageHandle* pages, size_t n) override {
    size_t i = 0;
    while (i < n) {
      // Coalesce runs of consecutive memfd slots into one mmap call.
      size_t j = i + 1;
      while (j < n && pages[j] == pages[j - 1] + 1) ++j;
      void* want = reinterpret_cast<void*>(addr + i * page_size_);
      void* p = mmap(want, (j - i) * page_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                     fd_, static_cast<off_t>(pages[i] * page_size_));
      if (p == MAP_FAILED) {
        const std::string msg = errno_text("mmap(map)");
        if (i > 0) unmap(addr, i);
        throw BackendError(msg);
      }
      i = j;
    }
  }

  void unmap(uintptr_t addr, size_t n, bool /*synchronize: host reads are synchronous*/ = true) override {
    void* p = mmap(reinterpret_cast<void*>(addr), n * page_size_, PROT_READ,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) throw BackendError(errno_text("mmap(unmap)"));
  }

  uintptr_t alloc_state(size_t bytes) override {
    void* p = std::calloc(bytes == 0 ? 1 : bytes, 1);
    if (p == nullptr) throw PoolExhausted("host memory exhausted (state)");
    return reinterpret_cast<uintptr_t>(p);
  }
  void free_state(uintptr_t p, size_t /*bytes*/) override { std::free(reinterpret_cast<void*>(p)); }
  void write_state(uintptr_t dst, const void* src, size_t bytes) override {
    std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  }
  void read_state(void* dst, uintptr_t src, size_t bytes) override {
    std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  }

  void* alloc_host(size_t bytes) override {
    // Committed up front (MAP_POPULATE), as page-locked memory is on CUDA: a copy into
    // the arena never takes page faults, and the bound is memory the tier really holds.
    void* p = mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw PoolExhausted(errno_text("mmap(host arena)"));
    return p;
  }
  void free_host(void* p, size_t bytes) override { munmap(p, bytes == 0 ? 1 : bytes); }
  // Host copies are synchronous: every ticket is done when it is handed out.
  void copy_to_host(void* dst, uintptr_t src, size_t bytes) override {
    std::memcpy(dst, reinterpret_cast<const void*>(src), bytes);
  }
  void copy_to_device(uintptr_t dst, const void* src, size_t bytes) override {
    std::memcpy(reinterpret_cast<void*>(dst), src, bytes);
  }
  uint64_t record_copies() override { return ++tickets_; }
  bool copies_done(uint64_t ticket) override { return ticket <= tickets_; }
  void sync_copies() override {}

 private:
  void check_multiple(size_t bytes, const char* what) const {
    if (bytes == 0 || bytes % page_size_ != 0) {
      throw Error(std::string(what) + ": size must be a positive multiple of page_size");
    }
  }

  size_t page_size_;
  size_t granularity_;
  int fd_ = -1;
  std::mutex mu_;
  size_t num_slots_ = 0;
  std::vector<size_t> free_slots_;
  std::atomic<uint64_t> tickets_{0};
};

}  // namespace

std::shared_ptr<PhysicalBackend> make_host_backend(size_t page_size) {
  return std::make_shared<HostBackend>(page_size == 0 ? kDefaultPageSize : page_size);
}

}  // namespace kvcached
