// XLA FFI handlers for the Host platform: write_kv, copy_blocks, map_pages, unmap_pages.
// Each takes the KV cache handle as an attribute, an ordering token, then any number of
// "after" operands (never read: they only order the call after their producers), and
// returns a fresh int32 token whose value is always 0.
#include <cstring>

#include "handler_common.h"
#include "handlers.h"

namespace kvcached {
namespace {

ffi::Error finish(ffi::Result<ffi::AnyBuffer> token_out) {
  std::memset(token_out->untyped_data(), 0, sizeof(int32_t));
  return ffi::Error::Success();
}

ffi::Error WriteKvCpu(uint64_t handle, ffi::AnyBuffer layer, ffi::AnyBuffer key, ffi::AnyBuffer value,
                      ffi::AnyBuffer slots, ffi::AnyBuffer /*token*/,
                      ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer("write_kv", handle, DeviceKind::kHost, &buf); e.failure()) return e;
  int64_t num_layers = 0;
  if (auto e = check_write_shapes(*buf, layer, key, value, slots, &num_layers); e.failure()) return e;
  if (auto e = check_token_out("write_kv", token_out); e.failure()) return e;
  try {
    buf->write_kv_host(*static_cast<const int32_t*>(layer.untyped_data()), num_layers, key.untyped_data(),
                       value.untyped_data(), static_cast<const int32_t*>(slots.untyped_data()),
                       static_cast<size_t>(slots.dimensions()[0]));
  } catch (const std::exception& e) {
    return to_ffi_error("write_kv", e);
  }
  return finish(token_out);
}

ffi::Error CopyBlocksCpu(uint64_t handle, ffi::AnyBuffer src, ffi::AnyBuffer dst, ffi::AnyBuffer /*token*/,
                         ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer("copy_blocks", handle, DeviceKind::kHost, &buf); e.failure()) return e;
  if (auto e = check_copy_shapes(src, dst); e.failure()) return e;
  if (auto e = check_token_out("copy_blocks", token_out); e.failure()) return e;
  try {
    buf->copy_blocks_host(static_cast<const int32_t*>(src.untyped_data()),
                          static_cast<const int32_t*>(dst.untyped_data()),
                          static_cast<size_t>(src.dimensions()[0]));
  } catch (const std::exception& e) {
    return to_ffi_error("copy_blocks", e);
  }
  return finish(token_out);
}

// map_pages and unmap_pages: validate, then call KVBuffer::map_pages_op / unmap_pages_op
// (the ops own the pages they map; the allocator's pages are refused).
template <void (KVBuffer::*Method)(const int32_t*, size_t)>
ffi::Error PageOpCpu(const char* op, uint64_t handle, ffi::AnyBuffer ids,
                     ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_buffer(op, handle, DeviceKind::kHost, &buf); e.failure()) return e;
  if (auto e = check_ids_shape(op, "page_ids", ids); e.failure()) return e;
  if (auto e = check_token_out(op, token_out); e.failure()) return e;
  try {
    ((*buf).*Method)(static_cast<const int32_t*>(ids.untyped_data()),
                     static_cast<size_t>(ids.dimensions()[0]));
  } catch (const std::exception& e) {
    return to_ffi_error(op, e);
  }
  return finish(token_out);
}

ffi::Error MapPagesCpu(uint64_t handle, ffi::AnyBuffer ids, ffi::AnyBuffer /*token*/,
                       ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  return PageOpCpu<&KVBuffer::map_pages_op>("map_pages", handle, ids, token_out);
}

// Pass the reads of the pages as "after" operands so XLA finishes them before the unmap.
ffi::Error UnmapPagesCpu(uint64_t handle, ffi::AnyBuffer ids, ffi::AnyBuffer /*token*/,
                         ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  return PageOpCpu<&KVBuffer::unmap_pages_op>("unmap_pages", handle, ids, token_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_write_kv_cpu, WriteKvCpu,
                              ffi::Ffi::Bind()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // value
                                  .Arg<ffi::AnyBuffer>()  // slots
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_copy_blocks_cpu, CopyBlocksCpu,
                              ffi::Ffi::Bind()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()  // src
                                  .Arg<ffi::AnyBuffer>()  // dst
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_map_pages_cpu, MapPagesCpu,
                              ffi::Ffi::Bind()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()  // page ids
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_unmap_pages_cpu, UnmapPagesCpu,
                              ffi::Ffi::Bind()
                                  .Attr<uint64_t>("handle")
                                  .Arg<ffi::AnyBuffer>()  // page ids
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

}  // namespace kvcached
