"""Tenants on several threads share one pool: the budget holds and accounting stays exact."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

import jax_kvcached as kv
from jax_kvcached.memory import ops


def test_concurrent_tenants_keep_exact_accounting():
    pool = kv.Pool("24MiB", backend="host", min_reserved_pages=0, max_reserved_pages=2)
    caches = [pool.create_kv_cache(f"t{i}", 1, 2, 64, "float32") for i in range(3)]
    errors: list[BaseException] = []
    exhausted = [0]
    peak = [0]

    def worker(c: kv.KVCache, seed: int) -> None:
        rng = np.random.default_rng(seed)
        write = jax.jit(lambda c, k, s, t: ops.write_kv(c, 0, k, k, s, t))
        read = jax.jit(lambda view, ids: view[0, 0, ids, 0, 0, 0])
        held: list[np.ndarray] = []
        try:
            for _ in range(150):
                if held and rng.random() < 0.5:
                    ids = held.pop(int(rng.integers(len(held))))
                    padded = np.zeros(300, np.int32)
                    padded[: len(ids)] = ids
                    got = np.asarray(read(c.view, jnp.asarray(padded)))[: len(ids)]
                    np.testing.assert_array_equal(got, ids.astype(np.float32))
                    c.free(ids)
                else:
                    try:
                        ids = c.alloc(int(rng.integers(1, 300)))
                    except kv.PoolExhausted:
                        exhausted[0] += 1
                        continue
                    # Fixed shapes (padded with slot -1) so the write compiles once.
                    slots = np.full(300, -1, np.int32)
                    slots[: len(ids)] = ids * c.block_size
                    vals = np.zeros(300, np.float32)
                    vals[: len(ids)] = ids
                    k = jnp.broadcast_to(jnp.asarray(vals)[:, None, None], (300, 2, 64))
                    write(c, k, jnp.asarray(slots), ops.new_token()).block_until_ready()
                    held.append(ids)
                s = pool.stats()
                peak[0] = max(peak[0], s["mapped_pages"] + s["reserved_pages"])
            for ids in held:
                c.free(ids)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(c, i)) for i, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    s = pool.stats()
    assert s["mapped_pages"] == 0
    assert peak[0] <= s["budget_pages"]
    assert exhausted[0] > 0, "the budget was never under pressure; the test proves little"
    assert s["committed_bytes"] == s["reserved_pages"] * s["page_size"]
    pool.close()
