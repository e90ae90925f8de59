// XLA FFI handlers for the Host platform: write_kv, copy_blocks, map_pages, unmap_pages,
// paged_attention.
// Each takes the cache's view as its first operand (the handler finds the cache by the
// view's address, so a compiled step holds no handle and is the same program for every
// cache of its layout; a copy of the view is refused), an ordering token, then any number
// of "after" operands (never read: they only order the call after their producers), and
// returns a fresh int32 token whose value is always 0.
#include <algorithm>
#include <cstring>
#include <functional>

#include "attention_cpu.h"
#include "handler_common.h"
#include "handlers.h"

namespace kvcached {
namespace {

ffi::Error finish(ffi::Result<ffi::AnyBuffer> token_out) {
  std::memset(token_out->untyped_data(), 0, sizeof(int32_t));
  return ffi::Error::Success();
}

// Both write_kv flavours on the host, operands checked: the result token, then the write
// (which validates the layer and every slot first).
ffi::Error write_kv_on_host(const std::shared_ptr<KVBuffer>& buf, int64_t layer, int64_t num_layers,
                            ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::AnyBuffer slots,
                            ffi::Result<ffi::AnyBuffer> token_out) {
  if (auto e = check_token_out("write_kv", token_out); e.failure()) return e;
  try {
    buf->write_kv_host(layer, num_layers, key.untyped_data(), value.untyped_data(),
                       static_cast<const int32_t*>(slots.untyped_data()),
                       static_cast<size_t>(slots.dimensions()[0]));
  } catch (const std::exception& e) {
    return to_ffi_error("write_kv", e);
  }
  return finish(token_out);
}

ffi::Error WriteKvCpu(int32_t device, ffi::AnyBuffer view, ffi::AnyBuffer layer, ffi::AnyBuffer key, ffi::AnyBuffer value,
                      ffi::AnyBuffer slots, ffi::AnyBuffer /*token*/,
                      ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_view_buffer("write_kv", view, device, &buf); e.failure()) return e;
  int64_t num_layers = 0;
  if (auto e = check_write_shapes(*buf, layer, key, value, slots, &num_layers); e.failure()) return e;
  return write_kv_on_host(buf, *static_cast<const int32_t*>(layer.untyped_data()), num_layers, key, value,
                          slots, token_out);
}

// write_kv_async: the same operands as write_kv (the CUDA version validates the layer
// and the slots on the device; here the host validates them, as in write_kv).
ffi::Error WriteKvAsyncCpu(int32_t device, ffi::AnyBuffer view, ffi::AnyBuffer layer, ffi::AnyBuffer key,
                           ffi::AnyBuffer value, ffi::AnyBuffer slots, ffi::AnyBuffer token,
                           ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> token_out) {
  return WriteKvCpu(device, view, layer, key, value, slots, token, after, token_out);
}

ffi::Error CopyBlocksCpu(int32_t device, int64_t group, ffi::AnyBuffer view, ffi::AnyBuffer src, ffi::AnyBuffer dst,
                         ffi::AnyBuffer /*token*/,
                         ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_view_buffer("copy_blocks", view, device, &buf); e.failure()) return e;
  if (auto e = check_copy_shapes(src, dst); e.failure()) return e;
  if (auto e = check_token_out("copy_blocks", token_out); e.failure()) return e;
  try {
    buf->copy_blocks_host(static_cast<const int32_t*>(src.untyped_data()),
                          static_cast<const int32_t*>(dst.untyped_data()),
                          static_cast<size_t>(src.dimensions()[0]), group);
  } catch (const std::exception& e) {
    return to_ffi_error("copy_blocks", e);
  }
  return finish(token_out);
}

// map_pages and unmap_pages: validate, then call KVBuffer::map_pages_op / unmap_pages_op
// (the ops own the pages they map; the allocator's pages are refused).
template <void (KVBuffer::*Method)(const int32_t*, size_t)>
ffi::Error PageOpCpu(const char* op, int32_t device, ffi::AnyBuffer view, ffi::AnyBuffer ids,
                     ffi::Result<ffi::AnyBuffer> token_out) {
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_view_buffer(op, view, device, &buf); e.failure()) return e;
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

ffi::Error MapPagesCpu(int32_t device, ffi::AnyBuffer view, ffi::AnyBuffer ids, ffi::AnyBuffer /*token*/,
                       ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  return PageOpCpu<&KVBuffer::map_pages_op>("map_pages", device, view, ids, token_out);
}

// Pass the reads of the pages as "after" operands so XLA finishes them before the unmap.
ffi::Error UnmapPagesCpu(int32_t device, ffi::AnyBuffer view, ffi::AnyBuffer ids, ffi::AnyBuffer /*token*/,
                         ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> token_out) {
  return PageOpCpu<&KVBuffer::unmap_pages_op>("unmap_pages", device, view, ids, token_out);
}

