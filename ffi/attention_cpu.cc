#include "attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "errors.h"

namespace kvcached {
namespace {

constexpr float kMasked = -1e30f;  // matches jax_kvcached.attention._MASKED

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

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

// The hot loops: inlined (an out-of-line or ifunc-dispatched call per row cost 3x here)
// and compiled with reassociation allowed (CMakeLists.txt), so the sums vectorise.
// Eight independent partial sums: vectorises even without reassociation.
template <int64_t kD>
inline float dot(const float* a, const float* b, int64_t runtime_n) {
  const int64_t n = kD > 0 ? kD : runtime_n;  // a compile-time head_dim unrolls (3x here)
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

template <int64_t kD>
inline void axpy(float a, const float* x, float* y, int64_t runtime_n) {
  const int64_t n = kD > 0 ? kD : runtime_n;
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// The online-softmax state of the query rows of one (sequence, KV head).
template <int64_t kD>
struct Rows {
  int64_t n, d;
  float scale;
  std::vector<const float*> q;
  std::vector<float*> o;
  std::vector<float> m, l, s, krow, vrow;

  Rows(int64_t nrows, int64_t dim, int64_t chunk, float sc)
      : n(nrows), d(kD > 0 ? kD : dim), scale(sc), q(nrows), o(nrows), m(nrows, kMasked),
        l(nrows, 0.f), s(static_cast<size_t>(nrows * chunk)), krow(dim), vrow(dim) {}

  // Attends every row to `count` keys: key(j) / val(j) give rows of floats (tmp buffers
  // offered), visible(r, j) masks (causal new tokens). Rows that see none of them are
  // left as they are.
  template <typename Key, typename Val, typename Visible>
  void chunk(int64_t count, int64_t stride, Key key, Val val, Visible visible) {
    for (int64_t j = 0; j < count; ++j) {
      const float* k = key(j, krow.data());
      for (int64_t r = 0; r < n; ++r) {
        s[static_cast<size_t>(r * stride + j)] = visible(r, j) ? dot<kD>(q[r], k, d) * scale : kMasked;
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      float* sr = &s[static_cast<size_t>(r * stride)];
      const float mb = *std::max_element(sr, sr + count);
      if (mb <= kMasked) {  // nothing visible to this row here
        std::fill(sr, sr + count, 0.f);
        continue;
      }
      if (mb > m[r]) {  // rescale what was accumulated under the old max
        const float corr = std::exp(m[r] - mb);
        l[r] *= corr;
        for (int64_t x = 0; x < d; ++x) o[r][x] *= corr;
        m[r] = mb;
      }
      float sum = 0;
      for (int64_t j = 0; j < count; ++j) {
        sr[j] = sr[j] <= kMasked ? 0.f : std::exp(sr[j] - m[r]);
        sum += sr[j];
      }
      l[r] += sum;
    }
    for (int64_t j = 0; j < count; ++j) {
      const float* v = val(j, vrow.data());
      for (int64_t r = 0; r < n; ++r) {
        const float p = s[static_cast<size_t>(r * stride + j)];
        if (p != 0.f) axpy<kD>(p, v, o[r], d);
      }
    }
  }
};

// One (sequence b, KV head h): every query row of the head's groups over the cached
// tokens (in place, through the block table) and the step's new tokens (causal), then
// normalised. kD: head_dim when it is a common compile-time size, else 0.
template <int64_t kD>
void attend_one(const KVBuffer& buf, const AttendArgs& a, int64_t b, int64_t h) {
  const KVLayout& L = buf.layout();
  const int64_t d = kD > 0 ? kD : a.head_dim, bs = L.block_size, g = a.groups, T = a.rows;
  const size_t row_bytes = L.row_bytes(), isz = dtype_size(L.dtype);
  const char* k_plane = reinterpret_cast<const char*>(buf.base() + static_cast<size_t>(2 * a.layer) * buf.plane_bytes());
  const char* v_plane = k_plane + buf.plane_bytes();
  Rows<kD> rows(T * g, d, std::max(bs, T), a.scale);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t off = ((b * T + t) * a.kv_heads + h) * g + j;
      rows.q[t * g + j] = a.q + off * d;
      rows.o[t * g + j] = a.out + off * d;
      std::fill(a.out + off * d, a.out + (off + 1) * d, 0.f);
    }
  }
  const int64_t ctx = a.ctx_lens[b];
  auto all = [](int64_t, int64_t) { return true; };
  for (int64_t i = 0; i * bs < ctx; ++i) {
    const size_t base = static_cast<size_t>(a.tables[b * a.nb + i] * bs) * row_bytes + static_cast<size_t>(h * d) * isz;
    rows.chunk(
        std::min(bs, ctx - i * bs), bs,
        [&](int64_t j, float* tmp) { return load_row<kD>(k_plane + base + j * row_bytes, L.dtype, d, tmp); },
        [&](int64_t j, float* tmp) { return load_row<kD>(v_plane + base + j * row_bytes, L.dtype, d, tmp); }, all);
  }
  // The new tokens: row (t, g) sees new token u when u <= t and u is not padding.
  const int64_t valid = a.new_lens[b];
  const int64_t knew = (b * T * a.kv_heads + h) * d, step = a.kv_heads * d;
  rows.chunk(
      T, std::max(bs, T), [&](int64_t u, float*) { return a.k_new + knew + u * step; },
      [&](int64_t u, float*) { return a.v_new + knew + u * step; },
      [&](int64_t r, int64_t u) { return u <= r / g && u < valid; });
  for (int64_t r = 0; r < T * g; ++r) {
    const float inv = rows.l[r] > 0.f ? 1.f / rows.l[r] : 0.f;  // no key at all: zeros
    for (int64_t x = 0; x < d; ++x) rows.o[r][x] *= inv;
    const int64_t off = ((b * T + r / g) * a.kv_heads + h) * g + r % g;
    a.max[off] = rows.m[r];
    a.sum[off] = rows.l[r];
  }
}

using AttendOne = void (*)(const KVBuffer&, const AttendArgs&, int64_t, int64_t);

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

}  // namespace

void attend_host(const KVBuffer& buf, const AttendArgs& a, int64_t workers, const Spawn& spawn) {
  std::shared_lock<std::shared_mutex> lock(buf.mutex());  // no unmap while we read
  const std::string err = buf.check_read(a.layer, a.tables, a.batch, a.nb, a.ctx_lens);
  if (!err.empty()) throw Error(err);
  // Helpers may start late (the pool busy with other work): the caller takes tasks too and
  // waits only for tasks taken, never for a helper to start, so it cannot deadlock. The
  // shared state outlives the call for helpers that start after it returned.
  struct State {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t finished = 0;
  };
  auto st = std::make_shared<State>();
  const int64_t tasks = a.batch * a.kv_heads;
  const AttendOne one = attend_for(a.head_dim);
  auto run = [st, tasks, one, &buf, &a] {
    for (int64_t i = st->next++; i < tasks; i = st->next++) {
      one(buf, a, i / a.kv_heads, i % a.kv_heads);
      std::lock_guard<std::mutex> g(st->mu);
      if (++st->finished == tasks) st->cv.notify_all();
    }
  };
  for (int64_t w = 1; w < std::min(workers, tasks); ++w) spawn(run);
  run();
  std::unique_lock<std::mutex> g(st->mu);
  st->cv.wait(g, [&] { return st->finished == tasks; });
}

}  // namespace kvcached
