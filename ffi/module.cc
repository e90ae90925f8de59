// nanobind module jax_kvcached.memory._C: the C++ core (pool, buffers, registry) and the FFI
// handler capsules that jax_kvcached.ops registers with jax.ffi.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "backend.h"
#include "bench.h"
#include "errors.h"
#include "handlers.h"
#include "host_arena.h"
#include "kv_buffer.h"
#include "page_pool.h"
#include "grouped_matmul.h"
#include "quant_matmul.h"
#include "registry.h"

namespace nb = nanobind;
using namespace kvcached;

namespace {

using IdArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using SlotArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void check_same_length(const IdArray& blocks, const SlotArray& slots) {
  if (blocks.shape(0) != slots.shape(0)) {
    throw Error("blocks (" + std::to_string(blocks.shape(0)) + ") and host slots (" +
                std::to_string(slots.shape(0)) + ") differ in length");
  }
}

std::shared_ptr<PhysicalBackend> make_backend(const std::string& name, size_t page_size, int device) {
  if (name == "host") return make_host_backend(page_size);
  if (name == "cuda") return make_cuda_backend(page_size, device);
  throw Error("unknown backend '" + name + "' (expected 'host' or 'cuda')");
}

nb::capsule handler(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// What a handler declares to XLA, read the way XLA reads it: a call frame carrying the
// metadata extension makes the handler fill in its FFI version and traits and return.
nb::dict handler_metadata(nb::capsule target) {
  auto fn = reinterpret_cast<XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)>(target.data());
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  metadata.api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension ext{};
  ext.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  ext.extension_base.type = XLA_FFI_Extension_Metadata;
  ext.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &ext.extension_base;
  // The struct sizes above are the handler's own (same headers), so it never needs the
  // API to report an error: a null API is not dereferenced.
  if (fn(&frame) != nullptr) throw Error("the handler refused the metadata query");
  nb::dict d;
  d["api_version"] = nb::make_tuple(metadata.api_version.major_version, metadata.api_version.minor_version);
  d["traits"] = static_cast<uint32_t>(metadata.traits);
  d["command_buffer_compatible"] = (metadata.traits & XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE) != 0;
  return d;
}

nb::dict stats_dict(const PoolStats& s) {
  nb::dict d;
  d["page_size"] = s.page_size;
  d["budget_pages"] = s.budget_pages;
  d["in_use_pages"] = s.in_use_pages;
  d["reserved_pages"] = s.reserved_pages;
  d["min_reserved_pages"] = s.min_reserved;
  d["max_reserved_pages"] = s.max_reserved;
  d["creates"] = s.creates;
  d["refills"] = s.refills;
  d["releases"] = s.releases;
  d["reuses"] = s.reuses;
  d["committed_bytes"] = s.committed_bytes;
  return d;
}

nb::dlpack::dtype dlpack_dtype(DType t) {
  switch (t) {
    case DType::kFloat32:
      return nb::dtype<float>();
    case DType::kFloat16:
      return nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kBFloat16:
      return nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  throw Error("unknown dtype");
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "jax_kvcached C++ core: physical backends, page pool, virtual KV buffers, FFI handlers";
  // Pools and caches referenced from module globals or JAX objects may outlive
  // interpreter shutdown ordering; that is not a leak worth reporting.
  nb::set_leak_warnings(false);

  nb::object base_exc = nb::exception<Error>(m, "KVCacheError", PyExc_RuntimeError);
  nb::exception<BackendError>(m, "BackendError", base_exc.ptr());
  nb::exception<PoolExhausted>(m, "PoolExhausted", base_exc.ptr());

  m.def("cuda_compiled", &cuda_compiled, "Whether this build has the CUDA backend and handlers.");
  m.def("cuda_mem_info", &cuda_mem_info, nb::arg("device"), "(free, total) bytes of a CUDA device.");

  nb::class_<PagePool>(m, "PagePool")
      .def(nb::new_([](const std::string& backend, size_t page_size, size_t budget_pages,
                       size_t min_reserved, size_t max_reserved, int device) {
             return std::make_shared<PagePool>(make_backend(backend, page_size, device), budget_pages,
                                               min_reserved, max_reserved);
           }),
           nb::arg("backend"), nb::arg("page_size"), nb::arg("budget_pages"), nb::arg("min_reserved"),
           nb::arg("max_reserved"), nb::arg("device") = 0)
      .def_prop_ro("backend_name", [](PagePool& p) { return p.backend().name(); })
      .def_prop_ro("page_size", &PagePool::page_size)
      .def_prop_ro("granularity", [](PagePool& p) { return p.backend().granularity(); })
      .def_prop_ro("device_id", [](PagePool& p) { return p.backend().device_id(); })
      .def_prop_ro("committed_bytes", &PagePool::committed_bytes, nb::call_guard<nb::gil_scoped_release>())
      .def("set_budget", &PagePool::set_budget, nb::arg("budget_pages"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("set_reserve", &PagePool::set_reserve, nb::arg("min_reserved"), nb::arg("max_reserved"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("trim", &PagePool::trim, nb::call_guard<nb::gil_scoped_release>())
      .def("stats", [](PagePool& p) {
        PoolStats s;
        {
          nb::gil_scoped_release unlocked;  // (it may wait for a page being created)
          s = p.stats();
        }
        return stats_dict(s);
      });

  nb::class_<KVBuffer>(m, "KVBuffer")
      .def(nb::new_([](std::shared_ptr<PagePool> pool, int64_t num_layers, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, int dtype, int64_t num_pages,
                       int device_ordinal, int local_id, std::vector<int32_t> layer_group,
                       int64_t planes_per_layer) {
             if (dtype < 0 || dtype > 2) throw Error("unsupported dtype code");
             return std::make_shared<KVBuffer>(
                 std::move(pool),
                 KVLayout{num_layers, num_kv_heads, head_dim, block_size, static_cast<DType>(dtype), num_pages,
                          std::move(layer_group), planes_per_layer},
                 device_ordinal, local_id);
           }),
           nb::arg("pool"), nb::arg("num_layers"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
           nb::arg("block_size"), nb::arg("dtype"), nb::arg("num_pages"), nb::arg("device_ordinal") = -1,
           nb::arg("local_id") = -1, nb::arg("layer_group") = std::vector<int32_t>{},
           nb::arg("planes_per_layer") = 2)
      .def_prop_ro("local_id", &KVBuffer::local_id)
      .def_prop_ro("device_ordinal", &KVBuffer::device_ordinal)
      .def_prop_ro("base", &KVBuffer::base)
      .def_prop_ro("total_bytes", &KVBuffer::total_bytes)
      .def_prop_ro("plane_bytes", &KVBuffer::plane_bytes)
      .def_prop_ro("page_size", &KVBuffer::page_size)
      .def_prop_ro("num_pages", [](KVBuffer& b) { return b.layout().num_pages; })
      .def_prop_ro("num_blocks", &KVBuffer::num_blocks)
      .def_prop_ro("blocks_per_page", &KVBuffer::blocks_per_page)
      .def_prop_ro("block_bytes", &KVBuffer::block_bytes)
      .def_prop_ro("pages_per_kv_page", &KVBuffer::pages_per_kv_page)
      .def(
          "map_pages",
          [](KVBuffer& b, IdArray ids, int group) {
            b.map_pages(ids.data(), ids.shape(0), PageOwner::kAllocator, group);
          },
          nb::arg("page_ids"), nb::arg("group") = 0, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "unmap_pages",
          [](KVBuffer& b, IdArray ids, bool synchronize, int group) {
            b.unmap_pages(ids.data(), ids.shape(0), PageOwner::kAllocator, synchronize, group);
          },
          nb::arg("page_ids"), nb::arg("synchronize") = true, nb::arg("group") = 0,
          nb::call_guard<nb::gil_scoped_release>(),
          "Unmaps pages; synchronize=False when every read of them is known to be done (a fence).")
      .def("is_mapped", &KVBuffer::is_mapped, nb::arg("page"), nb::arg("group") = 0)
      .def_prop_ro("num_mapped_pages", [](KVBuffer& b) { return b.num_mapped_pages(-1); },
                   "KV pages mapped, every group together.")
      .def("group_mapped_pages", [](KVBuffer& b, int group) { return b.num_mapped_pages(group); },
           nb::arg("group"), "KV pages mapped in one group.")
      .def_prop_ro("num_mapped_physical_pages", &KVBuffer::num_mapped_physical_pages)
      .def_prop_ro("num_groups", &KVBuffer::num_groups)
      .def("group_pages_per_kv_page", &KVBuffer::group_pages_per_kv_page, nb::arg("group"))
      .def("mapped_pages", &KVBuffer::mapped_pages, nb::arg("group") = 0)
      .def(
          "copy_to_host",
          [](KVBuffer& b, IdArray blocks, SlotArray slots, HostArena& arena) {
            check_same_length(blocks, slots);
            return b.copy_to_host(blocks.data(), slots.data(), blocks.shape(0), arena);
          },
          nb::arg("blocks"), nb::arg("slots"), nb::arg("arena"), nb::call_guard<nb::gil_scoped_release>(),
          "Enqueues copies of blocks of the arena's group (its planes) into host slots; returns a ticket.")
      .def(
          "copy_from_host",
          [](KVBuffer& b, HostArena& arena, SlotArray slots, IdArray blocks) {
            check_same_length(blocks, slots);
            b.copy_from_host(arena, slots.data(), blocks.data(), blocks.shape(0));
          },
          nb::arg("arena"), nb::arg("slots"), nb::arg("blocks"), nb::call_guard<nb::gil_scoped_release>(),
          "Copies host slots into blocks of the arena's group (its planes); returns when done.")
      .def("copies_done", &KVBuffer::copies_done, nb::arg("ticket"),
           nb::call_guard<nb::gil_scoped_release>(),
           "Whether the copies of a ticket are done (raises if one failed).")
      .def("take_device_error", &KVBuffer::take_device_error,
           "Reads and clears the device error record of write_kv_async: (code, slot).")
      .def("device_page_map", &KVBuffer::device_page_map, nb::arg("layer") = 0,
           "One byte per KV page as kernels see it for one layer (1: mapped).")
      .def("close", &KVBuffer::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("closed", &KVBuffer::closed)
      .def_prop_ro("dlpack_device",
                   [](KVBuffer& b) {
                     PhysicalBackend& be = b.pool().backend();
                     return std::make_pair(be.device_kind() == DeviceKind::kCuda ? 2 : 1, b.local_id());
                   })
      .def(
          "dlpack",
          [](std::shared_ptr<KVBuffer> self) {
            // The capsule keeps the buffer (and its virtual range) alive for every view.
            auto* keep = new std::shared_ptr<KVBuffer>(self);
            nb::capsule owner(keep, [](void* p) noexcept {
              delete static_cast<std::shared_ptr<KVBuffer>*>(p);
            });
            const KVLayout& l = self->layout();
            const size_t shape[6] = {static_cast<size_t>(l.num_layers), static_cast<size_t>(l.planes_per_layer), static_cast<size_t>(self->num_blocks()),
                                     static_cast<size_t>(l.block_size), static_cast<size_t>(l.num_kv_heads),
                                     static_cast<size_t>(l.head_dim)};
            PhysicalBackend& be = self->pool().backend();
            const int dev_type = be.device_kind() == DeviceKind::kCuda ? nb::device::cuda::value
                                                                        : nb::device::cpu::value;
            return nb::ndarray<>(reinterpret_cast<void*>(self->base()), 6, shape, owner, nullptr,
                                 dlpack_dtype(l.dtype), dev_type, self->local_id());
          },
          "A DLPack capsule over the whole virtual buffer (zero-copy).");

  nb::class_<HostArena>(m, "HostArena")
      .def(nb::new_([](std::shared_ptr<KVBuffer> buffer, int64_t num_slots, int group) {
             if (group < 0 || group >= buffer->num_groups()) {
               throw Error("KV cache group " + std::to_string(group) + " out of range [0, " +
                           std::to_string(buffer->num_groups()) + ")");
             }
             return std::make_shared<HostArena>(
                 buffer->shared_pool(), buffer->block_bytes(),
                 static_cast<int64_t>(buffer->group_pages_per_kv_page(group)), num_slots, group);
           }),
           nb::arg("buffer"), nb::arg("num_slots"), nb::arg("group") = 0,
           "Host slots for blocks of one KV cache group of a buffer (each of its planes).")
      .def_prop_ro("group", &HostArena::group)
      .def_prop_ro("num_slots", &HostArena::num_slots)
      .def_prop_ro("num_planes", &HostArena::num_planes)
      .def_prop_ro("block_bytes", &HostArena::block_bytes)
      .def_prop_ro("slot_bytes", &HostArena::slot_bytes)
      .def_prop_ro("total_bytes", &HostArena::total_bytes)
      .def_prop_ro("pinned", &HostArena::pinned)
      .def(
          "read_slot",
          [](HostArena& a, int64_t slot) {
            std::string out(a.slot_bytes(), '\0');
            a.read_slot(slot, out.data());
            return nb::bytes(out.data(), out.size());
          },
          nb::arg("slot"), "The bytes of one slot, every plane in order.");

  m.def("register_buffers", &register_buffers, nb::arg("shards"), nb::arg("key") = "",
        "Registers a KV cache's buffers (one per device, distinct device ordinals, one layout) "
        "for the FFI handlers and returns its handle (random, or stable across processes for "
        "a key).");
  m.def("unregister_buffer", &unregister_buffer, nb::arg("handle"));
  m.def("lookup_ok", &is_registered, nb::arg("handle"));

  m.def(
      "bench_backend",
      [](const std::string& backend, size_t page_size, size_t iters, int device) {
        auto be = make_backend(backend, page_size, device);
        nb::gil_scoped_release release;
        return bench_backend(*be, iters);
      },
      nb::arg("backend"), nb::arg("page_size"), nb::arg("iters"), nb::arg("device") = 0);

  nb::dict handlers;
  handlers["cpu"] = nb::dict();
  nb::dict cpu = handlers["cpu"];
  cpu["write_kv"] = handler(kvcached_write_kv_cpu);
  cpu["write_kv_async"] = handler(kvcached_write_kv_async_cpu);
  cpu["copy_blocks"] = handler(kvcached_copy_blocks_cpu);
  cpu["map_pages"] = handler(kvcached_map_pages_cpu);
  cpu["unmap_pages"] = handler(kvcached_unmap_pages_cpu);
  cpu["paged_attention"] = handler(kvcached_paged_attention_cpu);
  cpu["quant_matmul"] = handler(kvcached_quant_matmul_cpu);
  cpu["grouped_matmul"] = handler(kvcached_grouped_matmul_cpu);
#ifdef KVCACHED_WITH_CUDA
  nb::dict cuda;
  cuda["write_kv"] = handler(kvcached_write_kv_cuda);
  cuda["write_kv_async"] = handler(kvcached_write_kv_async_cuda);
  cuda["copy_blocks"] = handler(kvcached_copy_blocks_cuda);
  cuda["map_pages"] = handler(kvcached_map_pages_cuda);
  cuda["unmap_pages"] = handler(kvcached_unmap_pages_cuda);
  handlers["cuda"] = cuda;
#endif
  m.attr("handlers") = handlers;
  m.def("quant_isa", &quant_isa, "The instruction set quant_matmul uses on this CPU.");
  m.def("set_quant_isa", &set_quant_isa, nb::arg("name"),
        "Forces quant_matmul's instruction set (portable, avx2, avx512_vnni; auto: the best "
        "this CPU has). Raises KVCacheError when the CPU lacks it.");
  m.def("grouped_isa", &grouped_isa, "The instruction set grouped_matmul uses on this CPU.");
  m.def("set_grouped_isa", &set_grouped_isa, nb::arg("name"),
        "Forces grouped_matmul's instruction set (portable, avx512; auto: the best this CPU "
        "has). Raises KVCacheError when the CPU lacks it.");
  m.def("handler_metadata", &handler_metadata, nb::arg("handler"),
        "What a handler capsule (from `handlers`) declares to XLA: its FFI api_version, traits "
        "and whether it may be captured into a command buffer (CUDA graph).");
}
