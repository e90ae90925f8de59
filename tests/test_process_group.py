"""Several processes share one budget through a process group's shared-memory ledger.

Real processes on the host backend: random allocation under contention, kill -9 (of a
tenant, and of a process holding the group's lock), cross-process pressure and ``ctl``
against a running server, groups apart, stale and foreign segments refused.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.cli import main
from jax_kvcached.memory import shm_segment
from jax_kvcached.memory.shared_ledger import SharedLedger
from jax_kvcached.memory.shm_segment import GroupMismatch

KVCacheError = kv.KVCacheError

PAGE = "64KiB"
ENV = {k: v for k, v in os.environ.items() if k != "KVCACHED_IPC_NAME"}


@pytest.fixture
def group():
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    shm_segment.remove(name)


def spawn(code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**ENV, **(env or {})}, cwd="/",
    )  # fmt: skip


def wait_line(proc: subprocess.Popen, want: str, timeout: float = 120) -> str:
    """The first stdout line starting with ``want`` (the process must still run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(want):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError(f"no {want!r} line")


def physical(records) -> int:
    """Pages the group holds: every tenant's mapped pages and every pool's reserve."""
    reserves = {r.member: r.reserved_pages for r in records}
    return sum(r.mapped_pages for r in records) + sum(reserves.values())


RANDOM_WORKER = r"""
import json, random, sys, time
import jax.numpy as jnp
import jax_kvcached as kv
group, seed, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
pool = kv.Pool(None, page_size="64KiB", backend="host", group=group, max_reserved_pages=2)
cache = pool.create_kv_cache(f"w{seed}", 1, 1, 64, jnp.float32)  # 2 pages a KV page
seg, row = pool.ledger.segment, pool.ledger.segment.find(f"w{seed}")
rng, held, ok, exhausted, worst = random.Random(seed), [], 0, 0, 0
print("ready", flush=True)
end = time.monotonic() + secs
while time.monotonic() < end:
    if held and rng.random() < 0.45:
        cache.free(held.pop(rng.randrange(len(held))))
    else:
        n = rng.randint(1, 40)
        try:
            held.append(cache.alloc(n)); ok += 1
        except kv.PoolExhausted:
            exhausted += 1
            pool.reclaim(cache.name, 2 * -(-n // 16))  # the others give their reserve back
    recs = pool.group_records()
    reserves = {r.member: r.reserved_pages for r in recs}
    worst = max(worst, sum(r.mapped_pages for r in recs) + sum(reserves.values()))
    # what the group sees of this process is what it has mapped
    assert seg.get(row, "mapped_pages") == cache.mapped_pages == pool.stats()["mapped_pages"]
for h in held:
    cache.free(h)
left = pool.stats()["mapped_pages"]
pool.close()
print(json.dumps({"ok": ok, "exhausted": exhausted, "worst": worst, "left": left}), flush=True)
"""


def test_three_processes_share_one_budget_exactly(group):
    import json

    budget = 48  # pages of 64 KiB
    creator = kv.Pool(budget * 65536, page_size=PAGE, backend="host", group=group)
    procs = [spawn(RANDOM_WORKER, group, str(seed), "4") for seed in (1, 2, 3)]
    observer = SharedLedger.attach(group)
    try:
        for p in procs:
            wait_line(p, "ready")
        samples, worst = 0, 0
        while any(p.poll() is None for p in procs):
            worst = max(worst, physical(observer.records()))
            samples += 1
            time.sleep(0.005)
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.splitlines()[-1]))
        assert samples > 20 and worst <= budget
        assert all(r["worst"] <= budget for r in results)
        assert all(r["left"] == 0 for r in results)  # every page unmapped before leaving
        assert sum(r["ok"] for r in results) > 30
        assert sum(r["exhausted"] for r in results) > 0  # they really contended
        assert observer.records() == []  # nothing left behind in the group
    finally:
        for p in procs:
            p.kill()
        observer.close()
        creator.close()


