#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "half.h"

namespace kvcached {
namespace {

constexpr float kMasked = -1e30f;  // matches jax_kvcached.attention._MASKED

// One row of head_dim values as floats (a pointer into the view for fp32, else converted;
// kD > 0: a compile-time head_dim, so the conversion loop unrolls and vectorises).
template <int64_t kD>
const float* load_row(const char* p, DType t, int64_t runtime_d, float* tmp) {
  const int64_t d = kD > 0 ? kD : runtime_d;
  switch (t) {
    case DType::kFloat32:
      return reinterpret_cast<const float*>(p);
    case DType::kBFloat16: {
      // bf16 is the top half of an fp32: widen through integer arrays (no aliasing).
      constexpr int64_t kChunk = kD > 0 ? kD : 64;
      uint16_t h[kChunk] = {};
      uint32_t w[kChunk];
      for (int64_t at = 0; at < d; at += kChunk) {
        const int64_t n = std::min(kChunk, d - at);
        std::memcpy(h, p + 2 * at, static_cast<size_t>(n) * 2);
        for (int64_t i = 0; i < kChunk; ++i) w[i] = static_cast<uint32_t>(h[i]) << 16;
        std::memcpy(tmp + at, w, static_cast<size_t>(n) * 4);
      }
      return tmp;
    }
    case DType::kFloat16:
      for (int64_t i = 0; i < d; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        tmp[i] = half_to_float(h);
      }
      return tmp;
  }
  return tmp;
}

// The hot loops are inlined and compiled with reassociation allowed and, where the build
// machine has them, its vector units (CMakeLists.txt), so the sums below vectorise.

// exp(x) for x <= 0 (scores minus their running max), Cephes' polynomial: a relative
// error near 1e-7, and unlike std::exp it vectorises.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Eight independent partial sums: vectorises even without reassociation; a compile-time
// head_dim unrolls.
template <int64_t kD>
inline float dot(const float* a, const float* b, int64_t runtime_n) {
  const int64_t n = kD > 0 ? kD : runtime_n;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

constexpr int64_t kLanes = 16;  // keys scored together: one AVX-512 / two AVX2 registers
constexpr int64_t kFewRows = 4;  // fewer rows (decode): read K and V in place, no staging

// The online-softmax state of some query rows of one (sequence, KV head). Keys come in
// groups of kLanes: K transposed (head_dim x kLanes) so a row's kLanes scores are
// vector FMAs with no horizontal sums, four rows at a time sharing each K load.
template <int64_t kD>
struct Rows {
  int64_t n, d;
  float scale;
  std::vector<const float*> q;
  std::vector<float*> o;
  std::vector<float> m, l, s, kt, vb, tmp;

  Rows(int64_t nrows, int64_t dim, float sc)
      : n(nrows), d(kD > 0 ? kD : dim), scale(sc), q(nrows), o(nrows), m(nrows, kMasked),
        l(nrows, 0.f), s(static_cast<size_t>(nrows * kLanes)), kt(static_cast<size_t>(dim * kLanes)),
        vb(static_cast<size_t>(dim * kLanes)), tmp(dim) {}

  // Attends every row to `count` keys: key(j) / val(j) give rows of floats (tmp buffers
  // offered), visible(r, j) masks (causal). Rows that see none of them stay as they are.
  template <typename Key, typename Val, typename Visible>
  void chunk(int64_t count, Key key, Val val, Visible visible) {
    for (int64_t j0 = 0; j0 < count; j0 += kLanes) group(j0, std::min(kLanes, count - j0), key, val, visible);
  }

 private:
  // Scores of four rows at once: each K load feeds four FMAs.
  void scores4(int64_t r) {
    const float *q0 = q[r], *q1 = q[r + 1], *q2 = q[r + 2], *q3 = q[r + 3];
    float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
    for (int64_t x = 0; x < d; ++x) {
      const float* k = &kt[static_cast<size_t>(x * kLanes)];
      const float b0 = q0[x], b1 = q1[x], b2 = q2[x], b3 = q3[x];
      for (int64_t j = 0; j < kLanes; ++j) {
        a0[j] += b0 * k[j];
        a1[j] += b1 * k[j];
        a2[j] += b2 * k[j];
        a3[j] += b3 * k[j];
      }
    }
    float* out = &s[static_cast<size_t>(r * kLanes)];
    for (int64_t j = 0; j < kLanes; ++j) {
      out[j] = a0[j];
      out[kLanes + j] = a1[j];
      out[2 * kLanes + j] = a2[j];
      out[3 * kLanes + j] = a3[j];
    }
  }

  void scores1(int64_t r) {
    float a[kLanes] = {};
    const float* qr = q[r];
    for (int64_t x = 0; x < d; ++x) {
      const float* k = &kt[static_cast<size_t>(x * kLanes)];
      for (int64_t j = 0; j < kLanes; ++j) a[j] += qr[x] * k[j];
    }
    std::copy(a, a + kLanes, &s[static_cast<size_t>(r * kLanes)]);
  }

  // o[r] = o[r] * corr + sum_j p[j] v[j] (a compile-time head_dim keeps o in registers).
  void accumulate(int64_t r, float corr, const float* p, int64_t c) {
    float* out = o[r];
    if constexpr (kD > 0) {
      float acc[kD];
      for (int64_t x = 0; x < kD; ++x) acc[x] = out[x] * corr;
      for (int64_t j = 0; j < c; ++j) {
        const float pj = p[j];
        const float* v = &vb[static_cast<size_t>(j * kD)];
        for (int64_t x = 0; x < kD; ++x) acc[x] += pj * v[x];
      }
      std::copy(acc, acc + kD, out);
    } else {
      for (int64_t x = 0; x < d; ++x) out[x] *= corr;
      for (int64_t j = 0; j < c; ++j) {
        const float pj = p[j];
        const float* v = &vb[static_cast<size_t>(j * d)];
        for (int64_t x = 0; x < d; ++x) out[x] += pj * v[x];
      }
    }
  }

  // Few rows (decode: memory-bound): each key and value row is read once where it lies
  // and used for every row; staging them (transposing K) would cost more than it saves.
  template <typename Key, typename Val, typename Visible>
  void group_few(int64_t j0, int64_t c, Key key, Val val, Visible visible) {
    for (int64_t j = 0; j < c; ++j) {
      const float* k = key(j0 + j, tmp.data());
      for (int64_t r = 0; r < n; ++r) s[static_cast<size_t>(r * kLanes + j)] = dot<kD>(q[r], k, d);
    }
    float corr[kFewRows];
    for (int64_t r = 0; r < n; ++r) corr[r] = softmax_row(r, j0, c, visible);
    for (int64_t r = 0; r < n; ++r) {
      if (corr[r] < 0.f) continue;  // nothing visible to this row here
      for (int64_t x = 0; x < d; ++x) o[r][x] *= corr[r];
    }
    for (int64_t j = 0; j < c; ++j) {
      const float* v = val(j0 + j, tmp.data());
      for (int64_t r = 0; r < n; ++r) {
        const float p = corr[r] < 0.f ? 0.f : s[static_cast<size_t>(r * kLanes + j)];
        if (p == 0.f) continue;
        float* out = o[r];
        for (int64_t x = 0; x < (kD > 0 ? kD : d); ++x) out[x] += p * v[x];
      }
    }
  }

  // Masks, scales and exponentiates row r's scores of keys [j0, j0 + c) against its
  // running max; returns the factor for what it accumulated before (-1: it sees none).
  template <typename Visible>
  float softmax_row(int64_t r, int64_t j0, int64_t c, Visible visible) {
    float* sr = &s[static_cast<size_t>(r * kLanes)];
    float mb = kMasked;
    for (int64_t j = 0; j < c; ++j) {
      sr[j] = visible(r, j0 + j) ? sr[j] * scale : kMasked;
      mb = std::max(mb, sr[j]);
    }
    if (mb <= kMasked) return -1.f;
    float corr = 1.f;
    if (mb > m[r]) {  // rescale what was accumulated under the old max
      corr = fast_exp(m[r] - mb);
      l[r] *= corr;
      m[r] = mb;
    }
    float sum = 0;
    const float mr = m[r];
    for (int64_t j = 0; j < c; ++j) {
      sr[j] = sr[j] <= kMasked ? 0.f : fast_exp(sr[j] - mr);
      sum += sr[j];
    }
    l[r] += sum;
    return corr;
  }

  template <typename Key, typename Val, typename Visible>
  void group(int64_t j0, int64_t c, Key key, Val val, Visible visible) {
    if (n < kFewRows) {
      group_few(j0, c, key, val, visible);
      return;
    }
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j < c) {
        const float* k = key(j0 + j, tmp.data());
        for (int64_t x = 0; x < d; ++x) kt[static_cast<size_t>(x * kLanes + j)] = k[x];
        const float* v = val(j0 + j, tmp.data());
        std::copy(v, v + d, &vb[static_cast<size_t>(j * d)]);
      } else {
        for (int64_t x = 0; x < d; ++x) kt[static_cast<size_t>(x * kLanes + j)] = 0.f;
      }
    }
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) scores4(r);
    for (; r < n; ++r) scores1(r);
    for (r = 0; r < n; ++r) {
      const float corr = softmax_row(r, j0, c, visible);
      if (corr >= 0.f) accumulate(r, corr, &s[static_cast<size_t>(r * kLanes)], c);
    }
  }
};

