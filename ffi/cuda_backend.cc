// CudaBackend: the CUDA driver VMM API (cuMemAddressReserve / Create / Map / SetAccess /
// Unmap / Release). libcuda is opened at run time (never linked).
//
// Unmapped ranges are backed by one shared, zero-filled physical page so that stray or
// padded reads never fault; writes are validated on the host before any kernel runs,
// so the zero page is never written. Physical pages are created ahead by the PagePool
// (cuMemCreate is the slow call); access is set once per contiguous run of pages.
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "backend.h"
#include "cuda_driver.h"
#include "errors.h"

namespace kvcached {

namespace {

template <typename F>
void load(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr) throw BackendError(std::string("libcuda has no symbol ") + name);
}

CudaDriver load_driver() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw BackendError("CUDA driver (libcuda.so.1) not found");
  CudaDriver d{};
  load(lib, d.cuInit, "cuInit");
  load(lib, d.cuGetErrorString, "cuGetErrorString");
  load(lib, d.cuDeviceGet, "cuDeviceGet");
  load(lib, d.cuDeviceGetCount, "cuDeviceGetCount");
  load(lib, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  load(lib, d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  load(lib, d.cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  load(lib, d.cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  load(lib, d.cuCtxSynchronize, "cuCtxSynchronize");
  load(lib, d.cuMemGetInfo, "cuMemGetInfo_v2");
  load(lib, d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  load(lib, d.cuMemAddressReserve, "cuMemAddressReserve");
  load(lib, d.cuMemAddressFree, "cuMemAddressFree");
  load(lib, d.cuMemCreate, "cuMemCreate");
  load(lib, d.cuMemRelease, "cuMemRelease");
  load(lib, d.cuMemMap, "cuMemMap");
  load(lib, d.cuMemUnmap, "cuMemUnmap");
  load(lib, d.cuMemSetAccess, "cuMemSetAccess");
  load(lib, d.cuMemsetD8, "cuMemsetD8_v2");
  load(lib, d.cuMemAlloc, "cuMemAlloc_v2");
  load(lib, d.cuMemFree, "cuMemFree_v2");
  load(lib, d.cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  load(lib, d.cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  load(lib, d.cuMemHostAlloc, "cuMemHostAlloc");
  load(lib, d.cuMemFreeHost, "cuMemFreeHost");
  load(lib, d.cuStreamCreate, "cuStreamCreate");
  load(lib, d.cuStreamDestroy, "cuStreamDestroy_v2");
  load(lib, d.cuStreamSynchronize, "cuStreamSynchronize");
  load(lib, d.cuEventCreate, "cuEventCreate");
  load(lib, d.cuEventDestroy, "cuEventDestroy_v2");
  load(lib, d.cuEventRecord, "cuEventRecord");
  load(lib, d.cuEventQuery, "cuEventQuery");
  load(lib, d.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  load(lib, d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  const CUresult r = d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    if (d.cuGetErrorString(r, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown error";
    throw BackendError(std::string("cuInit failed: ") + msg);
  }
  return d;
}

// Makes the device's primary context current for the scope.
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx) { cuda_check(cuda_driver().cuCtxPushCurrent(ctx), "cuCtxPushCurrent"); }
  ~ScopedContext() {
    CUcontext prev;
    cuda_driver().cuCtxPopCurrent(&prev);
  }
};

class CudaBackend final : public PhysicalBackend {
 public:
  CudaBackend(size_t page_size, int device) : device_id_(device) {
    const CudaDriver& d = cuda_driver();
    int count = 0;
    cuda_check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (device < 0 || device >= count) {
      throw BackendError("CUDA device " + std::to_string(device) + " out of range (" +
                         std::to_string(count) + " devices)");
    }
    cuda_check(d.cuDeviceGet(&dev_, device), "cuDeviceGet");
    cuda_check(d.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    ScopedContext scope(ctx_);
    prop_ = {};
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    cuda_check(d.cuMemGetAllocationGranularity(&granularity_, &prop_,
                                               CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity");
    page_size_ = page_size == 0 ? (size_t{2} << 20) : page_size;
    if (page_size_ % granularity_ != 0) {
      throw Error("page_size " + std::to_string(page_size_) +
                  " is not a multiple of the CUDA allocation granularity " +
                  std::to_string(granularity_));
    }
    access_ = {};
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // The shared zero page behind every unmapped range.
    cuda_check(d.cuMemCreate(&zero_page_, page_size_, &prop_, 0), "cuMemCreate(zero page)");
    CUdeviceptr tmp;
    cuda_check(d.cuMemAddressReserve(&tmp, page_size_, page_size_, 0, 0), "cuMemAddressReserve");
    cuda_check(d.cuMemMap(tmp, page_size_, 0, zero_page_, 0), "cuMemMap(zero page)");
    cuda_check(d.cuMemSetAccess(tmp, page_size_, &access_, 1), "cuMemSetAccess");
    cuda_check(d.cuMemsetD8(tmp, 0, page_size_), "cuMemsetD8");
    cuda_check(d.cuCtxSynchronize(), "cuCtxSynchronize");
    cuda_check(d.cuMemUnmap(tmp, page_size_), "cuMemUnmap");
    cuda_check(d.cuMemAddressFree(tmp, page_size_), "cuMemAddressFree");
  }

  ~CudaBackend() override {
    const CudaDriver& d = cuda_driver();
    if (stream_ != nullptr) {
      ScopedContext scope(ctx_);
      d.cuStreamSynchronize(stream_);
      for (auto& e : pending_) d.cuEventDestroy(e.second);
      d.cuStreamDestroy(stream_);
    }
    d.cuMemRelease(zero_page_);
    d.cuDevicePrimaryCtxRelease(dev_);
  }

  std::string name() const override { return "cuda"; }
  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  int device_id() const override { return device_id_; }
  size_t page_size() const override { return page_size_; }
  size_t granularity() const override { return granularity_; }

  uintptr_t reserve(size_t bytes) override {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    CUdeviceptr base;
    cuda_check(d.cuMemAddressReserve(&base, bytes, page_size_, 0, 0), "cuMemAddressReserve");
    map_zero(base, bytes / page_size_);
    return static_cast<uintptr_t>(base);
  }

  void free_range(uintptr_t base, size_t bytes) override {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    cuda_check(d.cuCtxSynchronize(), "cuCtxSynchronize");
    cuda_check(d.cuMemUnmap(base, bytes), "cuMemUnmap");
    cuda_check(d.cuMemAddressFree(base, bytes), "cuMemAddressFree");
  }

  PageHandle create_page() override {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    CUmemGenericAllocationHandle h;
    const CUresult r = d.cuMemCreate(&h, page_size_, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) throw PoolExhausted("CUDA device memory exhausted (cuMemCreate)");
    cuda_check(r, "cuMemCreate");
    ++live_pages_;
    return static_cast<PageHandle>(h);
  }

  void release_page(PageHandle page) override {
    ScopedContext scope(ctx_);
    cuda_check(cuda_driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page)),
               "cuMemRelease");
    --live_pages_;
  }

  size_t committed_bytes() const override {
    return (live_pages_.load() + 1) * page_size_;  // + the zero page
  }

  void map(uintptr_t addr, const PageHandle* pages, size_t n) override {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    const size_t bytes = n * page_size_;
    cuda_check(d.cuMemUnmap(addr, bytes), "cuMemUnmap(zero page)");
    for (size_t i = 0; i < n; ++i) {
      const CUresult r = d.cuMemMap(addr + i * page_size_, page_size_, 0,
                                    static_cast<CUmemGenericAllocationHandle>(pages[i]), 0);
      if (r != CUDA_SUCCESS) {
        if (i > 0) d.cuMemUnmap(addr, i * page_size_);
        map_zero(addr, n);
        cuda_check(r, "cuMemMap");
      }
    }
    cuda_check(d.cuMemSetAccess(addr, bytes, &access_, 1), "cuMemSetAccess");
  }

  void unmap(uintptr_t addr, size_t n, bool synchronize = true) override {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    // Work enqueued before this call may still read the range: let it finish first,
    // unless the caller already waited for the reads (a fence on their stream).
    if (synchronize) cuda_check(d.cuCtxSynchronize(), "cuCtxSynchronize");
    cuda_check(d.cuMemUnmap(addr, n * page_size_), "cuMemUnmap");
    map_zero(addr, n);
  }

  uintptr_t alloc_state(size_t bytes) override {
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    CUdeviceptr p;
    const CUresult r = d.cuMemAlloc(&p, bytes == 0 ? 1 : bytes);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) throw PoolExhausted("CUDA device memory exhausted (state)");
    cuda_check(r, "cuMemAlloc");
    cuda_check(d.cuMemsetD8(p, 0, bytes == 0 ? 1 : bytes), "cuMemsetD8");
    return static_cast<uintptr_t>(p);
  }

  // Retired, not freed (see PhysicalBackend::free_state): the bytes are zeroed, so a
  // replayed graph's kernel finds every page unmapped and never touches the buffer's
  // (freed, maybe reused) range. Costs the page map's bytes per KV buffer closed.
  void free_state(uintptr_t p, size_t bytes) override {
    ScopedContext scope(ctx_);
    cuda_driver().cuMemsetD8(static_cast<CUdeviceptr>(p), 0, bytes == 0 ? 1 : bytes);
  }

  // Synchronous copies (the legacy stream): a kernel enqueued after write_state returns
  // sees the new bytes.
  void write_state(uintptr_t dst, const void* src, size_t bytes) override {
    ScopedContext scope(ctx_);
    cuda_check(cuda_driver().cuMemcpyHtoD(static_cast<CUdeviceptr>(dst), src, bytes), "cuMemcpyHtoD");
  }

  void read_state(void* dst, uintptr_t src, size_t bytes) override {
    ScopedContext scope(ctx_);
    cuda_check(cuda_driver().cuMemcpyDtoH(dst, static_cast<CUdeviceptr>(src), bytes), "cuMemcpyDtoH");
  }

  void* alloc_host(size_t bytes) override {
    ScopedContext scope(ctx_);
    void* p = nullptr;
    const CUresult r = cuda_driver().cuMemHostAlloc(&p, bytes == 0 ? 1 : bytes, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) throw PoolExhausted("page-locked host memory exhausted");
    cuda_check(r, "cuMemHostAlloc");
    std::memset(p, 0, bytes);
    return p;
  }

  void free_host(void* p, size_t /*bytes*/) override {
    ScopedContext scope(ctx_);
    sync_copies_noexcept();
    cuda_driver().cuMemFreeHost(p);
  }

  // Copies run on one copy stream of this backend, in the order enqueued; events mark
  // tickets. The caller has waited (a fence) for the compute work that wrote a source.
  void copy_to_host(void* dst, uintptr_t src, size_t bytes) override {
    std::lock_guard<std::mutex> lock(copy_mu_);
    ScopedContext scope(ctx_);
    cuda_check(cuda_driver().cuMemcpyDtoHAsync(dst, static_cast<CUdeviceptr>(src), bytes, stream()),
               "cuMemcpyDtoHAsync");
    dirty_ = true;
  }

  void copy_to_device(uintptr_t dst, const void* src, size_t bytes) override {
    std::lock_guard<std::mutex> lock(copy_mu_);
    ScopedContext scope(ctx_);
    cuda_check(cuda_driver().cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst), src, bytes, stream()),
               "cuMemcpyHtoDAsync");
    dirty_ = true;
  }

  uint64_t record_copies() override {
    std::lock_guard<std::mutex> lock(copy_mu_);
    if (!dirty_) return issued_;  // nothing enqueued since the last ticket
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    CUevent ev;
    cuda_check(d.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    const CUresult r = d.cuEventRecord(ev, stream());
    if (r != CUDA_SUCCESS) d.cuEventDestroy(ev);
    cuda_check(r, "cuEventRecord");
    pending_.emplace_back(++issued_, ev);
    dirty_ = false;
    return issued_;
  }

  bool copies_done(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(copy_mu_);
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    while (!pending_.empty() && pending_.front().first <= ticket) {
      const CUresult r = d.cuEventQuery(pending_.front().second);
      if (r == CUDA_ERROR_NOT_READY) return false;
      d.cuEventDestroy(pending_.front().second);
      pending_.pop_front();
      cuda_check(r, "a host-tier copy (cuEventQuery)");
    }
    return true;
  }

  void sync_copies() override {
    std::lock_guard<std::mutex> lock(copy_mu_);
    if (stream_ == nullptr) return;
    const CudaDriver& d = cuda_driver();
    ScopedContext scope(ctx_);
    const CUresult r = d.cuStreamSynchronize(stream_);
    for (auto& e : pending_) d.cuEventDestroy(e.second);
    pending_.clear();
    cuda_check(r, "a host-tier copy (cuStreamSynchronize)");
  }

 private:
  CUstream stream() {  // under copy_mu_ and the context
    if (stream_ == nullptr) {
      cuda_check(cuda_driver().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    }
    return stream_;
  }

  void sync_copies_noexcept() {
    try {
      sync_copies();
    } catch (...) {
    }
  }

  void map_zero(uintptr_t addr, size_t n) {
    const CudaDriver& d = cuda_driver();
    for (size_t i = 0; i < n; ++i) {
      cuda_check(d.cuMemMap(addr + i * page_size_, page_size_, 0, zero_page_, 0), "cuMemMap(zero page)");
    }
    cuda_check(d.cuMemSetAccess(addr, n * page_size_, &access_, 1), "cuMemSetAccess");
  }

  int device_id_;
  CUdevice dev_{};
  CUcontext ctx_{};
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  size_t granularity_ = 0;
  size_t page_size_ = 0;
  CUmemGenericAllocationHandle zero_page_{};
  std::atomic<size_t> live_pages_{0};
  // The host tier's copies.
  std::mutex copy_mu_;
  CUstream stream_ = nullptr;
  bool dirty_ = false;     // copies enqueued since the last ticket
  uint64_t issued_ = 0;    // the newest ticket
  std::deque<std::pair<uint64_t, CUevent>> pending_;  // tickets not yet seen done
};

}  // namespace

const CudaDriver& cuda_driver() {
  static std::once_flag once;
  static CudaDriver driver;
  static std::string error;
  std::call_once(once, [] {
    try {
      driver = load_driver();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!error.empty()) throw BackendError(error);
  return driver;
}

void cuda_check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  // Only reached after a successful load, so the table is valid here.
  if (cuda_driver().cuGetErrorString(r, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown error";
  throw BackendError(std::string(what) + " failed: " + msg + " (CUresult " + std::to_string(r) + ")");
}

std::shared_ptr<PhysicalBackend> make_cuda_backend(size_t page_size, int device) {
  return std::make_shared<CudaBackend>(page_size, device);
}

bool cuda_compiled() { return true; }

std::pair<size_t, size_t> cuda_mem_info(int device) {
  const CudaDriver& d = cuda_driver();
  CUdevice dev;
  cuda_check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
  CUcontext ctx;
  cuda_check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  size_t free_b = 0, total_b = 0;
  {
    ScopedContext scope(ctx);
    cuda_check(d.cuMemGetInfo(&free_b, &total_b), "cuMemGetInfo");
  }
  d.cuDevicePrimaryCtxRelease(dev);
  return {free_b, total_b};
}

}  // namespace kvcached