HOLDER = r"""
import sys, time
import jax.numpy as jnp
import jax_kvcached as kv
pool = kv.Pool(None, page_size="64KiB", backend="host", group=sys.argv[1])
cache = pool.create_kv_cache("holder", 1, 1, 64, jnp.float32)
cache.alloc(16 * 10 - 1)  # 10 KV pages = 20 pages (block 0 is never used)
print("ready", cache.mapped_pages, flush=True)
time.sleep(600)
"""

LOCKER = r"""
import sys, time
from jax_kvcached.memory.shared_ledger import SharedLedger
led = SharedLedger.attach(sys.argv[1])
with led.segment.locked():
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_killed_process_returns_its_pages_and_never_deadlocks_the_group(group):
    pool = kv.Pool(32 * 65536, page_size=PAGE, backend="host", group=group)
    cache = pool.create_kv_cache("survivor", 1, 1, 64, jnp.float32)
    holder = spawn(HOLDER, group)
    try:
        assert wait_line(holder, "ready").split()[1] == "20"
        assert cache.num_free_blocks == 16 * 6 - 1  # 12 of 32 pages left
        with pytest.raises(kv.PoolExhausted):
            cache.alloc(16 * 7)
        os.kill(holder.pid, signal.SIGKILL)  # not reaped yet: a zombie until we wait
        # Nothing here returns them: the group's watcher finds the dead process (it
        # sweeps every 0.5 s). The bound only stops a hang: a loaded 2-core machine may
        # delay a sweep by seconds, never by a minute.
        t0 = time.monotonic()
        while any(r.name == "holder" for r in pool.ledger.records()):
            assert time.monotonic() - t0 < 60, "the dead process's pages were not returned"
            time.sleep(0.02)
        ids = cache.alloc(16 * 16 - 1)  # the whole budget
        assert cache.mapped_pages == 32
        cache.free(ids)
    finally:
        holder.kill()
        holder.wait()
    # A process killed while it holds the group's lock: the kernel drops the lock.
    locker = spawn(LOCKER, group)
    try:
        wait_line(locker, "locked")
        done = threading.Event()
        t = threading.Thread(target=lambda: (pool.ledger.records(), done.set()), daemon=True)
        t.start()
        assert not done.wait(0.5)  # really held
        os.kill(locker.pid, signal.SIGKILL)
        assert done.wait(5)
        assert cache.alloc(3).size == 3  # charges go on
    finally:
        locker.kill()
        locker.wait()
    assert [r.name for r in pool.ledger.records()] == ["survivor"]
    pool.close()


RECLAIMABLE = r"""
import sys, time
import jax.numpy as jnp
import jax_kvcached as kv
pool = kv.Pool(None, page_size="64KiB", backend="host", group=sys.argv[1])
cache = pool.create_kv_cache("idle", 1, 1, 64, jnp.float32)
pool.set_memory_guarantee("idle", 4 * 65536)
held = [cache.alloc(15)] + [cache.alloc(16) for _ in range(11)]  # 12 KV pages: 24 pages
def give_back(pages):  # an engine evicts idle cached prefixes; here: whole KV pages
    freed = 0
    while held and freed < pages:
        cache.free(held.pop()); freed += 2
    return freed
