#include "quant_matmul.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "errors.h"
#include "half.h"

namespace kvcached {
namespace {

constexpr int64_t kBlock = 32;  // activation block: one float scale per 32 int8 values
constexpr int64_t kTileN = 4;   // output rows whose weights one pass over a row reuses

// A weight row unpacked to unsigned bytes u, w = (u - zero) * scale (+ min): int8 q + 128
// (zero 128), an int4 nibble (zero 8, or 0 with mins).
int zero_point(int bits, bool has_min) { return bits == 8 ? 128 : (has_min ? 0 : 8); }

void unpack_row(const uint8_t* q, int bits, int64_t k, uint8_t* u) {
  if (bits == 8) {
    for (int64_t j = 0; j < k; ++j) u[j] = static_cast<uint8_t>(q[j] ^ 0x80u);
    return;
  }
  for (int64_t b = 0; b < k; b += kBlock) {
    const uint8_t* p = q + b / 2;
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      u[b + j] = p[j] & 0x0f;
      u[b + j + kBlock / 2] = p[j] >> 4;
    }
  }
}

// Rows are padded to whole pairs of blocks (kp bytes, nbp blocks, zeros past k) so the
// 512-bit kernel reads two blocks at a time with no tail.
constexpr int64_t kPair = 2 * kBlock;
constexpr int64_t kTileR = 4;  // activation rows one kernel call takes
constexpr int64_t kDirectRows = 4;  // up to this many rows: the direct kernel (VNNI, group 32)

// Activation rows quantized per 32-block: xq = rint(x / d), d = max|x| / 127; xs = d * sum(xq)
// (the block's sum as the integer dot sees it, for the zero-point and min terms).
struct QuantizedRows {
  int64_t kp = 0, nbp = 0;
  std::vector<int8_t> q;
  std::vector<float> d, xs;
  std::vector<float> d16;  // VNNI: per pair of blocks, d of the first x8 then of the second x8
};

void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t k, QuantizedRows& out) {
  const int64_t nb = k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * k + b * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = out.q.data() + r * out.kp + b * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float t = std::nearbyint(v[j] * id);
        q[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, t)));
        sum += q[j];
      }
      out.d[r * out.nbp + b] = d;
      out.xs[r * out.nbp + b] = d * static_cast<float>(sum);
    }
  }
}

// A tile's weights made ready: u (kTileN rows of kp unsigned bytes), each block's scale and
// correction coefficient (min - zero * scale), rows of nbp; zeros past k and past the end.
struct Tile {
  int64_t kp = 0, nbp = 0;
  std::vector<uint8_t> u;
  std::vector<float> scale, corr;
  std::vector<float> scale16;  // VNNI: the scales laid out like QuantizedRows::d16
};

// v (n values, n even) as 16 floats per pair: v[2p] x8 then v[2p + 1] x8.
__attribute__((target("avx2"))) void expand16(const float* v, int64_t n, float* out) {
  for (int64_t p = 0; p < n / 2; ++p) {
    _mm256_storeu_ps(out + 16 * p, _mm256_set1_ps(v[2 * p]));
    _mm256_storeu_ps(out + 16 * p + 8, _mm256_set1_ps(v[2 * p + 1]));
  }
}

// out[i][r] = sum over blocks b of scale[i][b] * d[r][b] * (u_i . xq_r)_b + corr[i][b] * xs[r][b]
// for the tile's kTileN outputs and activation rows r0 .. r0 + nr - 1 (nr <= kTileR).
using TileKernel = void (*)(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr,
                            float (*out)[kTileR]);

void tile_portable(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr, float (*out)[kTileR]) {
  for (int64_t i = 0; i < kTileN; ++i) {
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      float acc = 0.f;
      for (int64_t b = 0; b < t.nbp; ++b) {
        int32_t dot = 0;
        const uint8_t* w = t.u.data() + i * t.kp + b * kBlock;
        const int8_t* q = x.q.data() + row * x.kp + b * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<int32_t>(w[j]) * q[j];
        acc += t.scale[i * t.nbp + b] * x.d[row * x.nbp + b] * static_cast<float>(dot) +
               t.corr[i * t.nbp + b] * x.xs[row * x.nbp + b];
      }
      out[i][r] = acc;
    }
  }
}

