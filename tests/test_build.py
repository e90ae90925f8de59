"""The extension is built as the project promises: CUDA compiled wherever nvcc is."""

import shutil

import jax
import pytest

from jax_kvcached.memory import _C


def test_cuda_part_is_compiled_when_a_toolkit_is_present():
    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine: the host-only build is expected")
    assert _C.cuda_compiled()
    assert set(_C.handlers) == {"cpu", "cuda"}
    assert set(_C.handlers["cuda"]) == {
        "write_kv",
        "write_kv_async",
        "copy_blocks",
        "map_pages",
        "unmap_pages",
    }


def test_cuda_backend_stays_inert_without_a_driver():
    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if has_gpu:
        pytest.skip("a GPU is present: tests/gpu exercises the CUDA backend")
    with pytest.raises(_C.BackendError, match="CUDA|driver|toolkit"):
        _C.PagePool("cuda", 0, 16, 0, 0, 0)


def test_handlers_declare_command_buffer_compatibility_as_the_policy_says():
    """XLA reads each handler's traits through the FFI metadata query; only the CUDA
    handlers in ``ops.COMMAND_BUFFER_OPS`` (no host work per call) may be captured into
    a CUDA graph. Every handler reports the same FFI version (one set of headers)."""
    from jax_kvcached.memory import ops

    cpu = ops.handler_traits("cpu")
    versions = {m["api_version"] for m in cpu.values()}
    assert len(versions) == 1 and next(iter(versions)) >= (0, 1)  # one set of headers
    assert not any(m["command_buffer_compatible"] for m in cpu.values())
    if not _C.cuda_compiled():
        with pytest.raises(ValueError, match="no 'cuda' handlers"):
            ops.handler_traits("cuda")
        pytest.skip("host-only build: no CUDA handlers to check")
    cuda = ops.handler_traits("cuda")
    capturable = {op for op, m in cuda.items() if m["command_buffer_compatible"]}
    assert capturable == ops.COMMAND_BUFFER_OPS
    assert {m["api_version"] for m in cuda.values()} == versions
    assert {"map_pages", "unmap_pages"}.isdisjoint(ops.COMMAND_BUFFER_OPS)
