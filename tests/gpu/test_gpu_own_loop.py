"""The pool in a user's own jitted loop on the CUDA backend (tests/test_own_loop.py's
model and checks): the cache passed as an argument reads what the step wrote, a snapshot
does not, a closure is refused. Skipped only when no GPU is present."""

import jax
import pytest
from conftest import gpus, needs_gpu
from test_own_loop import PROMPTS, SHAPES, Tenant, _jitted, _step

import jax_kvcached as kv

pytestmark = needs_gpu("GPU own-loop tests")


def test_the_cache_as_an_argument_on_cuda_equals_the_no_cache_run():
    with jax.default_device(gpus()[0]):
        pool = kv.Pool("256MiB", backend="cuda", min_reserved_pages=0, max_reserved_pages=0)
        for i, shape in enumerate(SHAPES):
            t = Tenant(pool, f"t{i}", shape, i)
            # (float32 dots may run as TF32 on the GPU: the no-cache run rounds alike but
            # in another order; a stale view is off by > 1)
            assert t.run_loop(_jitted(shape)) < 2e-2, t.errors
            t.close()
            t.cache.close()
        snap = Tenant(pool, "snap", SHAPES[1], 9)
        assert snap.run_loop(_jitted(SHAPES[1]), steps=1, decode=1, snapshot=True) > 0.1
        closure = jax.jit(lambda p, ids, slots, lay, token: _step(
            p, snap.cache, ids, slots, lay, token, shape=SHAPES[1]))  # fmt: skip
        with pytest.raises(ValueError, match="pass the cache"):
            snap.step(lambda p, c, *a: closure(p, *a), [list(x) for x in PROMPTS])
        snap.close()
        snap.cache.close()
        assert pool.stats()["mapped_pages"] == 0
        pool.close()
