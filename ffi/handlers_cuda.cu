// XLA FFI handlers for the CUDA platform. Same operands and validation as the Host
// handlers. Index operands live on the device, so each handler copies them to the host
// and validates them before launching anything: a bad slot is an FFI error, never a
// stray device write. write_kv_async (the engine's step) instead checks each slot in the
// kernel against the buffer's device page map, skips and records bad ones, and never
// waits for the device. Map and unmap are host calls; the backend's unmap waits for the
// device first, so no kernel enqueued earlier can read a page after it is unmapped.
//
// Command buffers (CUDA graphs): XLA captures a handler that declares
// kCmdBufferCompatible once (at each record: when its operands' addresses change) and
// then replays the captured device work without calling it. Only write_kv_async
// qualifies: its host part is checks of static facts (the handle, shapes, the buffer's
// layer count) and every per-step check runs in the kernel against the device page map,
// so a replay does what a call would. The others copy operands to the host and
// synchronize the stream (not allowed while capturing), and map / unmap change the
// buffer from the host: a replay would skip exactly the work they exist for.
#include <cuda_runtime_api.h>

#include <mutex>
#include <shared_mutex>
#include <vector>

#include "handler_common.h"
#include "handlers.h"

namespace kvcached {
namespace {

ffi::Error cuda_error(const std::string& op, cudaError_t e) {
  return ffi::Error::Internal("jax_kvcached." + op + ": " + cudaGetErrorString(e));
}

// Copies a small int32 device array to the host (synchronously on `stream`).
ffi::Error fetch(const std::string& op, cudaStream_t stream, ffi::AnyBuffer buf, std::vector<int32_t>* out) {
  out->resize(buf.element_count());
  if (out->empty()) return ffi::Error::Success();
  cudaError_t e = cudaMemcpyAsync(out->data(), buf.untyped_data(), out->size() * sizeof(int32_t),
                                  cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error(op, e);
}

ffi::Error finish(const std::string& op, cudaStream_t stream, ffi::Result<ffi::AnyBuffer> token_out) {
  const cudaError_t e = cudaMemsetAsync(token_out->untyped_data(), 0, sizeof(int32_t), stream);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error(op, e);
}

unsigned grid_for(int64_t work) {
  const int64_t blocks = (work + 255) / 256;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

// Slot checks on the device (write_kv_async): every slot against the buffer's page map
// (see KVBuffer::device_state); a bad slot's row is skipped and the first one recorded in
// error[0] (code) and error[1] (slot), raised by the host at its next sync. page_map ==
// nullptr: the host validated the slots already (write_kv).
struct SlotCheck {
  int64_t num_slots, block_size, block_bytes, page_size, num_pages;
  const uint8_t* page_map;  // per layer: num_pages bytes (a layer sees its group's pages)
  int32_t* error;
};

__device__ int slot_error(int64_t s, int64_t layer, const SlotCheck& c) {
  if (c.page_map == nullptr) return 0;
  if (s < 0 || s >= c.num_slots) return 1;
  const int64_t b = s / c.block_size;
  if (b == 0) return 2;
  const int64_t start = b * c.block_bytes;
  const int64_t page = start / c.page_size;
  if (page != (start + c.block_bytes - 1) / c.page_size) return 3;
  return c.page_map[layer * c.num_pages + page] ? 0 : 4;
}

// blockIdx.y: the layer (of the written range); planes of consecutive layers are
// planes * words_per_plane apart (planes 1: a latent cache, no V written). Slot -1 skips a
// padded token.
// layer_ptr != nullptr (write_kv_async): the first layer is read on the device and
// checked against num_layers_total (code 5, recorded with the layer); k_plane0 is then
// the buffer's base.
template <typename Word>
__global__ void write_rows(const Word* key, const Word* value, const int32_t* slots, int64_t n,
                           int64_t words_per_row, int64_t words_per_plane, int64_t planes, Word* k_plane0,
                           SlotCheck check, const int32_t* layer_ptr, int64_t num_layers_total) {
  const int64_t total = n * words_per_row;
  const int64_t j = blockIdx.y;
  int64_t layer = j;  // the page map's layer (only read when layer_ptr is given)
  if (layer_ptr != nullptr) {
    const int64_t first = *layer_ptr;
    if (first < 0 || first + gridDim.y > num_layers_total) {
      if (blockIdx.x == 0 && threadIdx.x == 0 && j == 0 && atomicCAS(check.error, 0, 5) == 0) {
        check.error[1] = static_cast<int32_t>(first);
      }
      return;
    }
    k_plane0 += planes * first * words_per_plane;
    layer = first + j;
  }
  key += j * total;
  value += j * total;
  Word* k_plane = k_plane0 + planes * j * words_per_plane;
  Word* v_plane = planes == 2 ? k_plane + words_per_plane : nullptr;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / words_per_row;
    const int64_t w = i - t * words_per_row;
    const int32_t s = slots[t];
    if (s == -1) continue;
    const int code = slot_error(s, layer, check);
    if (code != 0) {
      if (w == 0 && j == 0 && atomicCAS(check.error, 0, code) == 0) check.error[1] = s;
      continue;
    }
    k_plane[s * words_per_row + w] = key[i];
    if (v_plane != nullptr) v_plane[s * words_per_row + w] = value[i];
  }
}

// Launches write_rows for num_layers layers from `layer` (32-bit words when rows allow);
// layer_ptr != nullptr: from the layer it points to on the device (`layer` unused).
cudaError_t launch_write(cudaStream_t stream, const KVBuffer& buf, int64_t layer, int64_t num_layers,
                         const void* key, const void* value, const int32_t* slots, int64_t n,
                         const SlotCheck& check, const int32_t* layer_ptr = nullptr) {
  const size_t row = buf.layout().row_bytes();
  if (layer_ptr != nullptr) layer = 0;
  const int64_t total_layers = buf.layout().num_layers;
  const int64_t planes = buf.layout().planes_per_layer;
  char* k_plane = reinterpret_cast<char*>(buf.base() + static_cast<size_t>(planes * layer) * buf.plane_bytes());
  if (row % 4 == 0) {
    const int64_t wpr = static_cast<int64_t>(row / 4);
    const dim3 grid(grid_for(n * wpr), static_cast<unsigned>(num_layers));
    write_rows<uint32_t><<<grid, 256, 0, stream>>>(
        static_cast<const uint32_t*>(key), static_cast<const uint32_t*>(value), slots, n, wpr,
        static_cast<int64_t>(buf.plane_bytes() / 4), planes, reinterpret_cast<uint32_t*>(k_plane), check, layer_ptr, total_layers);
  } else {
    const int64_t wpr = static_cast<int64_t>(row / 2);
    const dim3 grid(grid_for(n * wpr), static_cast<unsigned>(num_layers));
    write_rows<uint16_t><<<grid, 256, 0, stream>>>(
        static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value), slots, n, wpr,
        static_cast<int64_t>(buf.plane_bytes() / 2), planes, reinterpret_cast<uint16_t*>(k_plane), check, layer_ptr, total_layers);
  }
  return cudaGetLastError();
}

template <typename Word>
__global__ void copy_block_kernel(const int32_t* src, const int32_t* dst, int64_t n,
                                  int64_t words_per_block, int64_t words_per_plane, Word* base) {
  const int64_t plane = blockIdx.y;
  Word* p = base + plane * words_per_plane;
  const int64_t total = n * words_per_block;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / words_per_block;
    const int64_t w = i - b * words_per_block;
    p[dst[b] * words_per_block + w] = p[src[b] * words_per_block + w];
  }
}

ffi::Error WriteKvCuda(cudaStream_t stream, int32_t device, uint64_t handle, ffi::AnyBuffer layer, ffi::AnyBuffer key,
                       ffi::AnyBuffer value, ffi::AnyBuffer slots, ffi::AnyBuffer /*token*/,
                       ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer("write_kv", handle, device, DeviceKind::kCuda, &buf); e.failure()) return e;
  int64_t num_layers = 0;
  if (auto e = check_write_shapes(*buf, layer, key, value, slots, &num_layers); e.failure()) return e;
  if (auto e = check_token_out("write_kv", token_out); e.failure()) return e;
  std::vector<int32_t> host_layer, host_slots;
  if (auto e = fetch("write_kv", stream, layer, &host_layer); e.failure()) return e;
  if (auto e = fetch("write_kv", stream, slots, &host_slots); e.failure()) return e;
  std::shared_lock<std::shared_mutex> lock(buf->mutex());
  const std::string err = buf->check_write(host_layer[0], num_layers, host_slots.data(), host_slots.size());
  if (!err.empty()) return invalid("write_kv", err);
  const int64_t n = static_cast<int64_t>(host_slots.size());
  if (n > 0) {
    const SlotCheck validated{0, 0, 0, 0, 0, nullptr, nullptr};
    const cudaError_t e = launch_write(stream, *buf, host_layer[0], num_layers, key.untyped_data(), value.untyped_data(),
                                       static_cast<const int32_t*>(slots.untyped_data()), n, validated);
    if (e != cudaSuccess) return cuda_error("write_kv", e);
  }
  return finish("write_kv", stream, token_out);
}

