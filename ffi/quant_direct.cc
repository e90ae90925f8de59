// The VNNI kernel of few activation rows (decode), see quant_kernels.h.
#include "quant_kernels.h"

namespace kvcached {
namespace quant {
namespace {

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

// NO output rows at a time (independent chains), NR activation rows from row r0.
template <int BITS, int NR, int NO>
KVCACHED_VNNI void direct_rows(const QuantMatmulArgs& a, const QuantizedRows& x, int64_t o, int64_t r0) {
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
        const int64_t at = (r0 + r) * x.nbp + c;
        sdx[j][r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(m16, x.d.data() + at));
        cacc[j][r] = _mm512_fmadd_ps(corr, _mm512_maskz_loadu_ps(m16, x.xs.data() + at), cacc[j][r]);
      }
    }
    __m512i idx = pat;
#pragma GCC unroll 8
    for (int64_t b = c; b < c + left; b += 2) {
      const bool half = b + 1 >= nb;  // an odd block count: the last pair has one block
      __m512i xv[NR], xv2[NR];
      #pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        xv[r] = _mm512_loadu_si512(x.q.data() + (r0 + r) * x.kp + b * kBlock);
        xv2[r] = _mm512_loadu_si512(x.q2.data() + (r0 + r) * x.kp + b * kBlock);
      }
      #pragma GCC unroll 4
      for (int j = 0; j < NO; ++j) {
        const __m512i w = load_pair<BITS>(a.q + (o + j) * row_bytes, b, half);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {  // 256 (w . hi) + w . lo
          const __m512i hi = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[r]), 8);
          const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(hi, w, xv2[r]));
          acc[j][r] = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(idx, sdx[j][r]), acc[j][r]);
        }
      }
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
    }
  }
  #pragma GCC unroll 4
  for (int j = 0; j < NO; ++j) {
    #pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      a.out[(r0 + r) * a.n + o + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][r], cacc[j][r]));
    }
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

// The rows in groups of up to 4 (registers: NO x NR accumulators): NO outputs' weights are
// read from memory once and from L1 for the next groups.
template <int BITS, int NO>
KVCACHED_VNNI void direct_group(const QuantMatmulArgs& a, const QuantizedRows& x, int64_t o) {
  for (int64_t r0 = 0; r0 < a.rows; r0 += 4) {
    switch (std::min<int64_t>(4, a.rows - r0)) {
      case 1:
        direct_rows<BITS, 1, NO>(a, x, o, r0);
        break;
      case 2:
        direct_rows<BITS, 2, NO>(a, x, o, r0);
        break;
      case 3:
        direct_rows<BITS, 3, NO>(a, x, o, r0);
        break;
      default:
        direct_rows<BITS, 4, NO>(a, x, o, r0);
    }
  }
}

template <int BITS>
KVCACHED_VNNI void direct_vnni(const QuantMatmulArgs& a, const QuantizedRows& x, int64_t o0, int64_t o1) {
  const bool one = a.rows == 1;
  const int64_t step = one ? 4 : 2;  // outputs per pass: chains enough to hide latency
  const int64_t ahead = 4 * step;    // rows prefetched ahead
  prefetch_rows(a, o0, std::min(o1, o0 + ahead));
  int64_t o = o0;
  for (; o + step <= o1; o += step) {
    prefetch_rows(a, o + ahead, std::min(o1, o + ahead + step));
    if (one) {
      direct_rows<BITS, 1, 4>(a, x, o, 0);
    } else {
      direct_group<BITS, 2>(a, x, o);
    }
  }
  for (; o < o1; ++o) direct_group<BITS, 1>(a, x, o);
}

}  // namespace

// Few rows (decode): outputs read straight from the packed weights, no tile buffers.
// Scales and the zero-point / min terms are done 16 blocks at a time in float vectors;
// each pair of blocks takes its two scales from them with one permute. int4 nibbles are
// split in registers, so the activations are laid out per pair as [x0 0:16, x1 0:16,
// x0 16:32, x1 16:32] (permute_int4_pairs) to meet them: dpbusd lanes 0-3 and 8-11 are the
// first block's, 4-7 and 12-15 the second's.
KVCACHED_VNNI void permute_int4_pairs(QuantizedRows& x, int64_t rows) {
  std::vector<int8_t> tmp(static_cast<size_t>(kPair));
  for (std::vector<int8_t>* plane : {&x.q, &x.q2}) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < x.nbp; b += 2) {
        int8_t* p = plane->data() + r * x.kp + b * kBlock;
        std::copy(p, p + kPair, tmp.begin());
        std::copy(tmp.begin(), tmp.begin() + 16, p);
        std::copy(tmp.begin() + 32, tmp.begin() + 48, p + 16);
        std::copy(tmp.begin() + 16, tmp.begin() + 32, p + 32);
        std::copy(tmp.begin() + 48, tmp.begin() + 64, p + 48);
      }
    }
  }
}

DirectKernel direct_for(int bits) { return bits == 4 ? direct_vnni<4> : direct_vnni<8>; }

}  // namespace quant
}  // namespace kvcached