__attribute__((target("avx2,fma"), always_inline)) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum of a[j] * b[j], j < n (n a multiple of 2), into 8 lanes.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 fdot256(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  if (j < n) {  // the last n - j lanes, masked
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + j, mask), _mm256_maskload_ps(b + j, mask), acc);
  }
  return acc;
}

// AVX2: bytes widened to 16 bits (u up to 255 would saturate maddubs' 16-bit sums).
__attribute__((target("avx2,fma"))) void tile_avx2(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr,
                                                   float (*out)[kTileR]) {
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xq = x.q.data() + row * x.kp;
    const float* dx = x.d.data() + row * x.nbp;
    __m256 acc[kTileN];
    for (int64_t i = 0; i < kTileN; ++i) acc[i] = fdot256(t.corr.data() + i * t.nbp, x.xs.data() + row * x.nbp, t.nbp);
    for (int64_t b = 0; b < t.nbp; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      const __m256i xlo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xv));
      const __m256i xhi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xv, 1));
      for (int64_t i = 0; i < kTileN; ++i) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.u.data() + i * t.kp + b * kBlock));
        const __m256i wlo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w));
        const __m256i whi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wlo, xlo), _mm256_madd_epi16(whi, xhi));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(t.scale[i * t.nbp + b] * dx[b]), acc[i]);
      }
    }
    for (int64_t i = 0; i < kTileN; ++i) out[i][r] = hsum256(acc[i]);
  }
}

#define KVCACHED_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// Two floats as a 512-bit vector: a in the low 8 lanes, b in the high 8.
KVCACHED_VNNI inline __attribute__((always_inline)) __m512 pair_vec(const float* v) {
  const __m512d lo = _mm512_castps_pd(_mm512_set1_ps(v[0]));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_set1_ps(v[1])), 1));
}

// AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes into int32 lanes, exactly; two
// blocks per register; NR activation rows share each weight load (kTileN x NR accumulators).
template <int NR>
KVCACHED_VNNI void tile_vnni_rows(const Tile& t, const QuantizedRows& x, int64_t r0, float (*out)[kTileR]) {
  static_assert(kTileN == 4, "the unrolled loops below take 4 outputs");
  __m512 acc[kTileN][NR];
#pragma GCC unroll 4
  for (int i = 0; i < kTileN; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      acc[i][r] = _mm512_zextps256_ps512(fdot256(t.corr.data() + i * t.nbp, x.xs.data() + (r0 + r) * x.nbp, t.nbp));
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  const uint8_t* u = t.u.data();
  const int8_t* xq = x.q.data() + r0 * x.kp;
  for (int64_t b = 0; b < t.nbp; b += 2) {
    __m512i xv[NR];
    __m512 dx[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      xv[r] = _mm512_loadu_si512(xq + r * x.kp + b * kBlock);
      // One row (decode): scales broadcast on the fly; several: read pre-expanded.
      dx[r] = NR == 1 ? pair_vec(x.d.data() + (r0 + r) * x.nbp + b)
                      : _mm512_loadu_ps(x.d16.data() + ((r0 + r) * x.nbp + b) * 8);
    }
#pragma GCC unroll 4
    for (int i = 0; i < kTileN; ++i) {
      const __m512i w = _mm512_loadu_si512(u + i * t.kp + b * kBlock);
      const __m512 sv = NR == 1 ? pair_vec(t.scale.data() + i * t.nbp + b)
                                : _mm512_loadu_ps(t.scale16.data() + (i * t.nbp + b) * 8);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w, xv[r]));
        acc[i][r] = _mm512_fmadd_ps(p, _mm512_mul_ps(sv, dx[r]), acc[i][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kTileN; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
  }
}

void tile_vnni(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr, float (*out)[kTileR]) {
  switch (nr) {
    case 1:
      return tile_vnni_rows<1>(t, x, r0, out);
    case 2:
      return tile_vnni_rows<2>(t, x, r0, out);
    case 3:
      return tile_vnni_rows<3>(t, x, r0, out);
    default:
      return tile_vnni_rows<4>(t, x, r0, out);
  }
}

// Few rows (decode): outputs read straight from the packed weights, no tile buffers.
// Scales and the zero-point / min terms are done 16 blocks at a time in float vectors;
// each pair of blocks takes its two scales from them with one permute. int4 nibbles are
// split in registers, so the activations are laid out per pair as [x0 0:16, x1 0:16,
// x0 16:32, x1 16:32] (Direct::perm) to meet them: dpbusd lanes 0-3 and 8-11 are the
// first block's, 4-7 and 12-15 the second's.
KVCACHED_VNNI void permute_int4_pairs(QuantizedRows& x, int64_t rows) {
  std::vector<int8_t> tmp(static_cast<size_t>(kPair));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < x.nbp; b += 2) {
      int8_t* p = x.q.data() + r * x.kp + b * kBlock;
      std::copy(p, p + kPair, tmp.begin());
      std::copy(tmp.begin(), tmp.begin() + 16, p);
      std::copy(tmp.begin() + 32, tmp.begin() + 48, p + 16);
      std::copy(tmp.begin() + 16, tmp.begin() + 32, p + 32);
      std::copy(tmp.begin() + 48, tmp.begin() + 64, p + 48);
    }
  }
}