// One (sequence s, query tokens [t0, t1) of it, KV head h): every query row of those
// tokens and the head's groups over the sequence's cached tokens up to its own position
// (in place, through the block table), then normalised. kD: head_dim when it is a common
// compile-time size, else 0.
template <int64_t kD>
void attend_one(const KVBuffer& buf, const AttendArgs& a, int64_t s, int64_t t0, int64_t t1, int64_t h) {
  const KVLayout& L = buf.layout();
  const int64_t d = kD > 0 ? kD : a.head_dim, bs = L.block_size, g = a.groups;
  const size_t row_bytes = L.row_bytes(), isz = dtype_size(L.dtype);
  const char* k_plane =
      reinterpret_cast<const char*>(buf.base() + static_cast<size_t>(L.planes_per_layer * a.layer) * buf.plane_bytes());
  // A latent cache (one plane) is its own values: out = softmax(q . c) c over all of c's
  // dims, the caller keeps the latent part.
  const char* v_plane = L.planes_per_layer == 2 ? k_plane + buf.plane_bytes() : k_plane;
  const int64_t n = (t1 - t0) * g;
  Rows<kD> rows(n, d, a.scale);
  const int64_t first = a.q_start[s];
  for (int64_t r = 0; r < n; ++r) {
    const int64_t off = ((first + t0 + r / g) * a.kv_heads + h) * g + r % g;
    rows.q[r] = a.q + off * d;
    rows.o[r] = a.out + off * d;
    if (a.sinks != nullptr) {  // the sink as the softmax's first key (value zero)
      rows.m[r] = a.sinks[h * g + r % g];
      rows.l[r] = 1.f;
    }
  }
  // Row r is the query at position p0 + r / g; it sees keys at positions <= that.
  const int64_t p0 = a.kv_lens[s] - a.q_lens[s] + t0;
  const int64_t end = p0 + (t1 - t0);  // keys any row of the tile sees
  const int64_t w = a.window;
  const int64_t lo = w > 0 ? std::max<int64_t>(0, p0 - w + 1) : 0;  // the first key any row sees
  const int64_t full_from = w > 0 ? end - w : 0;  // keys from here on: inside every row's window
  auto all = [](int64_t, int64_t) { return true; };
  for (int64_t i = lo / bs; i * bs < end; ++i) {
    const int64_t count = std::min(bs, end - i * bs);
    const size_t base = static_cast<size_t>(a.tables[s * a.nb + i] * bs) * row_bytes + static_cast<size_t>(h * d) * isz;
    auto key = [&](int64_t j, float* tmp) { return load_row<kD>(k_plane + base + j * row_bytes, L.dtype, d, tmp); };
    auto val = [&](int64_t j, float* tmp) { return load_row<kD>(v_plane + base + j * row_bytes, L.dtype, d, tmp); };
    if (i * bs + count <= p0 + 1 && (w <= 0 || i * bs >= full_from)) {  // every row sees it all
      rows.chunk(count, key, val, all);
    } else if (w <= 0) {
      rows.chunk(count, key, val, [&](int64_t r, int64_t j) { return i * bs + j <= p0 + r / g; });
    } else {  // causal and inside the window
      rows.chunk(count, key, val, [&](int64_t r, int64_t j) {
        const int64_t p = p0 + r / g, k = i * bs + j;
        return k <= p && k > p - w;
      });
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = rows.l[r] > 0.f ? 1.f / rows.l[r] : 0.f;
    for (int64_t x = 0; x < d; ++x) rows.o[r][x] *= inv;
  }
}

using AttendOne = void (*)(const KVBuffer&, const AttendArgs&, int64_t, int64_t, int64_t, int64_t);

AttendOne attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_one<32>;
    case 64: return attend_one<64>;
    case 80: return attend_one<80>;
    case 96: return attend_one<96>;
    case 128: return attend_one<128>;
    case 256: return attend_one<256>;
    default: return attend_one<0>;
  }
}

