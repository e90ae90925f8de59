// Built instead of cuda_backend.cc when no CUDA toolkit was found at build time.
#include "backend.h"
#include "errors.h"

namespace kvcached {

std::shared_ptr<PhysicalBackend> make_cuda_backend(size_t, int) {
  throw BackendError(
      "jax_kvcached was built without a CUDA toolkit; reinstall it on a machine with nvcc "
      "to use backend='cuda'");
}

bool cuda_compiled() { return false; }

std::pair<size_t, size_t> cuda_mem_info(int) {
  throw BackendError("jax_kvcached was built without a CUDA toolkit");
}

}  // namespace kvcached
