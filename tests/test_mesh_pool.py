"""Pools over a mesh on four CPU devices (conftest forces them): one sharded zero-copy
view, lockstep (all-or-nothing) mapping, exact per-device accounting, the FFI ops under
shard_map finding each device's buffer, and clear errors for bad meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FFI_ERRORS, tp_pool
from jax.sharding import Mesh, PartitionSpec

import jax_kvcached as kv
from jax_kvcached import ops
from jax_kvcached.memory import _C
from jax_kvcached.memory.shards import ShardedBuffer

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices (conftest)")

P = PartitionSpec
HEADS = P(None, None, "tp", None)


# -- the pool and the cache -------------------------------------------------------------
def test_a_cache_over_a_mesh_is_one_sharded_zero_copy_view():
    with tp_pool(4) as pool:
        c = pool.create_kv_cache("m", 2, 4, 64, jnp.float32)
        assert c.tensor_parallel == 4 and c.shard_kv_heads == 1
        view = c.view
        assert view.shape == c.shape and view.shape[4] == 4
        assert view.sharding.spec == P(None, None, None, None, "tp", None)
        shards = sorted(view.addressable_shards, key=lambda s: s.device.id)
        assert [s.device for s in shards] == CPUS[:4]
        for s, buf in zip(shards, c.shards, strict=True):
            assert s.data.shape[4] == 1
            assert s.data.unsafe_buffer_pointer() == buf.base  # each device's own buffer


def test_alloc_and_free_map_every_device_in_lockstep():
    # 4 heads x 64 x fp32 x 16 tokens = 16 KiB a block: 128 blocks per 2 MiB page on one
    # device, 512 on each of four (a quarter of the heads each).
    used = {}
    for tp in (1, 2, 4):
        with tp_pool(tp) as pool:
            c = pool.create_kv_cache("m", 2, 4, 64, jnp.float32)
            ids = c.alloc(1000)
            per = pool.mapped_pages_per_device()
            assert len(per) == tp and len(set(per.values())) == 1
            assert c.mapped_pages_per_device() == [c.mapped_pages] * tp
            for buf in c.shards:  # the same pages on every device
                assert list(buf.mapped_pages()) == c.mapped_page_ids()
            used[tp] = c.mapped_bytes
            assert pool.stats()["mapped_bytes"] == c.mapped_bytes
            c.free(ids)
            assert set(pool.mapped_pages_per_device().values()) == {0}
    assert used[2] * 2 == used[1] and used[4] * 4 == used[1]


def test_a_shard_that_fails_to_map_leaves_nothing_mapped_anywhere():
    # Low level: device 2's page pool holds two KV pages (4 planes each), the others more.
    pools = [_C.PagePool("host", 2 << 20, 8 if i == 2 else 64, 0, 0, 0) for i in range(4)]
    bufs = [_C.KVBuffer(p, 2, 1, 64, 16, 0, 16, d.id, d.local_hardware_id)
            for p, d in zip(pools, CPUS, strict=True)]  # fmt: skip
    sb = ShardedBuffer(bufs)
    sb.map_pages(np.array([0, 1], np.int32))  # 2 KV pages = 8 physical pages: fits all
    with pytest.raises(kv.PoolExhausted):
        sb.map_pages(np.array([2], np.int32))
    assert sb.mapped_pages_per_shard() == [2, 2, 2, 2]
    assert [p.stats()["in_use_pages"] for p in pools] == [8, 8, 8, 8]


def test_the_registry_refuses_shards_that_do_not_form_one_cache():
    pools = [_C.PagePool("host", 2 << 20, 64, 0, 0, 0) for _ in range(2)]
    a = _C.KVBuffer(pools[0], 2, 1, 64, 16, 0, 16, CPUS[0].id, 0)
    other_layout = _C.KVBuffer(pools[1], 2, 2, 64, 16, 0, 16, CPUS[1].id, 1)
    same_device = _C.KVBuffer(pools[1], 2, 1, 64, 16, 0, 16, CPUS[0].id, 0)
    with pytest.raises(kv.KVCacheError, match="same layout"):
        _C.register_buffers([a, other_layout])
    with pytest.raises(kv.KVCacheError, match="two shards of one KV cache on device ordinal 0"):
        _C.register_buffers([a, same_device])
    with pytest.raises(kv.KVCacheError, match="at least one"):
        _C.register_buffers([])


def test_a_device_failing_to_map_in_alloc_raises_and_maps_nothing():
    with tp_pool(4) as pool:
        c = pool.create_kv_cache("m", 2, 4, 64, jnp.float32)
        # Page 3 already mapped on device 1 alone (bypassing the allocator): mapping it
        # again there fails, so the allocator's lockstep mapping of pages 0-3 fails.
        c.shards[1].map_pages(np.array([3], np.int32))
        with pytest.raises(kv.KVCacheError, match="already mapped"):
            c.alloc(4 * 512)
        assert c.num_used_blocks == 0 and c.mapped_pages == 0
        assert [b.num_mapped_pages for b in c.shards] == [0, 1, 0, 0]
        assert pool.ledger.mapped_pages("m") == 0
        c.shards[1].unmap_pages(np.array([3], np.int32))
        ids = c.alloc(4 * 512)  # and it works once the page is free
        assert c.mapped_page_ids() == [0, 1, 2, 3, 4]
        c.free(ids)


def test_bad_meshes_and_splits_are_clear_errors():
    with pytest.raises(ValueError, match="one axis"):
        kv.Pool("8MiB", backend="host", mesh=Mesh(np.array(CPUS[:4]).reshape(2, 2), ("a", "b")))
    with pytest.raises(ValueError, match="distinct"):
        kv.Pool("8MiB", backend="host", devices=[CPUS[0], CPUS[0]])
    with pytest.raises(ValueError, match="not several"):
        kv.Pool("8MiB", backend="host", device=CPUS[0], devices=CPUS[:2])
    with pytest.raises(ValueError, match="kv_axis"):
        kv.Pool("8MiB", backend="host", mesh=Mesh(np.array(CPUS[:2]), ("x",)), kv_axis="tp")
    with tp_pool(4, "16MiB") as pool:
        with pytest.raises(ValueError, match="3 KV heads, which do not split over the 4"):
            pool.create_kv_cache("m", 2, 3, 64, jnp.float32)
        assert pool.caches == {}


# -- the FFI ops under shard_map --------------------------------------------------------
def test_ops_under_shard_map_write_each_devices_heads_into_its_own_buffer():
    with tp_pool(4) as pool:
        c = pool.create_kv_cache("m", 2, 4, 64, jnp.float32)
        ids = c.alloc(2)
        slots = np.array([ids[0] * 16 + 3, ids[1] * 16], np.int32)
        k = jnp.arange(2 * 2 * 4 * 64, dtype=jnp.float32).reshape(2, 2, 4, 64)

        def write(cache, k, v, slots, token):  # cache: this device's buffer and heads
            return ops.write_kv_async(cache, 0, k, v, slots, token)

        sm = jax.shard_map(write, mesh=c.mesh, in_specs=(c.sharding.spec, HEADS, HEADS, P(), P()),
                           out_specs=P(), check_vma=False)  # fmt: skip
        jax.block_until_ready(jax.jit(sm)(c, k, -k, slots, ops.new_token()))
        view = np.asarray(c.view)
        np.testing.assert_array_equal(view[:, 0, ids[0], 3], k[:, 0])
        np.testing.assert_array_equal(view[:, 1, ids[1], 0], -k[:, 1])
        for d, buf in enumerate(c.shards):  # device d holds KV head d
            local = np.asarray(c.view.addressable_shards[d].data)
            assert local.shape[4] == 1 and buf.device_ordinal == CPUS[d].id
            np.testing.assert_array_equal(local[:, 0, ids[0], 3, 0], k[:, 0, d])

        # Outside shard_map, with every head: a clear error, nothing written.
        with pytest.raises(ValueError, match="inside jax.shard_map"):
            ops.write_kv_async(c, 0, k, k, slots, ops.new_token())
        # On devices the cache has no shard on: JAX moves the view there only by copying
        # it, and each device's handler refuses the copy.
        with tp_pool(2) as p2:
            c2 = p2.create_kv_cache("n", 2, 2, 64, jnp.float32)
            ids2 = c2.alloc(1)
            other = Mesh(np.array(CPUS[2:4]), ("tp",))
            sm2 = jax.shard_map(
                lambda view, k, v, s, t: ops.write_kv_async(c2, 0, k, v, s, t, view=view),
                mesh=other, in_specs=(c2.sharding.spec, HEADS, HEADS, P(), P()), out_specs=P(),
                check_vma=False,
            )  # fmt: skip
            k2 = jnp.ones((2, 1, 2, 64), jnp.float32)
            moved = jax.device_put(c2.view, jax.sharding.NamedSharding(other, c2.sharding.spec))
            with pytest.raises(FFI_ERRORS, match="not an open KV cache's view"):
                jax.block_until_ready(jax.jit(sm2)(moved, k2, k2, ids2[:1] * 16, ops.new_token()))
            assert not np.asarray(c2.view).any()  # nothing written