std::string check_ragged(const AttendArgs& a) {
  if (a.window < 0) return "window = " + std::to_string(a.window) + " must be >= 0 (0: none)";
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t s = 0; s < a.seqs; ++s) {
    const int64_t ql = a.q_lens[s], qs = a.q_start[s], kl = a.kv_lens[s];
    const std::string at = "[" + std::to_string(s) + "]";
    if (ql < 0 || ql > kl) {
      return "q_lens" + at + " = " + std::to_string(ql) + " out of range [0, kv_lens" + at + " = " +
             std::to_string(kl) + "]";
    }
    if (ql == 0) continue;
    if (qs < 0 || qs > a.tokens - ql) {
      return "q_start" + at + " = " + std::to_string(qs) + " with q_lens" + at + " = " + std::to_string(ql) +
             " runs past the " + std::to_string(a.tokens) + " query rows";
    }
    ranges.emplace_back(qs, qs + ql);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return "two sequences' query rows overlap";
  }
  return {};
}

}  // namespace

std::string attend_host(const KVBuffer& buf, const AttendArgs& a, int64_t workers, const Spawn& spawn) {
  if (std::string err = check_ragged(a); !err.empty()) return err;
  std::shared_lock<std::shared_mutex> lock(buf.mutex());  // no unmap while we read
  std::vector<int64_t> first_read(static_cast<size_t>(a.seqs), 0);
  if (a.window > 0) {
    for (int64_t s = 0; s < a.seqs; ++s) first_read[s] = a.kv_lens[s] - a.q_lens[s] - a.window + 1;
  }
  if (std::string err = buf.check_read(a.layer, a.tables, a.seqs, a.nb, a.kv_lens, first_read.data());
      !err.empty()) {
    return err;
  }
  std::fill(a.out, a.out + a.tokens * a.kv_heads * a.groups * a.head_dim, 0.f);
  // Tasks: (sequence, tile of up to kTile query tokens, KV head). Tiles bound a task's
  // rows (their scores stay in cache) and spread one long prefill chunk over the cores.
  constexpr int64_t kTile = 32;
  struct Task {
    int64_t s, t0, t1, h;
  };
  std::vector<Task> todo;
  for (int64_t s = 0; s < a.seqs; ++s) {
    for (int64_t t0 = 0; t0 < a.q_lens[s]; t0 += kTile) {
      for (int64_t h = 0; h < a.kv_heads; ++h) todo.push_back({s, t0, std::min<int64_t>(a.q_lens[s], t0 + kTile), h});
    }
  }
  const AttendOne one = attend_for(a.head_dim);
  parallel_for(static_cast<int64_t>(todo.size()), workers, spawn, [&](int64_t i) {
    const Task& t = todo[static_cast<size_t>(i)];
    one(buf, a, t.s, t.t0, t.t1, t.h);
  });
  return {};
}

}  // namespace kvcached
