// Matmul of float activations with packed int8 / int4 weights, llama.cpp style: each
// activation row is quantized on the fly to int8 in blocks of 32 (a float scale per
// block), and every 32-block dot product is an integer one.
//
// Packed weights (rows = outputs, N of them; K inputs each, K a multiple of 32):
//   int8: q int8 (N, K);                   w = q * scale
//   int4: q uint8 (N, K / 2), per 32-block of a row 16 bytes: byte j holds element j in
//         its low nibble and element j + 16 in its high one (GGUF's Q4_0 / Q4_1 layout);
//         symmetric: w = (u - 8) * scale; with mins: w = u * scale + min
//   scales (and mins) float16 (N, K / group), group a multiple of 32 dividing K.
// int8 may carry mins too (w = q * scale + min).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"

namespace kvcached {

struct QuantMatmulArgs {
  int64_t rows, n, k;  // x (rows, k), out (rows, n)
  int bits;            // 8 or 4
  int64_t group;       // inputs per scale
  const float* x;
  const uint8_t* q;
  const uint16_t* scales;  // float16 bits, (n, k / group)
  const uint16_t* mins;    // float16 bits, (n, k / group), or null
  float* out;
};

// The instruction sets the kernel has, best first; "auto" picks the best the CPU has.
enum class QuantIsa { kAuto, kPortable, kAvx2, kAvx512Vnni };

// Shapes the kernel accepts ("" or what is wrong).
std::string check_quant_matmul(const QuantMatmulArgs& a);

// out = x @ dequantize(q)^T for each part, as described above (rows may be 0). The parts
// share x (and rows, k, bits, group): one quantization of the activations, one pass of
// the pool over all their outputs (a layer's Q, K and V projections in one call).
void quant_matmul(const std::vector<QuantMatmulArgs>& parts, int64_t workers, const Spawn& spawn);

// The instruction set the kernel uses; set_quant_isa forces one (tests compare them) and
// throws Error when this CPU lacks it. "portable", "avx2", "avx512_vnni", "auto".
std::string quant_isa();
void set_quant_isa(const std::string& name);

}  // namespace kvcached