// paged_attention: ragged causal attention of the query rows of several sequences over
// their cached tokens, read in place through the block tables (see attention_cpu.h); the
// token orders it after the writes (this step's new K/V included).
ffi::Error PagedAttentionCpu(ffi::ThreadPool pool, int32_t device, float scale, ffi::AnyBuffer view,
                             ffi::AnyBuffer layer_buf, ffi::AnyBuffer window_buf, ffi::AnyBuffer q, ffi::AnyBuffer tables, ffi::AnyBuffer kv_lens,
                             ffi::AnyBuffer q_start, ffi::AnyBuffer q_lens, ffi::AnyBuffer sinks,
                             ffi::AnyBuffer /*token*/, ffi::Result<ffi::AnyBuffer> out) {
  const char* op = "paged_attention";
  std::shared_ptr<KVBuffer> buf;
  if (auto e = find_view_buffer(op, view, device, &buf); e.failure()) return e;
  const KVLayout& L = buf->layout();
  const auto qd = q.dimensions();
  if (q.element_type() != ffi::DataType::F32 || qd.size() != 4 || qd[1] != L.num_kv_heads ||
      qd[3] != L.head_dim || qd[2] <= 0) {
    return invalid(op, "q must be float32 (tokens, " + std::to_string(L.num_kv_heads) + ", groups, " +
                           std::to_string(L.head_dim) + "), got " + dims_text(qd));
  }
  const auto td = tables.dimensions();
  if (tables.element_type() != ffi::DataType::S32 || td.size() != 2) {
    return invalid(op, "block_tables must be int32 (seqs, nb), got " + dims_text(td));
  }
  for (const ffi::AnyBuffer* x : {&kv_lens, &q_start, &q_lens}) {
    const auto d = x->dimensions();
    if (x->element_type() != ffi::DataType::S32 || d.size() != 1 || d[0] != td[0]) {
      return invalid(op, "kv_lens / q_start / q_lens must be int32 (seqs,) like the block tables' rows, got " +
                             dims_text(d));
    }
  }
  if (out->element_count() != q.element_count()) return invalid(op, "the result shape does not match q");
  for (const ffi::AnyBuffer* x : {&layer_buf, &window_buf}) {
    if (x->element_type() != ffi::DataType::S32 || x->element_count() != 1) {
      return invalid(op, "layer and window must be int32 scalars");
    }
  }
  if (sinks.element_type() != ffi::DataType::F32 ||
      (sinks.element_count() != 0 && sinks.element_count() != static_cast<size_t>(qd[1] * qd[2]))) {
    return invalid(op, "sinks must be float32 with one logit per query head (kv_heads x groups = " +
                           std::to_string(qd[1] * qd[2]) + ") or empty, got " + dims_text(sinks.dimensions()));
  }
  // Both checked by attend_host.
  const int64_t layer = *static_cast<const int32_t*>(layer_buf.untyped_data());
  const int64_t window = *static_cast<const int32_t*>(window_buf.untyped_data());
  AttendArgs a{layer, qd[0], td[0], qd[1], qd[2], qd[3], td[1], window, scale,
               static_cast<const float*>(q.untyped_data()),
               static_cast<const int32_t*>(tables.untyped_data()),
               static_cast<const int32_t*>(kv_lens.untyped_data()),
               static_cast<const int32_t*>(q_start.untyped_data()),
               static_cast<const int32_t*>(q_lens.untyped_data()),
               static_cast<float*>(out->untyped_data()),
               sinks.element_count() ? static_cast<const float*>(sinks.untyped_data()) : nullptr};
  try {
    const std::string err = attend_host(*buf, a, pool_workers(pool), pool_spawn(pool));
    if (!err.empty()) return invalid(op, err);
  } catch (const std::exception& e) {
    return to_ffi_error(op, e);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_paged_attention_cpu, PagedAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<float>("scale")
                                  .Arg<ffi::AnyBuffer>()  // the cache's view
                                  .Arg<ffi::AnyBuffer>()  // layer (int32 scalar)
                                  .Arg<ffi::AnyBuffer>()  // window (int32 scalar; 0: none)
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // block tables
                                  .Arg<ffi::AnyBuffer>()  // kv_lens
                                  .Arg<ffi::AnyBuffer>()  // q_start
                                  .Arg<ffi::AnyBuffer>()  // q_lens
                                  .Arg<ffi::AnyBuffer>()  // sinks ((kv_heads, groups) or empty)
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .Ret<ffi::AnyBuffer>());  // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_write_kv_cpu, WriteKvCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // the cache's view
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // value
                                  .Arg<ffi::AnyBuffer>()  // slots
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_write_kv_async_cpu, WriteKvAsyncCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // the cache's view
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Arg<ffi::AnyBuffer>()  // key
                                  .Arg<ffi::AnyBuffer>()  // value
                                  .Arg<ffi::AnyBuffer>()  // slots
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_copy_blocks_cpu, CopyBlocksCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("group")
                                  .Arg<ffi::AnyBuffer>()  // the cache's view
                                  .Arg<ffi::AnyBuffer>()  // src
                                  .Arg<ffi::AnyBuffer>()  // dst
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_map_pages_cpu, MapPagesCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // the cache's view
                                  .Arg<ffi::AnyBuffer>()  // page ids
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_unmap_pages_cpu, UnmapPagesCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // the cache's view
                                  .Arg<ffi::AnyBuffer>()  // page ids
                                  .Arg<ffi::AnyBuffer>()  // token
                                  .RemainingArgs()        // after
                                  .Ret<ffi::AnyBuffer>());

}  // namespace kvcached
