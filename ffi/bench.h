// Timing of the raw backend primitives, measured in C++ (no Python in the loop).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"

namespace kvcached {

// Creates, maps, unmaps and releases `iters` pages one by one on `backend`, touching
// nothing; returns the per-call latencies in nanoseconds keyed by primitive name
// ("create", "map", "unmap", "release", "reserve").
std::map<std::string, std::vector<double>> bench_backend(PhysicalBackend& backend, size_t iters);

}  // namespace kvcached