// One pair of blocks of output row q (bytes of row q at block b; int4 or int8).
template <int BITS>
KVCACHED_VNNI inline __attribute__((always_inline)) __m512i load_pair(const uint8_t* q, int64_t b, bool half) {
  if (BITS == 4) {
    const __m256i v = half ? _mm256_maskz_loadu_epi8(0xffffu, q + b * 16)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 16));
    const __m512i vv = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(vv, _mm512_set1_epi8(0x0f));
  }
  const __m512i v = half ? _mm512_maskz_loadu_epi8(0xffffffffull, q + b * kBlock) : _mm512_loadu_si512(q + b * kBlock);
  return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// NO output rows at a time (independent chains), NR activation rows.
template <int BITS, int NR, int NO>
KVCACHED_VNNI void direct_rows(const QuantMatmulArgs& a, const QuantizedRows& x, int64_t o) {
  const int64_t k = a.k, nb = k / kBlock;
  const int64_t row_bytes = BITS == 4 ? k / 2 : k;
  const float zero = static_cast<float>(zero_point(BITS, a.mins != nullptr));
  // Lane -> block of the pair: int4 (0,1,0,1 per 4 lanes), int8 (0 x8, 1 x8).
  const __m512i pat = BITS == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                                : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[NO][NR], cacc[NO][NR];
  #pragma GCC unroll 4
  for (int j = 0; j < NO; ++j) {
    #pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) acc[j][r] = cacc[j][r] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < nb; c += 16) {  // 16 blocks: scales as floats
    const int64_t left = std::min<int64_t>(16, nb - c);
    const __mmask16 m16 = static_cast<__mmask16>((1u << left) - 1u);
    __m512 sdx[NO][NR];
    #pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) {
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m16, a.scales + (o + j) * nb + c));
      const __m512 mv =
          a.mins ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m16, a.mins + (o + j) * nb + c)) : _mm512_setzero_ps();
      const __m512 corr = _mm512_fnmadd_ps(_mm512_set1_ps(zero), d, mv);
      #pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        sdx[j][r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(m16, x.d.data() + r * x.nbp + c));
        cacc[j][r] = _mm512_fmadd_ps(corr, _mm512_maskz_loadu_ps(m16, x.xs.data() + r * x.nbp + c), cacc[j][r]);
      }
    }
    __m512i idx = pat;
#pragma GCC unroll 8
    for (int64_t b = c; b < c + left; b += 2) {
      const bool half = b + 1 >= nb;  // an odd block count: the last pair has one block
      __m512i xv[NR];
      #pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) xv[r] = _mm512_loadu_si512(x.q.data() + r * x.kp + b * kBlock);
      #pragma GCC unroll 4
      for (int j = 0; j < NO; ++j) {
        const __m512i w = load_pair<BITS>(a.q + (o + j) * row_bytes, b, half);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
          const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[r]));
          acc[j][r] = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(idx, sdx[j][r]), acc[j][r]);
        }
      }
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
    }
  }
  #pragma GCC unroll 4
  for (int j = 0; j < NO; ++j) {
    #pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) a.out[r * a.n + o + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][r], cacc[j][r]));
  }
}

