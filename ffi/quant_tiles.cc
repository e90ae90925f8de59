// The tiled kernels of the quantized matmul (see quant_kernels.h): a tile of kTileN
// output rows is unpacked once (unsigned bytes, a float scale and correction per block)
// and every activation row is run against it, kTileR rows a call.
#include <cmath>

#include "half.h"
#include "quant_kernels.h"

namespace kvcached {
namespace quant {
namespace {

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

void tile_portable(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr, float (*out)[kTileR]) {
  for (int64_t i = 0; i < kTileN; ++i) {
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      float acc = 0.f;
      for (int64_t b = 0; b < t.nbp; ++b) {
        int32_t dot = 0;
        const uint8_t* w = t.u.data() + i * t.kp + b * kBlock;
        const int8_t* q = x.q.data() + row * x.kp + b * kBlock;
        const int8_t* q2 = x.q2.data() + row * x.kp + b * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<int32_t>(w[j]) * (kLo * q[j] + q2[j]);
        acc += t.scale[i * t.nbp + b] * x.d[row * x.nbp + b] * static_cast<float>(dot) +
               t.corr[i * t.nbp + b] * x.xs[row * x.nbp + b];
      }
      out[i][r] = acc;
    }
  }
}

// AVX2: bytes widened to 16 bits (u up to 255 would saturate maddubs' 16-bit sums).
__attribute__((target("avx2,fma"))) void tile_avx2(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr,
                                                   float (*out)[kTileR]) {
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t row = r0 + r;
    const int8_t* xq = x.q.data() + row * x.kp;
    const int8_t* xq2 = x.q2.data() + row * x.kp;
    const float* dx = x.d.data() + row * x.nbp;
    const __m256i c = _mm256_set1_epi16(kLo);
    __m256 acc[kTileN];
    for (int64_t i = 0; i < kTileN; ++i) acc[i] = fdot256(t.corr.data() + i * t.nbp, x.xs.data() + row * x.nbp, t.nbp);
    for (int64_t b = 0; b < t.nbp; ++b) {  // 16-bit activations: 256 hi + lo
      const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      const __m256i lv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq2 + b * kBlock));
      const __m256i xlo = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(hv)), c),
                                           _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lv)));
      const __m256i xhi = _mm256_add_epi16(
          _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(hv, 1)), c),
          _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lv, 1)));
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
  const int8_t* xq2 = x.q2.data() + r0 * x.kp;
  for (int64_t b = 0; b < t.nbp; b += 2) {
    __m512i xv[NR], xv2[NR];
    __m512 dx[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      xv[r] = _mm512_loadu_si512(xq + r * x.kp + b * kBlock);
      xv2[r] = _mm512_loadu_si512(xq2 + r * x.kp + b * kBlock);
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
        const __m512i hi = _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, w, xv[r]), 8);
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(hi, w, xv2[r]));
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

}  // namespace

// v (n values, n even) as 16 floats per pair: v[2p] x8 then v[2p + 1] x8.
__attribute__((target("avx2"))) void expand16(const float* v, int64_t n, float* out) {
  for (int64_t p = 0; p < n / 2; ++p) {
    _mm256_storeu_ps(out + 16 * p, _mm256_set1_ps(v[2 * p]));
    _mm256_storeu_ps(out + 16 * p + 8, _mm256_set1_ps(v[2 * p + 1]));
  }
}

TileKernel tile_kernel_for(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kAvx512Vnni:
      return tile_vnni;
    case QuantIsa::kAvx2:
      return tile_avx2;
    default:
      return tile_portable;
  }
}

PrepareRow prepare_for(QuantIsa isa) { return isa == QuantIsa::kPortable ? prepare_row_portable : prepare_row_avx2; }

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
    // Rows past the end keep the previous tile's weights: computed, never written out.
    const int64_t live = std::min(kTileN, o1 - t0);
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

}  // namespace quant
}  // namespace kvcached
