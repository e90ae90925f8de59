// The grouped matmul (see grouped_matmul.h). Work is split into tasks of one group and
// kCols output columns; each task runs its group's rows kRows at a time against a panel of
// the weight (kCols columns of every k), so a panel is read once per kRows rows. Decode
// (a few rows per expert) reads each chosen expert's weight once: bandwidth bound, as it
// must be; prefill reuses each panel over many rows.
#include "grouped_matmul.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "errors.h"

namespace kvcached {
namespace {

constexpr int64_t kCols = 64;  // output columns a task takes (4 x 16 floats)
constexpr int kRows = 4;       // rows a panel pass takes

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float weight_at(const GroupedMatmulArgs& a, int64_t i) {
  return a.w_bf16 ? bf16_to_float(static_cast<const uint16_t*>(a.w)[i]) : static_cast<const float*>(a.w)[i];
}

// Rows [r0, r0 + nr) of x (nr <= kRows) times columns [c0, c0 + nc) of w's group g
// (nc <= kCols), written to out.
void panel_portable(const GroupedMatmulArgs& a, int64_t g, int64_t r0, int nr, int64_t c0, int64_t nc) {
  float acc[kRows][kCols] = {};
  const int64_t base = g * a.k * a.n;
  for (int64_t kk = 0; kk < a.k; ++kk) {
    float w[kCols];
    for (int64_t c = 0; c < nc; ++c) w[c] = weight_at(a, base + kk * a.n + c0 + c);
    for (int r = 0; r < nr; ++r) {
      const float xv = a.x[(r0 + r) * a.k + kk];
      for (int64_t c = 0; c < nc; ++c) acc[r][c] += xv * w[c];
    }
  }
  for (int r = 0; r < nr; ++r) std::memcpy(a.out + (r0 + r) * a.n + c0, acc[r], sizeof(float) * nc);
}

#define KVCACHED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

template <bool BF16>
KVCACHED_AVX512 inline __attribute__((always_inline)) __m512 load16(const GroupedMatmulArgs& a, int64_t at,
                                                                   __mmask16 mask) {
  if constexpr (BF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(a.w) + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(a.w) + at);
  }
}

// The lanes of 16-column vector v that hold some of nc columns.
inline __mmask16 cols_mask(int64_t nc, int v) {
  const int64_t left = std::clamp<int64_t>(nc - 16 * v, 0, 16);
  return static_cast<__mmask16>((1u << left) - 1u);
}

KVCACHED_AVX512 inline __attribute__((always_inline)) void store64(float* o, const __mmask16* m, __m512 v0,
                                                                  __m512 v1, __m512 v2, __m512 v3) {
  _mm512_mask_storeu_ps(o, m[0], v0);
  _mm512_mask_storeu_ps(o + 16, m[1], v1);
  _mm512_mask_storeu_ps(o + 32, m[2], v2);
  _mm512_mask_storeu_ps(o + 48, m[3], v3);
}

// NR rows x 64 columns in 4 x NR registers (written out: GCC keeps arrays of vectors
// indexed in loops on the stack).
template <int NR, bool BF16>
KVCACHED_AVX512 void panel_avx512_rows(const GroupedMatmulArgs& a, int64_t g, int64_t r0, int64_t c0,
                                       int64_t nc) {
  const __mmask16 m0 = cols_mask(nc, 0), m1 = cols_mask(nc, 1), m2 = cols_mask(nc, 2), m3 = cols_mask(nc, 3);
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m512 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  __m512 a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  const int64_t base = g * a.k * a.n + c0;
  const float* x = a.x + r0 * a.k;
  for (int64_t kk = 0; kk < a.k; ++kk) {
    const int64_t at = base + kk * a.n;
    const __m512 w0 = load16<BF16>(a, at, m0), w1 = load16<BF16>(a, at + 16, m1);
    const __m512 w2 = load16<BF16>(a, at + 32, m2), w3 = load16<BF16>(a, at + 48, m3);
    __m512 xv = _mm512_set1_ps(x[kk]);
    a00 = _mm512_fmadd_ps(xv, w0, a00), a01 = _mm512_fmadd_ps(xv, w1, a01);
    a02 = _mm512_fmadd_ps(xv, w2, a02), a03 = _mm512_fmadd_ps(xv, w3, a03);
    if constexpr (NR > 1) {
      xv = _mm512_set1_ps(x[a.k + kk]);
      a10 = _mm512_fmadd_ps(xv, w0, a10), a11 = _mm512_fmadd_ps(xv, w1, a11);
      a12 = _mm512_fmadd_ps(xv, w2, a12), a13 = _mm512_fmadd_ps(xv, w3, a13);
    }
    if constexpr (NR > 2) {
      xv = _mm512_set1_ps(x[2 * a.k + kk]);
      a20 = _mm512_fmadd_ps(xv, w0, a20), a21 = _mm512_fmadd_ps(xv, w1, a21);
      a22 = _mm512_fmadd_ps(xv, w2, a22), a23 = _mm512_fmadd_ps(xv, w3, a23);
    }
    if constexpr (NR > 3) {
      xv = _mm512_set1_ps(x[3 * a.k + kk]);
      a30 = _mm512_fmadd_ps(xv, w0, a30), a31 = _mm512_fmadd_ps(xv, w1, a31);
      a32 = _mm512_fmadd_ps(xv, w2, a32), a33 = _mm512_fmadd_ps(xv, w3, a33);
    }
  }
  const __mmask16 m[4] = {m0, m1, m2, m3};
  float* o = a.out + r0 * a.n + c0;
  store64(o, m, a00, a01, a02, a03);
  if constexpr (NR > 1) store64(o + a.n, m, a10, a11, a12, a13);
  if constexpr (NR > 2) store64(o + 2 * a.n, m, a20, a21, a22, a23);
  if constexpr (NR > 3) store64(o + 3 * a.n, m, a30, a31, a32, a33);
}

template <bool BF16>
void panel_avx512(const GroupedMatmulArgs& a, int64_t g, int64_t r0, int nr, int64_t c0, int64_t nc) {
  switch (nr) {
    case 1:
      return panel_avx512_rows<1, BF16>(a, g, r0, c0, nc);
    case 2:
      return panel_avx512_rows<2, BF16>(a, g, r0, c0, nc);
    case 3:
      return panel_avx512_rows<3, BF16>(a, g, r0, c0, nc);
    default:
      return panel_avx512_rows<4, BF16>(a, g, r0, c0, nc);
  }
}

enum class Isa { kAuto, kPortable, kAvx512 };
std::atomic<Isa> g_isa{Isa::kAuto};

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

Isa resolved() {
  const Isa isa = g_isa.load();
  if (isa != Isa::kAuto) return isa;
  return has_avx512() ? Isa::kAvx512 : Isa::kPortable;
}

}  // namespace