// Software prefetch of the rows [o, o1) the next passes read (the hardware prefetcher
// alone leaves the stream latency-bound).
inline void prefetch_rows(const QuantMatmulArgs& a, int64_t o, int64_t o1) {
  const int64_t row_bytes = a.bits == 4 ? a.k / 2 : a.k, ng = a.k / a.group;
  if (o >= o1) return;
  const char* q = reinterpret_cast<const char*>(a.q + o * row_bytes);
  for (int64_t at = 0; at < (o1 - o) * row_bytes; at += 64) __builtin_prefetch(q + at);
  const char* s = reinterpret_cast<const char*>(a.scales + o * ng);
  for (int64_t at = 0; at < (o1 - o) * ng * 2; at += 64) __builtin_prefetch(s + at);
  if (a.mins) {
    const char* m = reinterpret_cast<const char*>(a.mins + o * ng);
    for (int64_t at = 0; at < (o1 - o) * ng * 2; at += 64) __builtin_prefetch(m + at);
  }
}

template <int BITS, int NR>
KVCACHED_VNNI void direct_vnni(const QuantMatmulArgs& a, const QuantizedRows& x, int64_t o0, int64_t o1) {
  constexpr int kNO = NR == 1 ? 4 : 2;  // outputs per pass: chains enough to hide latency
  constexpr int kAhead = 4 * kNO;       // rows prefetched ahead
  prefetch_rows(a, o0, std::min(o1, o0 + kAhead));
  int64_t o = o0;
  for (; o + kNO <= o1; o += kNO) {
    prefetch_rows(a, o + kAhead, std::min(o1, o + kAhead + kNO));
    direct_rows<BITS, NR, kNO>(a, x, o);
  }
  for (; o < o1; ++o) direct_rows<BITS, NR, 1>(a, x, o);
}

using DirectKernel = void (*)(const QuantMatmulArgs&, const QuantizedRows&, int64_t, int64_t);

template <int BITS>
DirectKernel direct_bits(int64_t rows) {
  switch (rows) {
    case 1:
      return direct_vnni<BITS, 1>;
    case 2:
      return direct_vnni<BITS, 2>;
    case 3:
      return direct_vnni<BITS, 3>;
    default:
      return direct_vnni<BITS, 4>;
  }
}

DirectKernel direct_for(int bits, int64_t rows) { return bits == 4 ? direct_bits<4>(rows) : direct_bits<8>(rows); }

bool cpu_has(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kAuto:
    case QuantIsa::kPortable:
      return true;
    case QuantIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case QuantIsa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  return false;
}

QuantIsa best_isa() {
  if (cpu_has(QuantIsa::kAvx512Vnni)) return QuantIsa::kAvx512Vnni;
  if (cpu_has(QuantIsa::kAvx2)) return QuantIsa::kAvx2;
  return QuantIsa::kPortable;
}

std::atomic<QuantIsa> g_isa{QuantIsa::kAuto};

QuantIsa current_isa() {
  const QuantIsa isa = g_isa.load();
  return isa == QuantIsa::kAuto ? best_isa() : isa;
}

TileKernel kernel_for(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kAvx512Vnni:
      return tile_vnni;
    case QuantIsa::kAvx2:
      return tile_avx2;
    default:
      return tile_portable;
  }
}

const char* isa_name(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kAvx512Vnni:
      return "avx512_vnni";
    case QuantIsa::kAvx2:
      return "avx2";
    case QuantIsa::kPortable:
      return "portable";
    case QuantIsa::kAuto:
      return "auto";
  }
  return "?";
}

void prepare_row_portable(const QuantMatmulArgs& a, int64_t o, int zero, uint8_t* u, float* scale, float* corr) {
  const int64_t k = a.k, ng = k / a.group, per_group = a.group / kBlock;
  unpack_row(a.q + o * (a.bits == 8 ? k : k / 2), a.bits, k, u);
  for (int64_t g = 0; g < ng; ++g) {
    const float d = half_to_float(a.scales[o * ng + g]);
    const float m = a.mins ? half_to_float(a.mins[o * ng + g]) : 0.f;
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      scale[b] = d;
      corr[b] = m - static_cast<float>(zero) * d;
    }
  }
}

