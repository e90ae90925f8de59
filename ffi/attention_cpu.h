// Paged attention on the host backend: reads K/V in place from the view's planes through
// block tables (no gathered copy), one (sequence, KV head) per task.
#pragma once

#include <cstdint>
#include <functional>

#include "kv_buffer.h"

namespace kvcached {

struct AttendArgs {
  int64_t layer;
  int64_t batch, rows, kv_heads, groups, head_dim;  // q: (batch, rows, kv_heads, groups, head_dim)
  int64_t nb;                                       // block table width
  float scale;
  const float* q;
  const float* k_new;       // (batch, rows, kv_heads, head_dim): the step's new keys
  const float* v_new;       // the same for values
  const int32_t* tables;    // (batch, nb)
  const int32_t* ctx_lens;  // (batch,): cached tokens
  const int32_t* new_lens;  // (batch,): valid new tokens (the rest of `rows` is padding)
  float* out;               // (batch, rows, kv_heads, groups, head_dim), normalised
  float* max;               // (batch, rows, kv_heads, groups): the max score seen
  float* sum;               // the same shape: the sum of exp(score - max)
};

// Runs fn(task) for task in [0, n) on up to `workers` threads (the caller included);
// `spawn(f)` schedules f on another thread.
using Spawn = std::function<void(std::function<void()>)>;

// Validates (shared lock held) and computes the attention of every query row over the
// first ctx_lens[b] cached tokens of its sequence and the new tokens up to its own
// position (causal). Throws Error on bad input.
void attend_host(const KVBuffer& buf, const AttendArgs& a, int64_t workers, const Spawn& spawn);

}  // namespace kvcached
