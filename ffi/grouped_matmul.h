// Grouped matmul of a mixture of experts: rows of x sorted by group (expert), each group's
// rows times that group's own weight. The CPU side of jax.lax.ragged_dot, which XLA's CPU
// backend computes densely (every row against every group's weight).
//
//   x (rows, k) float32, w (groups, k, n) float32 or bfloat16, sizes (groups,) int32:
//   out[r] = x[r] @ w[g] for the rows r of group g (groups in order, sizes[g] rows each);
//   rows past the sum of sizes are zero (as ragged_dot leaves them).
#pragma once

#include <cstdint>
#include <string>

#include "parallel.h"

namespace kvcached {

struct GroupedMatmulArgs {
  int64_t rows, k, n, groups;
  const float* x;
  const void* w;
  bool w_bf16;
  const int32_t* sizes;  // read on the host (checked by grouped_matmul)
  float* out;
};

// The group sizes are data: "" or what is wrong with them (a negative size, a sum past
// the rows).
std::string check_group_sizes(const GroupedMatmulArgs& a);

// out as described above; the caller has checked shapes and sizes.
void grouped_matmul(const GroupedMatmulArgs& a, int64_t workers, const Spawn& spawn);

// "avx512" or "portable": the kernel this CPU runs; set_grouped_isa forces one (tests
// compare them) and throws Error when the CPU lacks it ("auto": the best).
std::string grouped_isa();
void set_grouped_isa(const std::string& name);

}  // namespace kvcached