// The same with AVX2 and F16C: 32 values unpacked per step, 8 scales converted per step.
__attribute__((target("avx2,fma,f16c"))) void prepare_row_avx2(const QuantMatmulArgs& a, int64_t o, int zero,
                                                                uint8_t* u, float* scale, float* corr) {
  const int64_t k = a.k, ng = k / a.group;
  if (a.group != kBlock) {
    prepare_row_portable(a, o, zero, u, scale, corr);
    return;
  }
  if (a.bits == 8) {
    const uint8_t* q = a.q + o * k;
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t j = 0; j < k; j += 32) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + j), _mm256_xor_si256(v, flip));
    }
  } else {
    const uint8_t* q = a.q + o * (k / 2);
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < k; b += kBlock) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b / 2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + b), _mm_and_si128(v, low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u + b + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
    }
  }
  const uint16_t* s = a.scales + o * ng;
  const uint16_t* m = a.mins ? a.mins + o * ng : nullptr;
  const __m256 z = _mm256_set1_ps(static_cast<float>(zero));
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g)));
    const __m256 mv = m ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g)))
                        : _mm256_setzero_ps();
    _mm256_storeu_ps(scale + g, d);
    _mm256_storeu_ps(corr + g, _mm256_fnmadd_ps(z, d, mv));
  }
  for (; g < ng; ++g) {
    const float d = half_to_float(s[g]);
    scale[g] = d;
    corr[g] = (m ? half_to_float(m[g]) : 0.f) - static_cast<float>(zero) * d;
  }
}

using PrepareRow = void (*)(const QuantMatmulArgs&, int64_t, int, uint8_t*, float*, float*);

// One task: output rows [o0, o1) against every activation row.
void run_outputs(const QuantMatmulArgs& a, const QuantizedRows& xr, TileKernel kernel, PrepareRow prepare,
                 int64_t o0, int64_t o1) {
  const int zero = zero_point(a.bits, a.mins != nullptr);
  thread_local Tile t;
  t.kp = xr.kp;
  t.nbp = xr.nbp;
  t.u.assign(static_cast<size_t>(kTileN * t.kp), 0);  // padding stays zero
  t.scale.assign(static_cast<size_t>(kTileN * t.nbp), 0.f);
  t.corr.assign(static_cast<size_t>(kTileN * t.nbp), 0.f);
  const bool wide = !xr.d16.empty();
  if (wide) t.scale16.assign(static_cast<size_t>(kTileN * t.nbp * 8), 0.f);
  for (int64_t t0 = o0; t0 < o1; t0 += kTileN) {
    const int64_t live = std::min(kTileN, o1 - t0);  // rows past the end stay zero
    for (int64_t i = 0; i < live; ++i) {
      prepare(a, t0 + i, zero, t.u.data() + i * t.kp, t.scale.data() + i * t.nbp, t.corr.data() + i * t.nbp);
      if (wide) expand16(t.scale.data() + i * t.nbp, t.nbp, t.scale16.data() + i * t.nbp * 8);
    }
    for (int64_t r0 = 0; r0 < a.rows; r0 += kTileR) {
      const int64_t nr = std::min(kTileR, a.rows - r0);
      float out[kTileN][kTileR];
      kernel(t, xr, r0, nr, out);
      for (int64_t i = 0; i < live; ++i) {
        for (int64_t r = 0; r < nr; ++r) a.out[(r0 + r) * a.n + t0 + i] = out[i][r];
      }
    }
  }
}

}  // namespace

std::string check_quant_matmul(const QuantMatmulArgs& a) {
  if (a.bits != 4 && a.bits != 8) return "bits must be 4 or 8, got " + std::to_string(a.bits);
  if (a.k <= 0 || a.k % kBlock) return "the input size " + std::to_string(a.k) + " is not a positive multiple of 32";
  if (a.group <= 0 || a.group % kBlock || a.k % a.group) {
    return "the group size " + std::to_string(a.group) + " must be a multiple of 32 that divides the input size " +
           std::to_string(a.k);
  }
  if (a.n <= 0 || a.rows < 0) return "empty weight or negative row count";
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 4;
  if (a.n > kMax / a.k || (a.rows > 0 && a.rows > kMax / std::max(a.k, a.n))) return "sizes overflow";
  return {};
}

