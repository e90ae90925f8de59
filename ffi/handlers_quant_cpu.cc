// quant_matmul on the CPU: float activations times packed int8 / int4 weights (see
// quant_matmul.h), on XLA's intra-op thread pool. One call takes one activation and one
// or more weights (a layer's Q, K and V): operands x, then (q, scales, mins) per weight;
// one result per weight. Every shape is checked before a read.
#include <string>
#include <vector>

#include "handler_common.h"
#include "handlers.h"
#include "quant_matmul.h"

namespace kvcached {
namespace {

ffi::Error check_part(const char* op, size_t i, int64_t bits, QuantMatmulArgs& a, ffi::AnyBuffer q,
                      ffi::AnyBuffer scales, ffi::AnyBuffer mins, ffi::AnyBuffer out) {
  const std::string which = "weight " + std::to_string(i) + ": ";
  const auto qd = q.dimensions(), sd = scales.dimensions(), md = mins.dimensions();
  const ffi::DataType qt = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (q.element_type() != qt || qd.size() != 2) {
    return invalid(op, which + "q must be " + (bits == 8 ? "int8" : "uint8") + " (outputs, " +
                           (bits == 8 ? "inputs" : "inputs / 2") + "), got " + dims_text(qd));
  }
  a.n = qd[0];
  if (std::string err = check_quant_matmul(a); !err.empty()) return invalid(op, which + err);
  if (qd[1] != (bits == 8 ? a.k : a.k / 2)) {
    return invalid(op, which + "q " + dims_text(qd) + " does not hold " + std::to_string(a.k) + " inputs of " +
                           std::to_string(bits) + " bits a row");
  }
  const int64_t ng = a.k / a.group;
  if (scales.element_type() != ffi::DataType::F16 || sd.size() != 2 || sd[0] != a.n || sd[1] != ng) {
    return invalid(op, which + "scales must be float16 (" + std::to_string(a.n) + ", " + std::to_string(ng) +
                           "), got " + dims_text(sd));
  }
  const bool has_min = mins.element_count() != 0;
  if (has_min && (mins.element_type() != ffi::DataType::F16 || md.size() != 2 || md[0] != a.n || md[1] != ng)) {
    return invalid(op, which + "mins must be float16 like the scales, or empty, got " + dims_text(md));
  }
  const auto od = out.dimensions();
  if (out.element_type() != ffi::DataType::F32 || od.size() != 2 || od[0] != a.rows || od[1] != a.n) {
    return invalid(op, which + "the result must be float32 (rows, outputs)");
  }
  a.q = static_cast<const uint8_t*>(q.untyped_data());
  a.scales = static_cast<const uint16_t*>(scales.untyped_data());
  a.mins = has_min ? static_cast<const uint16_t*>(mins.untyped_data()) : nullptr;
  a.out = static_cast<float*>(out.untyped_data());
  return ffi::Error::Success();
}

ffi::Error QuantMatmulCpu(ffi::ThreadPool pool, int64_t bits, int64_t group, ffi::AnyBuffer x,
                          ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const char* op = "quant_matmul";
  const auto xd = x.dimensions();
  if (x.element_type() != ffi::DataType::F32 || xd.size() != 2) {
    return invalid(op, "x must be float32 (rows, inputs), got " + dims_text(xd));
  }
  if (bits != 4 && bits != 8) return invalid(op, "bits must be 4 or 8, got " + std::to_string(bits));
  if (weights.size() == 0 || weights.size() % 3 || weights.size() / 3 != outs.size()) {
    return invalid(op, "takes (q, scales, mins) per weight and one result each, got " +
                           std::to_string(weights.size()) + " operands and " + std::to_string(outs.size()) +
                           " results");
  }
  std::vector<QuantMatmulArgs> parts;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto q = weights.get<ffi::AnyBuffer>(3 * i), s = weights.get<ffi::AnyBuffer>(3 * i + 1),
         m = weights.get<ffi::AnyBuffer>(3 * i + 2);
    auto o = outs.get<ffi::AnyBuffer>(i);
    if (q.has_error() || s.has_error() || m.has_error() || o.has_error()) {
      return invalid(op, "weight " + std::to_string(i) + ": an operand is not a buffer");
    }
    QuantMatmulArgs a{xd[0], 0, xd[1], static_cast<int>(bits), group, static_cast<const float*>(x.untyped_data()),
                      nullptr, nullptr, nullptr, nullptr};
    if (auto e = check_part(op, i, bits, a, *q, *s, *m, **o); e.failure()) return e;
    parts.push_back(a);
  }
  try {
    quant_matmul(parts, pool_workers(pool), pool_spawn(pool));
  } catch (const std::exception& e) {
    return to_ffi_error(op, e);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvcached_quant_matmul_cpu, QuantMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Arg<ffi::AnyBuffer>()  // x (rows, inputs) float32
                                  .RemainingArgs()        // (q, scales, mins) per weight
                                  .RemainingRets());      // (rows, outputs) float32 per weight

}  // namespace kvcached
