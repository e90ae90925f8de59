// Validation shared by the Host and CUDA FFI handlers: handle lookup, dtypes, shapes.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "errors.h"
#include "kv_buffer.h"
#include "parallel.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace kvcached {
namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& op, const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_kvcached." + op + ": " + msg);
}

// Translates a core exception into an FFI error.
inline ffi::Error to_ffi_error(const std::string& op, const std::exception& e) {
  if (dynamic_cast<const PoolExhausted*>(&e) != nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jax_kvcached." + op + ": " + e.what());
  }
  if (dynamic_cast<const Error*>(&e) != nullptr) return invalid(op, e.what());
  return ffi::Error::Internal("jax_kvcached." + op + ": " + e.what());
}

// XLA's intra-op thread pool as the CPU kernels take it (parallel.h): the threads that
// work, the caller included, and how a task is handed to another thread.
inline int64_t pool_workers(ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }
inline Spawn pool_spawn(ffi::ThreadPool& pool) {
  return [&pool](std::function<void()> f) { pool.Schedule(std::move(f)); };
}

// Looks up the shard of a handle on the device the call runs on; expected_kind rejects a
// host buffer on the CUDA platform and back.
inline ffi::Error find_buffer(const std::string& op, uint64_t handle, int32_t device,
                              DeviceKind expected_kind, std::shared_ptr<KVBuffer>* out) {
  std::string why;
  *out = lookup_buffer(handle, device, &why);
  if (!*out) return invalid(op, why);
  if ((*out)->pool().backend().device_kind() != expected_kind) {
    return invalid(op, "KV cache handle " + std::to_string(handle) + " belongs to the '" +
                           (*out)->pool().backend().name() + "' backend, not this platform");
  }
  return ffi::Error::Success();
}

inline bool dtype_matches(ffi::DataType t, DType d);
inline std::string dims_text(ffi::AnyBuffer::Dimensions d);

// The Host handlers' cache: the shard whose virtual range the view operand is, on the
// device the call runs on; the operand must be the whole view of that shard
// (layers, planes, blocks, block_size, kv_heads, head_dim) of the cache's dtype.
inline ffi::Error find_view_buffer(const std::string& op, ffi::AnyBuffer view, int32_t device,
                                   std::shared_ptr<KVBuffer>* out) {
  std::string why;
  *out = lookup_view(view.untyped_data(), device, &why);
  if (!*out) return invalid(op, why);
  if ((*out)->pool().backend().device_kind() != DeviceKind::kHost) {
    return invalid(op, "the view operand belongs to the '" + (*out)->pool().backend().name() +
                           "' backend, not this platform");
  }
  const KVLayout& l = (*out)->layout();
  const auto d = view.dimensions();
  const int64_t want[6] = {l.num_layers, l.planes_per_layer, (*out)->num_blocks(), l.block_size, l.num_kv_heads,
                           l.head_dim};
  bool same = d.size() == 6 && dtype_matches(view.element_type(), l.dtype);
  for (size_t i = 0; same && i < 6; ++i) same = d[i] == want[i];
  if (!same) {
    return invalid(op, "the view operand " + dims_text(d) + " is not the whole view of its KV cache (" +
                           std::to_string(want[0]) + ", " + std::to_string(want[1]) + ", " +
                           std::to_string(want[2]) + ", " + std::to_string(want[3]) + ", " +
                           std::to_string(want[4]) + ", " + std::to_string(want[5]) + ") of " +
                           dtype_name(l.dtype));
  }
  return ffi::Error::Success();
}

inline bool dtype_matches(ffi::DataType t, DType d) {
  switch (d) {
    case DType::kFloat32:
      return t == ffi::DataType::F32;
    case DType::kFloat16:
      return t == ffi::DataType::F16;
    case DType::kBFloat16:
      return t == ffi::DataType::BF16;
  }
  return false;
}

inline std::string dims_text(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// key and value must both be (n, num_kv_heads, head_dim) -- one layer -- or
// (m, n, num_kv_heads, head_dim) -- m consecutive layers -- of the cache dtype; slots (n,);
// layer an int32 scalar (the first layer). Sets *num_layers to m.
inline ffi::Error check_kv_shapes(const KVBuffer& buf, ffi::AnyBuffer key, ffi::AnyBuffer value,
                                  ffi::AnyBuffer slots, int64_t* num_layers);

inline ffi::Error check_write_shapes(const KVBuffer& buf, ffi::AnyBuffer layer, ffi::AnyBuffer key,
                                     ffi::AnyBuffer value, ffi::AnyBuffer slots, int64_t* num_layers) {
  if (layer.element_type() != ffi::DataType::S32 || layer.element_count() != 1) {
    return invalid("write_kv", "layer must be an int32 scalar");
  }
  return check_kv_shapes(buf, key, value, slots, num_layers);
}

// The shapes of write_kv without its layer operand (write_kv_async takes the layer as an
// attribute).
inline ffi::Error check_kv_shapes(const KVBuffer& buf, ffi::AnyBuffer key, ffi::AnyBuffer value,
                                  ffi::AnyBuffer slots, int64_t* num_layers) {
  const KVLayout& l = buf.layout();
  if (slots.element_type() != ffi::DataType::S32 || slots.dimensions().size() != 1) {
    return invalid("write_kv", "slots must be a 1-D int32 array");
  }
  const int64_t n = slots.dimensions()[0];
  for (const ffi::AnyBuffer* b : {&key, &value}) {
    const char* name = b == &key ? "key" : "value";
    if (!dtype_matches(b->element_type(), l.dtype)) {
      return invalid("write_kv", std::string(name) + " dtype does not match the cache dtype " +
                                     dtype_name(l.dtype));
    }
    auto d = b->dimensions();
    const size_t r = d.size();
    if ((r != 3 && r != 4) || d[r - 3] != n || d[r - 2] != l.num_kv_heads || d[r - 1] != l.head_dim ||
        (r == 4 && d[0] < 1)) {
      return invalid("write_kv", std::string(name) + " shape " + dims_text(d) + " must be ([layers, ]" +
                                     std::to_string(n) + ", " + std::to_string(l.num_kv_heads) +
                                     ", " + std::to_string(l.head_dim) + ")");
    }
  }
  if (key.dimensions().size() != value.dimensions().size() ||
      (key.dimensions().size() == 4 && key.dimensions()[0] != value.dimensions()[0])) {
    return invalid("write_kv", "key and value shapes differ");
  }
  *num_layers = key.dimensions().size() == 4 ? key.dimensions()[0] : 1;
  return ffi::Error::Success();
}

inline ffi::Error check_ids_shape(const std::string& op, const char* name, ffi::AnyBuffer ids) {
  if (ids.element_type() != ffi::DataType::S32 || ids.dimensions().size() != 1) {
    return invalid(op, std::string(name) + " must be a 1-D int32 array");
  }
  return ffi::Error::Success();
}

inline ffi::Error check_copy_shapes(ffi::AnyBuffer src, ffi::AnyBuffer dst) {
  if (auto e = check_ids_shape("copy_blocks", "src", src); e.failure()) return e;
  if (auto e = check_ids_shape("copy_blocks", "dst", dst); e.failure()) return e;
  if (src.dimensions()[0] != dst.dimensions()[0]) {
    return invalid("copy_blocks", "src and dst must have the same length");
  }
  return ffi::Error::Success();
}

inline ffi::Error check_token_out(const std::string& op, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->element_type() != ffi::DataType::S32 || out->element_count() != 1) {
    return invalid(op, "the result token must be an int32 scalar");
  }
  return ffi::Error::Success();
}

}  // namespace kvcached