void quant_matmul(const std::vector<QuantMatmulArgs>& parts, int64_t workers, const Spawn& spawn) {
  if (parts.empty() || parts[0].rows == 0) return;
  const QuantMatmulArgs& a = parts[0];  // x, rows, k, bits, group: the same for every part
  QuantizedRows xr;
  xr.kp = (a.k + kPair - 1) / kPair * kPair;
  xr.nbp = xr.kp / kBlock;
  xr.q.assign(static_cast<size_t>(a.rows * xr.kp), 0);
  xr.d.assign(static_cast<size_t>(a.rows * xr.nbp), 0.f);
  xr.xs.assign(static_cast<size_t>(a.rows * xr.nbp), 0.f);
  int64_t outputs = 0;
  for (const auto& p : parts) outputs += p.n;
  // Small products run on the caller alone: a helper's start costs more than it saves.
  const double work = static_cast<double>(a.rows) * static_cast<double>(outputs) * static_cast<double>(a.k);
  if (work < (1 << 17)) workers = 1;
  const int64_t row_tasks = std::min<int64_t>(a.rows, workers * 4);
  parallel_for(row_tasks, a.rows >= 64 ? workers : 1, spawn, [&](int64_t t) {
    quantize_rows(a.x, a.rows * t / row_tasks, a.rows * (t + 1) / row_tasks, a.k, xr);
  });
  const QuantIsa isa = current_isa();
  const bool direct = isa == QuantIsa::kAvx512Vnni && a.rows <= kDirectRows && a.group == kBlock;
  if (direct && a.bits == 4) permute_int4_pairs(xr, a.rows);
  if (!direct && isa == QuantIsa::kAvx512Vnni && a.rows > 1) {
    xr.d16.assign(static_cast<size_t>(a.rows * xr.nbp * 8), 0.f);
    for (int64_t r = 0; r < a.rows; ++r) expand16(xr.d.data() + r * xr.nbp, xr.nbp, xr.d16.data() + r * xr.nbp * 8);
  }
  // Tasks: chunks of whole tiles of one part's outputs, a few per worker so an uneven pool
  // still balances.
  struct Chunk {
    const QuantMatmulArgs* part;
    int64_t o0, o1;
  };
  std::vector<Chunk> chunks;
  const int64_t want = std::max<int64_t>(1, workers * 4);
  const int64_t size = std::max<int64_t>(kTileN, (outputs + want - 1) / want / kTileN * kTileN);
  for (const auto& p : parts) {
    for (int64_t o = 0; o < p.n; o += size) chunks.push_back({&p, o, std::min(p.n, o + size)});
  }
  const DirectKernel dk = direct ? direct_for(a.bits, a.rows) : nullptr;
  const TileKernel kernel = kernel_for(isa);
  const PrepareRow prepare = isa == QuantIsa::kPortable ? prepare_row_portable : prepare_row_avx2;
  parallel_for(static_cast<int64_t>(chunks.size()), workers, spawn, [&](int64_t t) {
    const Chunk& c = chunks[static_cast<size_t>(t)];
    if (dk) {
      dk(*c.part, xr, c.o0, c.o1);
    } else {
      run_outputs(*c.part, xr, kernel, prepare, c.o0, c.o1);
    }
  });
}

std::string quant_isa() { return isa_name(current_isa()); }

void set_quant_isa(const std::string& name) {
  QuantIsa isa;
  if (name == "auto") {
    isa = QuantIsa::kAuto;
  } else if (name == "portable") {
    isa = QuantIsa::kPortable;
  } else if (name == "avx2") {
    isa = QuantIsa::kAvx2;
  } else if (name == "avx512_vnni") {
    isa = QuantIsa::kAvx512Vnni;
  } else {
    throw Error("unknown instruction set '" + name + "' (auto, portable, avx2, avx512_vnni)");
  }
  if (!cpu_has(isa)) throw Error("this CPU has no " + name);
  g_isa.store(isa);
}

}  // namespace kvcached
