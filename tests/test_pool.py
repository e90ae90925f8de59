import numpy as np
import pytest
from conftest import make_cache

import jax_kvcached as kv


def test_budget_from_string(pool):
    assert pool.budget_pages == 32
    assert pool.memory_limit == 64 << 20
    s = pool.stats()
    assert s["budget_bytes"] == 64 << 20 and s["mapped_pages"] == 0 and s["caches"] == {}


def test_alloc_maps_pages_on_demand(pool):
    c = make_cache(pool)  # 2 layers -> 4 physical pages per KV page
    assert c.blocks_per_page == (2 << 20) // (16 * 2 * 64 * 4)
    ids = c.alloc(3)
    assert ids.dtype == np.int32 and sorted(ids.tolist()) == [1, 2, 3]
    assert pool.stats()["mapped_pages"] == 4
    more = c.alloc(c.blocks_per_page)  # fills page 0, spills into page 1
    assert pool.stats()["mapped_pages"] == 8
    assert len(set(ids.tolist()) | set(more.tolist())) == 3 + c.blocks_per_page
    c.free(np.concatenate([ids, more]))
    assert pool.stats()["mapped_pages"] == 0
    assert c.num_used_blocks == 0


def test_best_fit_packs_into_fullest_page(pool):
    c = make_cache(pool)
    bpp = c.blocks_per_page
    ids = c.alloc(2 * bpp)  # pages 0 and 1 (page 0 holds bpp - 1 blocks)
    page1 = [b for b in ids.tolist() if b // bpp == 1]
    page0 = [b for b in ids.tolist() if b // bpp == 0]
    c.free(page0[:10])  # page 0 has 10 free
    c.free(page1[:3])  # page 1 has 3 free: fuller, so it is used first
    got = c.alloc(3)
    assert all(b // bpp == 1 for b in got.tolist())
    assert pool.stats()["mapped_pages"] == 3 * 4  # page 2 mapped for the spill earlier


def test_two_caches_share_budget_and_reuse_pages():
    pool = kv.Pool("32MiB", backend="host", min_reserved_pages=0, max_reserved_pages=4)
    a = pool.create_kv_cache("a", 2, 2, 64, "float32")
    b = pool.create_kv_cache("b", 1, 4, 64, "bfloat16")
    ids_a = a.alloc(a.num_free_blocks)  # takes the whole budget
    assert pool.stats()["mapped_pages"] == pool.budget_pages
    assert b.num_free_blocks == 0
    with pytest.raises(kv.PoolExhausted):
        b.alloc(1)
    creates = pool.stats()["creates"]
    a.free(ids_a[: a.blocks_per_page * 2])  # frees at least one whole page
    freed = pool.budget_pages - pool.stats()["mapped_pages"]
    assert freed >= 4
    ids_b = b.alloc(1)
    s = pool.stats()
    assert s["creates"] == creates, "b must reuse a's pages, not create new ones"
    assert s["reuses"] >= 2
    assert s["mapped_pages"] + s["reserved_pages"] <= s["budget_pages"]
    a.free(ids_a[a.blocks_per_page * 2 :])
    b.free(ids_b)
    assert pool.stats()["mapped_pages"] == 0
    pool.close()


def test_exhausted_allocation_leaks_nothing(pool):
    c = make_cache(pool)
    before = pool.stats()
    with pytest.raises(kv.PoolExhausted):
        c.alloc(c.num_free_blocks + 1)
    after = pool.stats()
    assert after["mapped_pages"] == before["mapped_pages"]
    assert c.num_used_blocks == 0 and c.num_mapped_pages == 0
    ids = c.alloc(c.num_free_blocks)  # the full amount still works afterwards
    assert pool.stats()["mapped_pages"] == pool.budget_pages
    c.free(ids)


def test_reserve_bounds_keep_and_release_pages():
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=1, max_reserved_pages=2)
    c = pool.create_kv_cache("a", 2, 2, 64, "float32")  # 4 pages per KV page
    s = pool.stats()
    assert s["reserved_pages"] == 4  # min 1 KV page pre-created
    ids = c.alloc(5 * c.blocks_per_page)
    c.free(ids)
    s = pool.stats()
    assert s["mapped_pages"] == 0
    assert s["reserved_pages"] == 8  # max 2 KV pages kept, the rest released
    assert s["committed_bytes"] == 8 * pool.page_size
    pool.trim()
    assert pool.stats()["reserved_pages"] == 0
    assert pool.stats()["committed_bytes"] == 0
    pool.close()


def test_bad_arguments(pool):
    with pytest.raises(ValueError):
        kv.Pool("1KiB", backend="host")
    with pytest.raises(ValueError):
        kv.Pool("8MiB", backend="tpu")
    with pytest.raises(ValueError):
        kv.Pool("8MiB", backend="host", min_reserved_pages=3, max_reserved_pages=1)
    with pytest.raises(ValueError, match="already exists"):
        make_cache(pool)
        make_cache(pool)
    with pytest.raises(ValueError, match="num_layers"):
        pool.create_kv_cache("x", 0, 2, 64, "float32")
    with pytest.raises(ValueError, match="dtype"):
        pool.create_kv_cache("x", 1, 2, 64, "int8")
    with pytest.raises(kv.KVCacheError, match="larger than the page size"):
        pool.create_kv_cache("x", 1, 64, 256, "float32", block_size=64)  # 4 MiB blocks
    # A block that does not divide the page is packed (tests/test_packing.py).
    pool.create_kv_cache("x", 1, 3, 100, "float32", block_size=16).close()
    with pytest.raises(ValueError, match="cannot hold one KV page"):
        pool.create_kv_cache("x", 64, 2, 64, "float32")
    c = pool["a"]
    with pytest.raises(ValueError):
        c.alloc(-1)
    with pytest.raises(TypeError):
        c.alloc(1.5)
    ids = c.alloc(2)
    with pytest.raises(ValueError, match="not allocated"):
        c.free([ids[0], 9999])
    assert c.num_used_blocks == 2  # a failed free changes nothing
    with pytest.raises(ValueError, match="twice"):
        c.free([ids[0], ids[0]])
    c.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        c.free(ids)


def test_cuda_backend_without_gpu_is_a_clear_error():
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present: tests/gpu covers the CUDA backend")
    with pytest.raises((ValueError, kv.BackendError), match="GPU|CUDA"):
        kv.Pool("8MiB", backend="cuda")


def test_closed_cache_rejects_use(pool):
    c = make_cache(pool)
    c.alloc(3)
    c.close()
    assert pool.stats()["mapped_pages"] == 0
    assert "a" not in pool.caches
    with pytest.raises(kv.KVCacheError, match="closed"):
        c.alloc(1)
    with pytest.raises(kv.KVCacheError, match="closed"):
        _ = c.view


def test_auto_backend_on_a_gpu_without_cuda_is_an_error_not_the_cpu(monkeypatch):
    # A GPU JAX sees, a build without CUDA: never a silent KV cache on the CPU.
    monkeypatch.setattr("jax_kvcached.memory.pool._is_gpu", lambda device: True)
    monkeypatch.setattr("jax_kvcached.memory.pool._C.cuda_compiled", lambda: False)
    with pytest.raises(ValueError, match="no CUDA backend.*backend='host'"):
        kv.Pool("16MiB")
    kv.Pool("16MiB", backend="host").close()  # (asked for: the CPU)


def test_a_map_from_the_reserve_creates_no_page_itself():
    """The first-touch work of a map (creating, committing and zeroing pages) is the
    background thread's: a map served by the reserve creates nothing inline, and the
    reserve comes back to its floor by refills; the stats stay exact meanwhile."""
    import time

    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=2, max_reserved_pages=4)
    c = pool.create_kv_cache("a", 2, 2, 64, "float32")
    s0 = pool.stats()
    floor = s0["reserved_pages"]
    assert floor > 0 and s0["mapped_pages"] == 0
    ids = c.alloc(1)  # maps one KV page, from the reserve
    s1 = pool.stats()
    assert s1["mapped_pages"] > 0 and s1["reuses"] > s0["reuses"]
    assert s1["creates"] - s1["refills"] == s0["creates"] - s0["refills"]  # none inline
    assert s1["committed_bytes"] == (s1["mapped_pages"] + s1["reserved_pages"]) * s1["page_size"]
    guard = time.monotonic() + 60  # a hang guard, not a bound
    while pool.stats()["reserved_pages"] < floor and time.monotonic() < guard:
        time.sleep(0.01)
    s2 = pool.stats()
    assert s2["reserved_pages"] == floor and s2["refills"] >= s1["mapped_pages"]
    assert s2["committed_bytes"] == (s2["mapped_pages"] + s2["reserved_pages"]) * s2["page_size"]
    c.free(ids)
    pool.close()
