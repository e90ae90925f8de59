// Error types shared by the C++ core. Handlers turn them into XLA FFI errors,
// the nanobind module into Python exceptions (KVCacheError, PoolExhausted).
#pragma once

#include <stdexcept>
#include <string>

namespace kvcached {

// Bad input or an invalid state (out-of-range ids, double map, ...).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// The physical budget (or the OS / driver) cannot provide more pages.
class PoolExhausted : public Error {
 public:
  explicit PoolExhausted(const std::string& what) : Error(what) {}
};

// A failure of the backend itself (mmap, driver call) that is not a budget issue.
class BackendError : public Error {
 public:
  explicit BackendError(const std::string& what) : Error(what) {}
};

}  // namespace kvcached
