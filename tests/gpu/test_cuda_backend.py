"""The CUDA backend and handlers on a real GPU. Skipped only when no GPU is present."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FFI_ERRORS, gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached.memory import _C, ops

pytestmark = needs_gpu("CUDA backend tests")


@pytest.fixture
def gpool():
    p = kv.Pool("1GiB", backend="cuda", min_reserved_pages=0, max_reserved_pages=0)
    yield p
    p.close()


def _on_gpu(x):
    return jax.device_put(x, gpus()[0])


def test_cuda_backend_is_built():
    assert _C.cuda_compiled(), "a GPU is present but jax_kvcached was built without CUDA"
    assert "cuda" in _C.handlers


def test_auto_backend_picks_cuda():
    p = kv.Pool("64MiB", min_reserved_pages=0, max_reserved_pages=0)
    assert p.backend == "cuda" and p.device.platform == "gpu"
    p.close()


def test_view_is_zero_copy_on_the_device(gpool):
    c = gpool.create_kv_cache("a", 2, 8, 128, "bfloat16")
    v = c.view
    assert v.unsafe_buffer_pointer() == c.base_address
    assert next(iter(v.devices())).platform == "gpu"
    # Unmapped: the shared zero page everywhere.
    assert float(jnp.abs(v[:, :, :256].astype(jnp.float32)).sum()) == 0.0


def test_write_then_read_in_one_step_and_across_steps(gpool):
    c = gpool.create_kv_cache("a", 3, 8, 128, "bfloat16")
    ids = c.alloc(4)
    slots = _on_gpu(jnp.asarray(c.slot_mapping(ids, np.arange(50))))
    rng = np.random.default_rng(0)
    k = _on_gpu(jnp.asarray(rng.standard_normal((50, 8, 128)), jnp.bfloat16))
    v = _on_gpu(jnp.asarray(rng.standard_normal((50, 8, 128)), jnp.bfloat16))

    @jax.jit
    def step(view, k, v, slots, token):
        token = ops.write_kv(c, 1, k, v, slots, token)
        s = ops.after(slots, token)
        return view[1, 0, s // 16, s % 16], view[1, 1, s // 16, s % 16], token

    rk, rv, token = step(c.view, k, v, slots, _on_gpu(ops.new_token()))
    np.testing.assert_array_equal(np.asarray(rk), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(rv), np.asarray(v))
    # All layers at once, then read in a later step.
    k3 = jnp.stack([k, 2 * k, 3 * k])
    token = ops.write_kv(c, 0, k3, k3, slots, token)
    token.block_until_ready()
    got = np.asarray(c.view[:, 0][:, np.asarray(ids)].astype(jnp.float32))
    want = np.asarray(k3.astype(jnp.float32))
    flat = got.reshape(3, -1, 8, 128)[:, :50]
    np.testing.assert_array_equal(flat, want)


def test_bad_slots_are_errors_and_write_nothing(gpool):
    c = gpool.create_kv_cache("a", 1, 8, 128, "bfloat16")
    c.alloc(1)
    k = _on_gpu(jnp.ones((1, 8, 128), jnp.bfloat16))
    for slots, match in (
        ([5], "null block"),
        ([10**9], "out of range"),
        ([c.blocks_per_page * 16 * 3], "unmapped"),
    ):
        with pytest.raises(FFI_ERRORS, match=match):
            ops.write_kv(
                c, 0, k, k, _on_gpu(jnp.asarray(slots, jnp.int32)), ops.new_token()
            ).block_until_ready()
    assert float(jnp.abs(c.view.astype(jnp.float32)).sum()) == 0.0


def test_device_memory_follows_mapping(gpool):
    c = gpool.create_kv_cache("a", 4, 8, 128, "bfloat16")  # 8 pages per KV page
    dev = gpool.device.id
    free0, _ = _C.cuda_mem_info(dev)
    ids = c.alloc(16 * c.blocks_per_page)  # 17 KV pages = 136 pages (page 0 holds block 0)
    free1, _ = _C.cuda_mem_info(dev)
    mapped = gpool.stats()["mapped_bytes"]
    assert mapped == c.num_mapped_pages * 8 * gpool.page_size
    assert free0 - free1 >= 0.9 * mapped
    c.free(ids)
    free2, _ = _C.cuda_mem_info(dev)
    assert free2 - free1 >= 0.9 * mapped  # given back (max_reserved_pages=0)


def test_pages_move_between_tenants_without_new_creates():
    p = kv.Pool("256MiB", backend="cuda", min_reserved_pages=0, max_reserved_pages=64)
    a = p.create_kv_cache("a", 2, 8, 128, "bfloat16")
    b = p.create_kv_cache("b", 2, 8, 128, "float32")
    ids = a.alloc(a.num_free_blocks)
    assert b.num_free_blocks == 0
    a.free(ids)
    creates = p.stats()["creates"]
    ids_b = b.alloc(b.num_free_blocks)
    assert p.stats()["creates"] == creates
    b.free(ids_b)
    assert p.stats()["mapped_pages"] == 0
    p.close()


def test_copy_blocks_and_map_unmap_in_jit(gpool):
    c = gpool.create_kv_cache("a", 2, 8, 128, "float32")
    ids = c.alloc(4)
    slots = _on_gpu(jnp.asarray(c.slot_mapping(ids[:2], np.arange(32))))
    k = _on_gpu(jnp.asarray(np.random.default_rng(1).standard_normal((2, 32, 8, 128)), jnp.float32))
    t = ops.write_kv(c, 0, k, -k, slots, _on_gpu(ops.new_token()))
    t = ops.copy_blocks(c, _on_gpu(jnp.asarray(ids[:2])), _on_gpu(jnp.asarray(ids[2:])), t)
    t.block_until_ready()
    view = np.asarray(c.view[:, :, np.asarray(ids)])
    np.testing.assert_array_equal(view[:, :, 2:], view[:, :, :2])
    page = c.num_pages - 1
    block = page * c.blocks_per_page

    @jax.jit
    def step(view, token):
        token = ops.map_pages(c, jnp.array([page], jnp.int32), token)
        s = jnp.arange(block * 16, block * 16 + 16, dtype=jnp.int32)
        token = ops.write_kv(c, 0, jnp.ones((16, 8, 128)), jnp.ones((16, 8, 128)), s, token)
        total = view[0, 0, ops.after(jnp.array([block]), token)].sum()
        return total, ops.unmap_pages(c, jnp.array([page], jnp.int32), token, total)

    total, token = step(c.view, _on_gpu(ops.new_token()))
    token.block_until_ready()
    assert float(total) == 16 * 8 * 128
    assert not c.is_page_mapped(page)


def test_free_after_waits_for_in_flight_kernels(gpool):
    c = gpool.create_kv_cache("a", 1, 8, 128, "float32")
    ids = c.alloc(8)
    slots = _on_gpu(jnp.asarray(c.slot_mapping(ids, np.arange(128))))
    ops.write_kv(
        c, 0, jnp.ones((128, 8, 128)), jnp.ones((128, 8, 128)), slots, ops.new_token()
    ).block_until_ready()

    @jax.jit
    def slow_read(view, ids, x):
        for _ in range(40):
            x = jnp.tanh(x @ x)
        return view[0, 0, ids + (x.sum() * 0).astype(jnp.int32)].sum()

    x = _on_gpu(jnp.full((4096, 4096), 1e-4, jnp.float32))
    ids_j = _on_gpu(jnp.asarray(ids))
    slow_read(c.view, ids_j, x).block_until_ready()
    t0 = time.perf_counter()
    out = slow_read(c.view, ids_j, x)
    c.free(ids, after=out)
    assert float(out) == 128 * 8 * 128, time.perf_counter() - t0


def test_write_kv_async_checks_slots_on_the_device(gpool):
    """No host round trip: good rows land, a bad slot's row is skipped and recorded,
    raised once at the next host sync; the shared zero page stays zero."""
    c = gpool.create_kv_cache("a", 2, 8, 128, "bfloat16")
    ids = c.alloc(2)
    good = np.asarray(c.slot_mapping(ids, np.arange(3)))
    unmapped = c.blocks_per_page * 16 * 7  # page 7 is not mapped: the zero page
    slots = _on_gpu(jnp.asarray(np.r_[good, unmapped, -1], jnp.int32))
    k = _on_gpu(jnp.ones((5, 8, 128), jnp.bfloat16))
    ops.write_kv_async(c, 1, k, 2 * k, slots, _on_gpu(ops.new_token())).block_until_ready()
    blocks, offs = good // 16, good % 16
    assert float(c.view[1, 0, blocks, offs].astype(jnp.float32).sum()) == 3 * 8 * 128
    with pytest.raises(RuntimeError, match=f"slot {unmapped} is in an unmapped page"):
        ops.raise_device_errors(c)
    ops.raise_device_errors(c)  # cleared: raised once
    assert float(jnp.abs(c.view[:, :, 7 * c.blocks_per_page].astype(jnp.float32)).sum()) == 0.0
    # The layer as a traced operand (a scanned model): read and checked by the kernel.
    write = jax.jit(lambda i, k, v, s, t: ops.write_kv_async(c, i, k, v, s, t))
    good_j = _on_gpu(jnp.asarray(good, jnp.int32))
    done = write(_on_gpu(jnp.int32(0)), 3 * k[:3], k[:3], good_j, _on_gpu(ops.new_token()))
    done.block_until_ready()
    assert float(c.view[0, 0, blocks, offs].astype(jnp.float32).sum()) == 3 * 3 * 8 * 128
    ops.raise_device_errors(c)  # nothing recorded
    write(_on_gpu(jnp.int32(2)), k[:3], k[:3], good_j, _on_gpu(ops.new_token())).block_until_ready()
    with pytest.raises(RuntimeError, match="layer 2 is out of the cache's layers"):
        ops.raise_device_errors(c)
    assert float(c.view[1, 0, blocks, offs].astype(jnp.float32).sum()) == 3 * 8 * 128  # untouched
    c.free(ids)


def test_host_tier_copies_are_asynchronous_byte_identical_and_outlive_no_page(gpool):
    from jax_kvcached.memory.host_store import HostStore

    c = gpool.create_kv_cache("tier", 2, 8, 128, "float32")
    store = HostStore(c, 16)
    assert store.pinned  # page-locked host memory: DMA copies
    ids = c.alloc(4)
    slots = _on_gpu(jnp.asarray(c.slot_mapping(ids, np.arange(64))))
    k = _on_gpu(jnp.asarray(np.random.default_rng(2).standard_normal((2, 64, 8, 128)), jnp.float32))
    ops.write_kv(c, 0, k, -k, slots, _on_gpu(ops.new_token())).block_until_ready()
    before = np.asarray(c.view[:, :, np.asarray(ids)])
    ticket = store.copy_out(ids.tolist(), store.alloc(4))
    c.free(ids)  # the unmap waits for the enqueued copies
    deadline = time.monotonic() + 10
    while not store.done(ticket):
        assert time.monotonic() < deadline
    new = c.alloc(4)
    store.copy_in([0, 1, 2, 3], new.tolist())
    np.testing.assert_array_equal(np.asarray(c.view[:, :, np.asarray(new)]), before)
    for i in range(4):
        assert store.read_slot(i) == np.ascontiguousarray(before[:, :, i]).tobytes()
    store.close()


GROUP_MEMBER = r"""
import sys, time
import jax.numpy as jnp
import jax_kvcached as kv
pool = kv.Pool(None, backend="cuda", group=sys.argv[1], max_reserved_pages=0)
cache = pool.create_kv_cache("child", 2, 8, 128, jnp.bfloat16)
ids = cache.alloc(cache.num_free_blocks)  # everything the group leaves it
print("mapped", cache.mapped_pages, pool.stats()["mapped_pages"], flush=True)
sys.stdin.readline()
cache.free(ids)
pool.close()
"""


def test_a_process_group_on_cuda_accounts_each_process_own_pages():
    """Two processes on one GPU: each maps its own cuMemCreate pages, the shared ledger
    keeps their sum within the group's budget; a process's exit returns its pages."""
    import os
    import subprocess
    import sys
    import uuid

    from jax_kvcached.memory import shm_segment

    group = f"gpu-{uuid.uuid4().hex[:8]}"
    pool = kv.Pool("256MiB", backend="cuda", group=group, max_reserved_pages=0)
    try:
        cache = pool.create_kv_cache("parent", 2, 8, 128, jnp.bfloat16)
        ids = cache.alloc(cache.num_free_blocks // 2)
        env = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        child = subprocess.Popen(
            [sys.executable, "-c", GROUP_MEMBER, group], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        line = child.stdout.readline().split()
        assert line[0] == "mapped", line
        recs = {r.name: r.mapped_pages for r in pool.group_records()}
        assert recs["child"] == int(line[1]) == int(line[2]) > 0
        assert recs["parent"] + recs["child"] <= pool.budget_pages
        assert pool.ledger.room_pages("parent") == 0  # the child took the rest
        child.communicate("\n", timeout=120)
        assert child.returncode == 0
        assert [r.name for r in pool.group_records()] == ["parent"]
        assert pool.ledger.room_pages("parent") > 0
        cache.free(ids)
    finally:
        pool.close()
        shm_segment.remove(group)
