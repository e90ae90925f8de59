"""Randomized alloc/free sequences over two tenants of one pool keep exact accounting."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jax_kvcached as kv
from jax_kvcached.memory import ops


class TwoTenants(RuleBasedStateMachine):
    """Each live block holds its own id in its first slot, so a page shared by mistake
    between tenants, or mapped over another's data, shows up as a wrong value."""

    @initialize(min_res=st.integers(0, 2), extra=st.integers(0, 2))
    def setup(self, min_res, extra):
        # 64 KiB pages; blocks of 8 KiB -> 8 blocks per page; a 40-page budget.
        self.pool = kv.Pool(
            40 * 65536,
            page_size=65536,
            backend="host",
            min_reserved_pages=min_res,
            max_reserved_pages=min_res + extra,
        )
        self.caches = [
            self.pool.create_kv_cache("one", 1, 2, 64, "float32"),  # 2 pages per KV page
            self.pool.create_kv_cache("two", 3, 2, 64, "float32"),  # 6 pages per KV page
        ]
        self.live = [set(), set()]
        self.writers = [
            jax.jit(lambda c, k, s, t: ops.write_kv(c, c.num_layers - 1, k, k, s, t))
            for c in self.caches
        ]

    def teardown(self):
        if hasattr(self, "pool"):
            self.pool.close()

    @rule(which=st.integers(0, 1), n=st.integers(0, 30))
    def alloc(self, which, n):
        c = self.caches[which]
        free = c.num_free_blocks
        before = self.pool.stats()
        if n > free:
            try:
                c.alloc(n)
            except kv.PoolExhausted:
                pass
            else:
                raise AssertionError("alloc beyond num_free_blocks succeeded")
            after = self.pool.stats()
            assert after["mapped_pages"] == before["mapped_pages"]
            return
        ids = c.alloc(n).tolist()
        assert len(set(ids)) == n and not (set(ids) & self.live[which]) and 0 not in ids
        self.live[which].update(ids)
        if ids:
            # Padded to a fixed shape (slot -1 is skipped) so each writer compiles once.
            slots = np.full(32, -1, np.int32)
            slots[:n] = np.asarray(ids, np.int32) * c.block_size
            vals = np.zeros(32, np.float32)
            vals[:n] = ids
            k = jnp.broadcast_to(jnp.asarray(vals)[:, None, None], (32, 2, 64))
            self.writers[which](c, k, jnp.asarray(slots), ops.new_token()).block_until_ready()

    @precondition(lambda self: any(self.live))
    @rule(which=st.integers(0, 1), data=st.data())
    def free(self, which, data):
        live = sorted(self.live[which])
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
        self.caches[which].free(ids)
        self.live[which].difference_update(ids)

    @invariant()
    def accounting_is_exact(self):
        if not hasattr(self, "pool"):
            return
        s = self.pool.stats()
        mapped = sum(c.num_mapped_pages * c.pages_per_kv_page for c in self.caches)
        assert s["mapped_pages"] == mapped
        assert s["mapped_pages"] + s["reserved_pages"] <= s["budget_pages"]
        assert s["committed_bytes"] == (s["mapped_pages"] + s["reserved_pages"]) * s["page_size"]
        assert s["reserved_pages"] <= s["max_reserved_pages"]
        for c, live in zip(self.caches, self.live, strict=True):
            # Exactly the pages holding live blocks are mapped: no leak, no early unmap.
            pages = {b // c.blocks_per_page for b in live}
            assert set(c.mapped_page_ids()) == pages
            assert c.num_used_blocks == len(live)

    @invariant()
    def data_is_intact(self):
        if not hasattr(self, "pool"):
            return
        for c, live in zip(self.caches, self.live, strict=True):
            if live:
                ids = np.asarray(sorted(live))
                column = np.asarray(c.view[c.num_layers - 1, 0, :, 0, 0, 0])
                np.testing.assert_array_equal(column[ids], ids.astype(np.float32))


TwoTenants.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_two_tenants = TwoTenants.TestCase


def test_everything_returns_after_all_frees():
    pool = kv.Pool("32MiB", backend="host", min_reserved_pages=1, max_reserved_pages=2)
    pool.create_kv_cache("a", 2, 2, 64, "float32")
    pool.create_kv_cache("b", 1, 2, 64, "bfloat16")
    rng = np.random.default_rng(0)
    held = {"a": [], "b": []}
    for _ in range(200):
        name = "a" if rng.random() < 0.5 else "b"
        c = pool[name]
        if held[name] and rng.random() < 0.45:
            k = int(rng.integers(1, len(held[name]) + 1))
            c.free(held[name][:k])
            held[name] = held[name][k:]
        else:
            n = int(rng.integers(1, 200))
            if n <= c.num_free_blocks:
                held[name].extend(c.alloc(n).tolist())
    for name, ids in held.items():
        pool[name].free(ids)
    s = pool.stats()
    assert s["mapped_pages"] == 0
    assert all(c["mapped_pages"] == 0 and c["used_blocks"] == 0 for c in s["caches"].values())
    # What stays is only the reserve, within its bounds (in KV pages of the widest cache).
    assert 4 <= s["reserved_pages"] <= 8
    assert s["committed_bytes"] == s["reserved_pages"] * s["page_size"]
    pool.close()