// write_kv without a host round trip: nothing is copied to the host and the stream is
// never synchronized; the kernel reads the layer (an operand, so one handler serves
// every layer of a scanned model) and checks it and every slot on the device.
ffi::Error WriteKvAsyncCuda(cudaStream_t stream, int32_t device, uint64_t handle, ffi::AnyBuffer layer,
                            ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::AnyBuffer slots, ffi::AnyBuffer /*token*/,
                            ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer("write_kv", handle, device, DeviceKind::kCuda, &buf); e.failure()) return e;
  int64_t num_layers = 0;
  if (auto e = check_write_shapes(*buf, layer, key, value, slots, &num_layers); e.failure()) return e;
  if (auto e = check_token_out("write_kv", token_out); e.failure()) return e;
  std::shared_lock<std::shared_mutex> lock(buf->mutex());
  const std::string err = buf->check_write(0, num_layers, nullptr, 0);  // the range fits; open
  if (!err.empty()) return invalid("write_kv", err);
  const int64_t n = slots.dimensions()[0];
  if (n > 0) {
    const uintptr_t state = buf->device_state();
    const SlotCheck check{buf->num_slots(), buf->layout().block_size, static_cast<int64_t>(buf->block_bytes()),
                          static_cast<int64_t>(buf->page_size()), buf->layout().num_pages,
                          reinterpret_cast<const uint8_t*>(state + KVBuffer::kStateHeader),
                          reinterpret_cast<int32_t*>(state)};
    const cudaError_t e = launch_write(stream, *buf, 0, num_layers, key.untyped_data(), value.untyped_data(),
                                       static_cast<const int32_t*>(slots.untyped_data()), n, check,
                                       static_cast<const int32_t*>(layer.untyped_data()));
    if (e != cudaSuccess) return cuda_error("write_kv", e);
  }
  return finish("write_kv", stream, token_out);
}

