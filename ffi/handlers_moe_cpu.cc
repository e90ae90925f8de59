// grouped_matmul on the CPU (see grouped_matmul.h), on XLA's intra-op thread pool: the
// experts of a mixture-of-experts layer. Shapes are checked before a read, the group
// sizes (data) before the first row is computed.
#include <string>

#include "grouped_matmul.h"
#include "handler_common.h"
#include "handlers.h"

namespace kvcached {
namespace {

ffi::Error GroupedMatmulCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer sizes,
                            ffi::Result<ffi::AnyBuffer> out) {
  const char* op = "grouped_matmul";
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = sizes.dimensions(), od = out->dimensions();
  if (x.element_type() != ffi::DataType::F32 || xd.size() != 2) {
    return invalid(op, "x must be float32 (rows, k), got " + dims_text(xd));
  }
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if ((!bf16 && w.element_type() != ffi::DataType::F32) || wd.size() != 3 || wd[1] != xd[1]) {
    return invalid(op, "w must be float32 or bfloat16 (groups, " + std::to_string(xd[1]) + ", n), got " +
                           dims_text(wd));
  }
  if (sizes.element_type() != ffi::DataType::S32 || sd.size() != 1 || sd[0] != wd[0]) {
    return invalid(op, "group sizes must be int32 (" + std::to_string(wd[0]) + ",), got " + dims_text(sd));
  }
  if (out->element_type() != ffi::DataType::F32 || od.size() != 2 || od[0] != xd[0] || od[1] != wd[2]) {
    return invalid(op, "the result must be float32 (" + std::to_string(xd[0]) + ", " + std::to_string(wd[2]) +
                           "), got " + dims_text(od));
  }
  GroupedMatmulArgs a{xd[0],
                      xd[1],
                      wd[2],
                      wd[0],
                      static_cast<const float*>(x.untyped_data()),
                      w.untyped_data(),
                      bf16,
                      static_cast<const int32_t*>(sizes.untyped_data()),
                      static_cast<float*>(out->untyped_data())};
  if (std::string err = check_group_sizes(a); !err.empty()) return invalid(op, err);
  try {
    grouped_matmul(a, pool_workers(pool), pool_spawn(pool));
  } catch (const std::exception& e) {
    return to_ffi_error(op, e);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_grouped_matmul_cpu, GroupedMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x (rows, k) float32, sorted by group
                                  .Arg<ffi::AnyBuffer>()   // w (groups, k, n) float32 / bfloat16
                                  .Arg<ffi::AnyBuffer>()   // sizes (groups,) int32
                                  .Ret<ffi::AnyBuffer>());  // (rows, n) float32

}  // namespace kvcached