pool.set_reclaimer("idle", give_back)
print("ready", cache.mapped_pages, flush=True)
time.sleep(600)
"""


def test_a_tenant_short_of_memory_gets_other_processes_idle_memory(group):
    pool = kv.Pool(32 * 65536, page_size=PAGE, backend="host", group=group)
    cache = pool.create_kv_cache("busy", 1, 1, 64, jnp.float32)
    idle = spawn(RECLAIMABLE, group)
    try:
        assert wait_line(idle, "ready").split()[1] == "24"
        assert cache.num_free_blocks == 16 * 4 - 1
        freed = pool.reclaim("busy", 40)  # more than it may take: its guarantee stays
        assert freed == 20  # (the other process answered: a timed-out ask frees nothing)
        (other,) = [r for r in pool.ledger.records() if r.name == "idle"]
        assert other.mapped_pages == 4 and other.request_pages == 0
        assert other.given_pages == 20
        ids = cache.alloc(16 * 14 - 1)  # 28 pages: all but the other's guarantee
        assert cache.mapped_pages == 28 and physical(pool.ledger.records()) == 32
        with pytest.raises(kv.PoolExhausted):
            cache.alloc(16)
        cache.free(ids)
    finally:
        idle.kill()
        idle.wait()
    pool.close()


def test_groups_never_see_each_other_and_names_are_unique_in_a_group(group):
    other = group + "-b"
    try:
        a = kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
        b = kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=other)
        ca = a.create_kv_cache("m", 1, 1, 64, jnp.float32)
        cb = b.create_kv_cache("m", 1, 1, 64, jnp.float32)  # same name, other group
        ia, ib = ca.alloc(16 * 4 - 1), cb.alloc(16 * 4 - 1)  # each has its whole budget
        assert ca.mapped_pages == cb.mapped_pages == 8
        assert [r.mapped_pages for r in a.group_records()] == [8]
        assert [r.mapped_pages for r in b.group_records()] == [8]
        a2 = kv.Pool(None, page_size=PAGE, backend="host", group=group)
        with pytest.raises(ValueError, match="already registered in group"):
            a2.create_kv_cache("m", 1, 1, 64, jnp.float32)
        assert a2.budget_pages == 8 and a2.group_records()[0].name == "m"
        with pytest.raises(ValueError, match="live tenants"):
            kv.Pool(16 * 65536, page_size=PAGE, backend="host", group=group)
        ca.free(ia)
        cb.free(ib)
        for p in (a2, a, b):
            p.close()
        # without live tenants a group takes its next creator's budget
        c = kv.Pool(16 * 65536, page_size=PAGE, backend="host", group=group)
        assert c.budget_pages == 16
        c.close()
    finally:
        shm_segment.remove(other)


def _write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def test_stale_foreign_and_mismatched_segments_are_refused(group):
    path = shm_segment.segment_path(group)
    _write_private(path, b"somebody else's data" * 100)
    with pytest.raises(GroupMismatch, match="not a jax-kvcached group"):
        kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
    with pytest.raises(GroupMismatch, match="not a jax-kvcached group"):
        SharedLedger.attach(group)
    # an older layout: our magic, another version
    head = np.zeros((), shm_segment.HEADER)
    head["magic"], head["version"], head["initialized"] = shm_segment.MAGIC, 0, 1
    head["max_tenants"] = shm_segment.MAX_TENANTS
    _write_private(path, head.tobytes() + bytes(shm_segment.SIZE - head.nbytes))
    with pytest.raises(GroupMismatch, match="layout version 0"):
        kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
    assert open(path, "rb").read(8) == shm_segment.MAGIC  # left as it was
    shm_segment.remove(group)
    pool = kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
    with pytest.raises(GroupMismatch, match="same page size"):
        kv.Pool(None, page_size="128KiB", backend="host", group=group)
    with pytest.raises(ValueError, match="group name"):
        kv.Pool(8 * 65536, backend="host", group="../etc")
    with pytest.raises(ValueError, match="min_reserved_pages must be 0"):
        kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group, min_reserved_pages=1)
    with pytest.raises(KeyError, match="no group"):
        SharedLedger.attach(group + "-none")
    pool.close()


def test_a_segment_another_user_could_read_or_made_first_is_not_joined(group, tmp_path):
    """Pre-created by a stranger (open to all, or theirs) or a symlink to elsewhere: the
    group refuses it, naming why, and changes nothing; a private one of ours is joined."""
    path = shm_segment.segment_path(group)
    _write_private(path, b"", mode=0o666)  # another user's pre-created, open to all
    with pytest.raises(KVCacheError, match="has mode 666, not 600"):
        kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
    with pytest.raises(KVCacheError, match="has mode 666"):
        SharedLedger.attach(group)
    assert os.path.getsize(path) == 0  # nothing written into it
    if os.getuid() == 0:  # (only root can give a file away)
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
        with pytest.raises(KVCacheError, match="belongs to another user"):
            kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
    os.unlink(path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, path)
    with pytest.raises(KVCacheError, match="cannot open"):
        kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group)
    assert target.read_bytes() == b""
    os.unlink(path)
    with kv.Pool(8 * 65536, page_size=PAGE, backend="host", group=group):
        assert (os.stat(path).st_mode & 0o777) == 0o600  # made private


def test_ctl_lists_and_changes_tenants_with_clear_errors(group, capsys):
    pool = kv.Pool(32 * 65536, page_size=PAGE, backend="host", group=group)
    cache = pool.create_kv_cache("model-a", 2, 1, 64, jnp.float32)  # 4 pages a KV page
    ids = cache.alloc(16 * 3 - 1)
    assert main(["ctl", "--group", group, "list"]) == 0
    out = capsys.readouterr().out
    assert f"group {group}: budget 2.0 MiB, mapped 768.0 KiB" in out
    (row,) = [ln.split() for ln in out.splitlines() if ln.startswith("model-a")]
    assert row[1] == str(os.getpid()) and row[2:4] == ["768.0", "KiB"]
    assert main(["ctl", "--group", group, "limit", "model-a", "300KiB"]) == 0
    out = capsys.readouterr().out
    assert "limit of 'model-a': 256.0 KiB" in out and "512.0 KiB above it" in out
    assert cache.over_limit_pages == 8
    assert main(["ctl", "--group", group, "guarantee", "model-a", "100KiB"]) == 0
    assert "guarantee of 'model-a': 256.0 KiB" in capsys.readouterr().out
    assert main(["ctl", "--group", group, "limit", "model-a", "none"]) == 0
    assert cache.over_limit_pages == 0
    for argv, msg in (
        (["limit", "nobody", "1MiB"], "no tenant named 'nobody'"),
        (["limit", "model-a", "lots"], "cannot parse 'lots'"),
        (["limit", "model-a", "100KiB"], "below its guarantee"),
        (["guarantee", "model-a", "4MiB"], "exceeds its limit"),
    ):
        assert main(["ctl", "--group", group, *argv]) == 2
        assert msg in capsys.readouterr().err
    assert main(["ctl", "--group", group + "-none", "list"]) == 2
    assert "no group" in capsys.readouterr().err
    assert main(["ctl", "--group", group, "watch", "--count", "2", "--interval", "0.01"]) == 0
    assert capsys.readouterr().out.count(f"group {group}:") == 2
    cache.free(ids)
    pool.close()


def test_a_server_in_a_group_gives_memory_back_and_obeys_ctl(group, tmp_path):
    """`serve --group` (tiny-llama: 8 pages a KV page of 16 blocks) holds idle cached
    prefixes; an engine in this process needs them; `ctl limit` shrinks the server."""
    import httpx
    from test_cli import start_serve

    from jax_kvcached.engine.engine import Engine
    from jax_kvcached.engine.sampling import SamplingParams
    from jax_kvcached.models import BUILTIN_CONFIGS, build_model

    proc, url = start_serve(
        ["--model", "a=tiny-llama", "--memory", "4MiB", "--page-size", PAGE, "--group", group,
         "--no-warmup", "--backend", "host", "--max-batch", "2", "--max-queue", "4"],
        tmp_path,
    )  # fmt: skip
    try:
        rng = np.random.default_rng(0)
        for _ in range(3):  # three 600-byte prompts: their prefixes stay cached, idle
            prompt = bytes(rng.integers(97, 123, 600).tolist()).decode()
            body = {"model": "a", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        pool = kv.Pool(None, page_size=PAGE, backend="host", group=group)
        assert pool.memory_limit == 4 << 20  # the group's budget
        (a,) = pool.group_records()
        assert a.pid == proc.pid and a.mapped_pages >= 6 * 8  # most of the budget, idle
        eng = Engine(build_model(BUILTIN_CONFIGS["tiny-llama"], seed=1), pool, name="p",
                     max_batch=1, max_num_batched_tokens=128)  # fmt: skip
        (out,) = eng.generate([rng.integers(0, 256, 700).tolist()], SamplingParams(max_tokens=2))
        assert len(out.token_ids) == 2  # 3 KV pages the server gave back on request
        a, p = pool.group_records()
        assert a.given_pages >= 8 and p.mapped_pages >= 3 * 8
        assert physical(pool.group_records()) <= pool.budget_pages
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvcached_group_mapped_bytes{{group="{group}",pid="{os.getpid()}",tenant="p"}}' in (
            metrics
        )
        cmd = [sys.executable, "-m", "jax_kvcached.cli"]
        top = subprocess.run([*cmd, "top", "--url", url, "--once"], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)  # fmt: skip
        assert f"group {group}: every process" in top.stdout, top.stderr
        assert {ln.split()[0] for ln in top.stdout.split("every process")[1].splitlines()[2:]} == {
            "a",
            "p",
        }
        # ctl, from another process, lowers the running server's limit: it shrinks
        r = subprocess.run([*cmd, "ctl", "--group", group, "limit", "a", "1MiB"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0 and "limit of 'a': 1.0 MiB" in r.stdout, r.stderr
        t0 = time.monotonic()
        while pool.ledger.mapped_pages("a") > 16:
            assert time.monotonic() - t0 < 5, "the server did not shrink to its new limit"
            time.sleep(0.05)
        body = {"model": "a", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        assert pool.ledger.mapped_pages("a") <= 16
        listing = subprocess.run([*cmd, "ctl", "--group", group, "list"], capture_output=True,
                                 text=True, timeout=60, cwd=tmp_path).stdout  # fmt: skip
        rows = {ln.split()[0]: ln.split() for ln in listing.splitlines()[2:]}
        assert set(rows) == {"a", "p"} and rows["a"][1] == str(proc.pid)
        assert rows["a"][6:8] == ["1.0", "MiB"]  # its limit
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert [r.name for r in pool.group_records()] == ["p"]  # the server left the group
    eng.close()
    assert pool.group_records() == [] and pool.stats()["mapped_pages"] == 0
    pool.close()


def test_the_group_and_its_wait_come_from_the_environment(group):
    from jax_kvcached.memory.config import Config

    cfg = Config.from_env({"KVCACHED_IPC_NAME": group, "KVCACHED_IPC_RECLAIM_WAIT_S": "0.25"})
    assert (cfg.ipc_name, cfg.ipc_reclaim_wait_s) == (group, 0.25)
    assert Config.from_env({}).ipc_name is None
    with pytest.raises(ValueError, match="KVCACHED_IPC_RECLAIM_WAIT_S"):
        Config.from_env({"KVCACHED_IPC_RECLAIM_WAIT_S": "soon"})
    pool = kv.Pool(8 * 65536, page_size=PAGE, backend="host", config=cfg)
    assert pool.group == group and pool.ledger.wait_s == 0.25
    assert pool.stats()["group"] == group
    pool.close()


@pytest.mark.parametrize("in_group", [False, True])
def test_an_engine_closes_cleanly_after_its_pool(group, in_group):
    from jax_kvcached.engine.engine import Engine
    from jax_kvcached.models import BUILTIN_CONFIGS, build_model

    pool = kv.Pool("8MiB", page_size=PAGE, backend="host", group=group if in_group else None)
    eng = Engine(build_model(BUILTIN_CONFIGS["tiny-llama"]), pool, name="m")
    pool.close()
    eng.close()  # before: KeyError (its tenant was gone)
    assert eng.cache.closed
    with pytest.raises(KeyError):
        pool.set_reclaimer("m", lambda pages: 0)  # setting one for nobody is still an error
