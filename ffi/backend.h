// PhysicalBackend: the virtual-memory primitives behind a KV buffer.
//
// Two real implementations share this interface:
//   HostBackend  Linux mmap + memfd (the analog of CUDA VMM on the host),
//   CudaBackend  the CUDA driver VMM API, loaded at run time.
// A "page" is one physical allocation of page_size() bytes, identified by an
// opaque 64-bit handle. Unmapped virtual ranges always read as zeros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace kvcached {

using PageHandle = uint64_t;

enum class DeviceKind { kHost = 1, kCuda = 2 };  // DLPack device codes kDLCPU / kDLCUDA

class PhysicalBackend {
 public:
  virtual ~PhysicalBackend() = default;

  virtual std::string name() const = 0;
  virtual DeviceKind device_kind() const = 0;
  virtual int device_id() const = 0;
  // Page size in bytes; a multiple of the backend's mapping granularity.
  virtual size_t page_size() const = 0;
  // Smallest mapping unit of the backend (4 KiB host, cuMemGetAllocationGranularity on CUDA).
  virtual size_t granularity() const = 0;

  // Reserves `bytes` (a multiple of page_size) of virtual address space, aligned to
  // page_size, that reads as zeros until pages are mapped.
  virtual uintptr_t reserve(size_t bytes) = 0;
  // Gives a reservation back. Every page mapped in it must have been unmapped.
  virtual void free_range(uintptr_t base, size_t bytes) = 0;

  // Creates (commits) one physical page. Throws PoolExhausted when the OS / driver has
  // no memory left.
  virtual PageHandle create_page() = 0;
  // Releases one physical page; its memory goes back to the OS / driver.
  virtual void release_page(PageHandle page) = 0;

  // Physical memory committed by this backend right now (host: as the kernel reports it
  // for the memfd; CUDA: pages created and not released, zero page included).
  virtual size_t committed_bytes() const = 0;

  // Maps pages[i] at addr + i * page_size, read-write, for i < n.
  virtual void map(uintptr_t addr, const PageHandle* pages, size_t n) = 0;
  // Unmaps n pages starting at addr; the range reads as zeros again. With `synchronize`
  // the backend first waits for all work on the device (CUDA: cuCtxSynchronize); callers
  // that already waited for every read of the range (a fence) pass false.
  virtual void unmap(uintptr_t addr, size_t n, bool synchronize = true) = 0;

  // Small state the device's kernels read and write (a KV buffer's page map and error
  // record): zeroed memory, given back with free_state, and synchronous host copies.
  virtual uintptr_t alloc_state(size_t bytes) = 0;
  // `bytes`: what alloc_state was asked for. CUDA keeps the memory (zeroed: every page
  // unmapped) for the life of the process: a captured CUDA graph of a step may still
  // hold its address, and its replay then writes nothing instead of reading freed memory.
  virtual void free_state(uintptr_t p, size_t bytes) = 0;
  virtual void write_state(uintptr_t dst, const void* src, size_t bytes) = 0;
  virtual void read_state(void* dst, uintptr_t src, size_t bytes) = 0;

  // The host tier's memory and copies (see host_arena.h).
  // Host memory for copies of KV blocks: zero-filled, page-aligned. CUDA: page-locked
  // (cuMemHostAlloc), so copies are DMA and asynchronous; host: an anonymous mapping
  // committed at once (MAP_POPULATE). Throws PoolExhausted when none is left.
  virtual void* alloc_host(size_t bytes) = 0;
  virtual void free_host(void* p, size_t bytes) = 0;
  // Enqueues one copy between device memory and memory from alloc_host: on CUDA on the
  // backend's copy stream (returns at once), on the host a memcpy (done on return).
  // Callers order the copy after the device work that writes its source (a fence).
  virtual void copy_to_host(void* dst, uintptr_t src, size_t bytes) = 0;
  virtual void copy_to_device(uintptr_t dst, const void* src, size_t bytes) = 0;
  // A ticket for every copy enqueued so far; copies_done(t) says (without waiting)
  // whether they have completed and throws BackendError if one failed.
  virtual uint64_t record_copies() = 0;
  virtual bool copies_done(uint64_t ticket) = 0;
  // Waits for every copy enqueued so far (an unmap calls it first: a copy of a page
  // never outlives its mapping). Throws BackendError if one failed.
  virtual void sync_copies() = 0;
};

// page_size == 0 selects the default (2 MiB).
std::shared_ptr<PhysicalBackend> make_host_backend(size_t page_size);
// Throws BackendError when no CUDA driver or device is usable.
std::shared_ptr<PhysicalBackend> make_cuda_backend(size_t page_size, int device);
// Whether this build contains the CUDA backend and handlers.
bool cuda_compiled();
// (free, total) bytes of a CUDA device, from cuMemGetInfo; throws BackendError without CUDA.
std::pair<size_t, size_t> cuda_mem_info(int device);

}  // namespace kvcached
