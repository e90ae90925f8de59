// Ragged paged attention on the host backend: reads K/V in place from the view's planes
// through block tables (no gathered copy), one (sequence, tile of query rows, KV head) per
// task. The step's own K/V are already in the cache (written before the call), so every
// query row sees the cached tokens up to its own position.
#pragma once

#include <cstdint>
#include <functional>

#include "kv_buffer.h"
#include "parallel.h"

namespace kvcached {

struct AttendArgs {
  int64_t layer;
  int64_t tokens, seqs, kv_heads, groups, head_dim;  // q: (tokens, kv_heads, groups, head_dim)
  int64_t nb;                                        // block table width
  int64_t window;                                    // > 0: a query at p sees keys > p - window
  float scale;
  const float* q;
  const int32_t* tables;   // (seqs, nb)
  const int32_t* kv_lens;  // (seqs,): tokens in the cache, this step's new ones included
  const int32_t* q_start;  // (seqs,): flat index of the sequence's first query row
  const int32_t* q_lens;   // (seqs,): its query rows: the positions kv_len - q_len .. kv_len - 1
  float* out;              // (tokens, kv_heads, groups, head_dim), normalised; 0 where no sequence
  // (kv_heads, groups): a learned logit per query head in the softmax's denominator
  // (attention sinks: GPT-OSS), a key of value zero every row sees; nullptr: none.
  const float* sinks = nullptr;
};

// Validates the ragged layout (query ranges inside the token axis, disjoint, no longer
// than their sequence) and, under the buffer's shared lock, the block tables (from the
// first block a window lets any row see); then computes causal attention of every query
// row over its sequence's cached tokens at positions <= its own (and, with a window,
// > its own - window: blocks wholly below are skipped, never read). Returns "" or what is
// wrong (nothing computed then).
std::string attend_host(const KVBuffer& buf, const AttendArgs& a, int64_t workers, const Spawn& spawn);

}  // namespace kvcached
