import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cache

from jax_kvcached.memory import ops


def test_view_is_zero_copy_over_the_reservation(pool):
    c = make_cache(pool)
    v = c.view
    assert v.shape == c.shape == (2, 2, c.num_blocks, 16, 2, 64)
    assert v.dtype == jnp.float32
    assert v.unsafe_buffer_pointer() == c.base_address
    assert c.view is v  # created once
    assert v.nbytes == c.virtual_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unmapped_ranges_read_zeros(pool, dtype):
    c = make_cache(pool, dtype=dtype)
    v = c.view
    # No page is mapped: any block, including the null block, reads zeros.
    assert float(jnp.abs(v[:, :, :64].astype(jnp.float32)).sum()) == 0.0
    assert float(jnp.abs(v[:, :, -3:].astype(jnp.float32)).sum()) == 0.0
    assert v.dtype == jnp.dtype(dtype)


def _step(cache):
    def step(view, key, value, slots, table, token):
        token = ops.write_kv(cache, 0, key, value, slots, token, view=view)
        table = ops.after(table, token)
        return view[0, 0, table].sum() + view[0, 1, table].sum(), token

    return jax.jit(step)


def test_compiled_step_never_copies_the_view(pool):
    c = make_cache(pool)
    ids = c.alloc(2)
    slots = jnp.asarray(c.slot_mapping(ids, np.arange(4)))
    kv_in = jnp.ones((4, 2, 64), jnp.float32)
    hlo = (
        _step(c)
        .lower(c.view, kv_in, kv_in, slots, jnp.asarray(ids), ops.new_token())
        .compile()
        .as_text()
    )
    shape = "f32[" + ",".join(str(d) for d in c.shape) + "]"
    # The only instruction of the view's full shape is the parameter itself.
    lines = [ln for ln in hlo.splitlines() if shape in ln.split("=", 1)[-1].split("(")[0]]
    assert lines and all("parameter(" in ln for ln in lines), lines
    assert not re.search(r"\bcopy\(", hlo)


def test_view_is_not_donated_or_copied_per_step(pool):
    c = make_cache(pool)
    ids = c.alloc(2)
    step = _step(c)
    token = ops.new_token()
    total = 0.0
    for i in range(5):
        slots = jnp.asarray(c.slot_mapping(ids, np.array([i])))
        kv_in = jnp.full((1, 2, 64), float(i + 1), jnp.float32)
        out, token = step(c.view, kv_in, kv_in, slots, jnp.asarray(ids), token)
        total += 2 * 128 * (i + 1)
        assert float(out) == total  # every earlier write is still visible
    assert c.view.unsafe_buffer_pointer() == c.base_address