std::string check_group_sizes(const GroupedMatmulArgs& a) {
  int64_t total = 0;
  for (int64_t g = 0; g < a.groups; ++g) {
    if (a.sizes[g] < 0) return "group " + std::to_string(g) + " has a negative size " + std::to_string(a.sizes[g]);
    total += a.sizes[g];
  }
  if (total > a.rows) {
    return "the group sizes add up to " + std::to_string(total) + " rows, more than x's " + std::to_string(a.rows);
  }
  return "";
}

void grouped_matmul(const GroupedMatmulArgs& a, int64_t workers, const Spawn& spawn) {
  using Panel = void (*)(const GroupedMatmulArgs&, int64_t, int64_t, int, int64_t, int64_t);
  const Panel panel = resolved() == Isa::kAvx512 ? (a.w_bf16 ? panel_avx512<true> : panel_avx512<false>)
                                                 : panel_portable;
  struct Task {
    int64_t group, r0, r1, c0;
  };
  std::vector<Task> tasks;
  const int64_t col_tiles = (a.n + kCols - 1) / kCols;
  constexpr int64_t kTaskRows = 64;  // a big group's rows split too (prefill)
  int64_t start = 0;
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int64_t r = start; r < start + a.sizes[g]; r += kTaskRows) {
      for (int64_t t = 0; t < col_tiles; ++t) {
        tasks.push_back({g, r, std::min(r + kTaskRows, start + a.sizes[g]), t * kCols});
      }
    }
    start += a.sizes[g];
  }
  if (start < a.rows) std::memset(a.out + start * a.n, 0, sizeof(float) * (a.rows - start) * a.n);
  parallel_for(static_cast<int64_t>(tasks.size()), workers, spawn, [&](int64_t i) {
    const Task& t = tasks[i];
    const int64_t nc = std::min(kCols, a.n - t.c0);
    for (int64_t r = t.r0; r < t.r1; r += kRows) {
      panel(a, t.group, r, static_cast<int>(std::min<int64_t>(kRows, t.r1 - r)), t.c0, nc);
    }
  });
}

std::string grouped_isa() { return resolved() == Isa::kAvx512 ? "avx512" : "portable"; }

void set_grouped_isa(const std::string& name) {
  if (name == "auto") {
    g_isa.store(Isa::kAuto);
  } else if (name == "portable") {
    g_isa.store(Isa::kPortable);
  } else if (name == "avx512") {
    if (!has_avx512()) throw Error("this CPU has no avx512");
    g_isa.store(Isa::kAvx512);
  } else {
    throw Error("unknown instruction set '" + name + "' (auto, portable, avx512)");
  }
}

}  // namespace kvcached