ffi::Error CopyBlocksCuda(cudaStream_t stream, int32_t device, uint64_t handle, int64_t group, ffi::AnyBuffer src,
                          ffi::AnyBuffer dst,
                          ffi::AnyBuffer /*token*/, ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer("copy_blocks", handle, device, DeviceKind::kCuda, &buf); e.failure()) return e;
  if (auto e = check_copy_shapes(src, dst); e.failure()) return e;
  if (auto e = check_token_out("copy_blocks", token_out); e.failure()) return e;
  std::vector<int32_t> hs, hd;
  if (auto e = fetch("copy_blocks", stream, src, &hs); e.failure()) return e;
  if (auto e = fetch("copy_blocks", stream, dst, &hd); e.failure()) return e;
  std::shared_lock<std::shared_mutex> lock(buf->mutex());
  const std::string err = buf->check_copy(hs.data(), hd.data(), hs.size(), group);
  if (!err.empty()) return invalid("copy_blocks", err);
  const int64_t n = static_cast<int64_t>(hs.size());
  if (n > 0) {
    const size_t bb = buf->layout().block_bytes();
    const int64_t wpb = static_cast<int64_t>(bb / 2);
    const int64_t wpp = static_cast<int64_t>(buf->plane_bytes() / 2);
    const dim3 grid(grid_for(n * wpb), 1);
    // check_copy() rejected repeated destinations and src/dst overlaps, so the copies
    // are independent and may run in parallel. One launch per plane of the group.
    for (size_t plane : buf->group_planes(static_cast<int>(group))) {
      copy_block_kernel<uint16_t><<<grid, 256, 0, stream>>>(
          static_cast<const int32_t*>(src.untyped_data()), static_cast<const int32_t*>(dst.untyped_data()), n,
          wpb, wpp, reinterpret_cast<uint16_t*>(buf->base()) + static_cast<int64_t>(plane) * wpp);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_error("copy_blocks", e);
    }
  }
  return finish("copy_blocks", stream, token_out);
}

// map_pages and unmap_pages: fetch and validate the ids, then call KVBuffer. The fetch
// synchronizes the stream, so every earlier read of the pages has finished.
template <void (KVBuffer::*Method)(const int32_t*, size_t)>
ffi::Error PageOpCuda(const char* op, cudaStream_t stream, int32_t device, uint64_t handle, ffi::AnyBuffer ids,
                      ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer(op, handle, device, DeviceKind::kCuda, &buf); e.failure()) return e;
  if (auto e = check_ids_shape(op, "page_ids", ids); e.failure()) return e;
  if (auto e = check_token_out(op, token_out); e.failure()) return e;
  std::vector<int32_t> h;
  if (auto e = fetch(op, stream, ids, &h); e.failure()) return e;
  try {
    ((*buf).*Method)(h.data(), h.size());
  } catch (const std::exception& e) {
    return to_ffi_error(op, e);
  }
  return finish(op, stream, token_out);
}

ffi::Error MapPagesCuda(cudaStream_t stream, int32_t device, uint64_t handle, ffi::AnyBuffer ids, ffi::AnyBuffer /*token*/,
                        ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  return PageOpCuda<&KVBuffer::map_pages_op>("map_pages", stream, device, handle, ids, token_out);
}

ffi::Error UnmapPagesCuda(cudaStream_t stream, int32_t device, uint64_t handle, ffi::AnyBuffer ids, ffi::AnyBuffer /*token*/,
                          ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  return PageOpCuda<&KVBuffer::unmap_pages_op>("unmap_pages", stream, device, handle, ids, token_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_write_kv_cuda, WriteKvCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_write_kv_async_cuda, WriteKvAsyncCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()  // layer (int32 scalar, read on the device)
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_copy_blocks_cuda, CopyBlocksCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("handle")
                                  .Attr<int64_t>("group")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_map_pages_cuda, MapPagesCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_unmap_pages_cuda, UnmapPagesCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace kvcached
