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
