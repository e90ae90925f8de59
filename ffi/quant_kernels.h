// The quantized matmul's kernels, shared by its files (not a public interface): the
// rounded activations, a tile of unpacked weights, and the kernels per instruction set.
// quant_matmul.cc rounds the activations and hands out the work; quant_tiles.cc has the
// tiled kernels (any row count; portable, AVX2, AVX-512 VNNI); quant_direct.cc the VNNI
// kernel of few rows (decode), which reads the packed weights in place.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_matmul.h"

namespace kvcached {
namespace quant {

constexpr int64_t kBlock = 32;  // activation block: one float scale per 32 int8 values
constexpr int64_t kTileN = 4;   // output rows whose weights one pass over a row reuses

// A weight row unpacked to unsigned bytes u, w = (u - zero) * scale (+ min): int8 q + 128
// (zero 128), an int4 nibble (zero 8, or 0 with mins).
inline int zero_point(int bits, bool has_min) { return bits == 8 ? 128 : (has_min ? 0 : 8); }

// Rows are padded to whole pairs of blocks (kp bytes, nbp blocks, zeros past k) so the
// 512-bit kernel reads two blocks at a time with no tail.
constexpr int64_t kPair = 2 * kBlock;
constexpr int64_t kTileR = 4;  // activation rows one kernel call takes
constexpr int64_t kDirectRows = 32;  // up to this many rows: the direct kernel (VNNI, group 32)

// Activation rows quantized per 32-block in two int8 planes (quant_matmul.cc's
// quantize_rows): x = unit (256 hi + lo) with unit = max|x| / 127 / 256.
constexpr int32_t kLo = 256;  // hi's weight in units of lo

struct QuantizedRows {
  int64_t kp = 0, nbp = 0;
  std::vector<int8_t> q, q2;  // hi and lo
  std::vector<float> d, xs;
  std::vector<float> d16;  // VNNI: per pair of blocks, d of the first x8 then of the second x8
};

// A tile's weights made ready: u (kTileN rows of kp unsigned bytes), each block's scale and
// correction coefficient (min - zero * scale), rows of nbp; zeros past k and past the end.
struct Tile {
  int64_t kp = 0, nbp = 0;
  std::vector<uint8_t> u;
  std::vector<float> scale, corr;
  std::vector<float> scale16;  // VNNI: the scales laid out like QuantizedRows::d16
};

// out[i][r] = sum over blocks b of scale[i][b] * d[r][b] * (u_i . xq_r)_b + corr[i][b] * xs[r][b]
// for the tile's kTileN outputs and activation rows r0 .. r0 + nr - 1 (nr <= kTileR).
using TileKernel = void (*)(const Tile& t, const QuantizedRows& x, int64_t r0, int64_t nr,
                            float (*out)[kTileR]);

using PrepareRow = void (*)(const QuantMatmulArgs&, int64_t, int, uint8_t*, float*, float*);

using DirectKernel = void (*)(const QuantMatmulArgs&, const QuantizedRows&, int64_t, int64_t);

// v (n values, n even) as 16 floats per pair: v[2p] x8 then v[2p + 1] x8.
void expand16(const float* v, int64_t n, float* out);
TileKernel tile_kernel_for(QuantIsa isa);
PrepareRow prepare_for(QuantIsa isa);
// One task of the tiled path: output rows [o0, o1) against every activation row.
void run_outputs(const QuantMatmulArgs& a, const QuantizedRows& xr, TileKernel kernel, PrepareRow prepare,
                 int64_t o0, int64_t o1);
// The direct kernel for rows <= kDirectRows (VNNI, group 32); int4 needs the activations'
// pairs permuted first.
DirectKernel direct_for(int bits);
void permute_int4_pairs(QuantizedRows& x, int64_t rows);

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

#define KVCACHED_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

}  // namespace quant
}  // namespace kvcached
