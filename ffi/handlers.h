// The FFI handler symbols, registered with jax.ffi from Python (see jax_kvcached/ops.py).
#pragma once

#include "xla/ffi/api/c_api.h"

namespace kvcached {

extern "C" {
XLA_FFI_Error* kvcached_write_kv_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_write_kv_async_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_copy_blocks_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_map_pages_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_unmap_pages_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_paged_attention_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_quant_matmul_cpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_grouped_matmul_cpu(XLA_FFI_CallFrame* call_frame);
#ifdef KVCACHED_WITH_CUDA
XLA_FFI_Error* kvcached_write_kv_cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_write_kv_async_cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_copy_blocks_cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_map_pages_cuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kvcached_unmap_pages_cuda(XLA_FFI_CallFrame* call_frame);
#endif
}

}  // namespace kvcached
