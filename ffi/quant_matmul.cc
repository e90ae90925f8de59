#include "quant_matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "errors.h"
#include "quant_kernels.h"

namespace kvcached {
namespace {

using namespace quant;

// Activation rows quantized per 32-block in two int8 planes: hi = rint(x / s), s = max|x| /
// 127, and the remainder lo = rint((x - s hi) 256 / s) (clamped to 127), so x = unit (256
// hi + lo) with unit = s / 256, to about 16 bits (one int8 plane, llama.cpp's, flips
// close greedy choices: the demo's answer among them). d holds the unit, xs = unit *
// sum(256 hi + lo) (the block's sum as the integer dot sees it, for the zero-point and
// min terms). The integer dot is (w . hi) << 8 plus w . lo.
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
      int8_t* q2 = out.q2.data() + r * out.kp + b * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float t = std::min(127.f, std::max(-127.f, std::nearbyint(v[j] * id)));
        const float rest = std::nearbyint((v[j] - t * d) * id * static_cast<float>(kLo));
        q[j] = static_cast<int8_t>(t);
        q2[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, rest)));
        sum += kLo * q[j] + q2[j];
      }
      const float unit = d / static_cast<float>(kLo);
      out.d[r * out.nbp + b] = unit;
      out.xs[r * out.nbp + b] = unit * static_cast<float>(sum);
    }
  }
}

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
  xr.q2.assign(static_cast<size_t>(a.rows * xr.kp), 0);
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
  const DirectKernel dk = direct ? direct_for(a.bits) : nullptr;
  const TileKernel kernel = tile_kernel_for(isa);
  const PrepareRow prepare = prepare_for(isa);
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
  for (QuantIsa isa : {QuantIsa::kAuto, QuantIsa::kPortable, QuantIsa::kAvx2, QuantIsa::kAvx512Vnni}) {
    if (name != isa_name(isa)) continue;
    if (!cpu_has(isa)) throw Error("this CPU has no " + name);
    g_isa.store(isa);
    return;
  }
  throw Error("unknown instruction set '" + name + "' (auto, portable, avx2, avx512_vnni)");
}

}  // namespace kvcached
