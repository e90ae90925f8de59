"""Compiles counted from JAX's monitoring events; a warm start compiles nothing."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp

from jax_kvcached.engine.compile_events import compile_events, compiled_functions, fresh_compiles


def test_the_counter_sees_a_new_program_and_not_a_cached_one():
    before = compile_events()
    f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
    f(jnp.ones(7)).block_until_ready()
    mid = compile_events()
    assert mid["traces"] > before["traces"] and mid["compiles"] > before["compiles"]
    assert fresh_compiles(before, mid) >= 1
    assert any(kind == "compiles" and "lambda" in name for kind, name in compiled_functions())
    f(jnp.zeros(7)).block_until_ready()  # the same shape: cached
    assert compile_events() == mid


_START = """
import json, resource, sys
from jax_kvcached.serve.compile_cache import enable_compile_cache
enable_compile_cache(sys.argv[1])
import jax_kvcached as kv
from jax_kvcached import Engine, SamplingParams
from jax_kvcached.engine.compile_events import compile_events
from jax_kvcached.models import load_pretrained
pool = kv.Pool("64MiB", backend="host")
quantization = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
eng = Engine(load_pretrained("tiny-llama", quantization=quantization).model, pool, max_batch=2,
             max_num_batched_tokens=16, max_model_len=256)
if sys.argv[3:] == ["full"]:  # the disk fills: file writes past 1 KiB fail from here on
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # (the pool's memfd is sized)
first = compile_events()
info = eng.compile()
warm = compile_events()
info["warmup_events"] = {k: warm[k] - first[k] for k in warm}
info["stored"] = (eng.runner.store.loaded, eng.runner.store.saved)
out = eng.generate([[1, 2, 3, 4, 5] * 7], SamplingParams(max_tokens=4))[0].token_ids
info["served_events"] = {k: compile_events()[k] - warm[k] for k in warm}
info["tokens"] = out
print(json.dumps(info))
"""


def test_a_warm_start_compiles_nothing(tmp_path):
    """A second process over the same persistent cache loads every program's stored
    executable (no trace, lowering or compile), and serving after either warm-up traces
    and compiles nothing; both answer the same."""
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _START, str(tmp_path / "xla")],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["xla_compiles"] >= cold["shapes"] > 0
    assert cold["stored"] == [0, cold["programs"]]  # every program compiled and stored
    # The warm start loads each executable: no trace, lowering or compile at all.
    assert warm["stored"] == [warm["programs"], 0]
    assert warm["warmup_events"] == dict.fromkeys(warm["warmup_events"], 0)
    assert warm["xla_compiles"] == 0
    assert warm["tokens"] == cold["tokens"]
    for run in runs:
        assert run["served_events"] == dict.fromkeys(run["served_events"], 0), run
    # Without the store, JAX's persistent cache serves the programs: none is stored (an
    # executable it loads serializes without its CPU kernels: a later start that loaded
    # it would fail to run it), and the answers stay the same.
    shutil.rmtree(tmp_path / "xla" / "kvcached-executables")
    proc = subprocess.run([sys.executable, "-c", _START, str(tmp_path / "xla")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    third = json.loads(proc.stdout.strip().splitlines()[-1])
    assert third["stored"] == [0, 0] and third["tokens"] == cold["tokens"]
    # Every stored file truncated (a crash mid-copy, a bad disk): the start compiles
    # again, answers the same, and each kind of failure is said once.
    for f in (tmp_path / "xla").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    proc = subprocess.run([sys.executable, "-c", _START, str(tmp_path / "xla")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["tokens"] == cold["tokens"]
    assert proc.stderr.count("holds entries that do not load") == 1, proc.stderr[-3000:]
    # JAX's one warning per entry became that line
    assert proc.stderr.count("Error reading persistent compilation cache entry") == 1
    # The disk fills before the steps compile (a file-size limit of 1 KiB: every write
    # fails): the start compiles, answers the same, stores nothing and says so once per
    # layer (JAX's cache, our store).
    shutil.rmtree(tmp_path / "xla")
    proc = subprocess.run([sys.executable, "-c", _START, str(tmp_path / "xla"), "", "full"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = json.loads(proc.stdout.strip().splitlines()[-1])
    assert full["tokens"] == cold["tokens"] and full["stored"] == [0, 0]
    assert proc.stderr.count("the compilation cache") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("the executable store") == 1, proc.stderr[-3000:]
    # JAX's one warning per entry became that one line
    assert proc.stderr.count("Error writing persistent compilation cache entry") == 1


def test_the_executable_store_drops_what_does_not_load_and_stays_under_its_cap(tmp_path):
    import os
    import time

    import numpy as np

    from jax_kvcached.engine.executables import ExecutableStore

    store = ExecutableStore(str(tmp_path), max_bytes=1 << 30)
    f = jax.jit(lambda x: x * 2 + 1)
    x = np.ones(5, np.float32)
    dev = [jax.devices()[0]]
    keys = [store.key("f", i, (x,), "test") for i in range(3)]
    assert len(set(keys)) == 3 and store.key("f", 0, (x,), "test") == keys[0]
    for k in keys:
        store.save(k, f.lower(x).compile())
    assert store.saved == 3
    np.testing.assert_array_equal(store.load(keys[0], dev)(x), x * 2 + 1)
    assert store.load(store.key("f", 9, (x,), "test"), dev) is None  # not stored
    path = os.path.join(str(tmp_path), keys[1] + ".xla")
    with open(path, "wb") as fh:  # a corrupt file: dropped, compiled again by the caller
        fh.write(b"not an executable")
    assert store.load(keys[1], dev) is None and not os.path.exists(path)
    # Over the cap, the least recently used go first (a load touches its file).
    old = time.time() - 100
    os.utime(os.path.join(str(tmp_path), keys[2] + ".xla"), (old, old))
    os.utime(os.path.join(str(tmp_path), keys[0] + ".xla"), (old - 50, old - 50))
    store.load(keys[0], dev)  # used now: newest
    size = os.path.getsize(os.path.join(str(tmp_path), keys[0] + ".xla"))
    small = ExecutableStore(str(tmp_path), max_bytes=size)
    assert sorted(os.listdir(str(tmp_path))) == [keys[0] + ".xla"]
    assert small.load(keys[0], dev) is not None


def test_a_warm_start_with_packed_weights_loads_its_executables(tmp_path):
    """The steps over int4 weights (their kernel a custom call) are stored and loaded like
    the others: the warm start compiles nothing and answers the same."""
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _START, str(tmp_path / "xla"), "int4"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["stored"] == [0, cold["programs"]]
    assert warm["stored"] == [warm["programs"], 0] and warm["xla_compiles"] == 0
    assert warm["tokens"] == cold["tokens"]


def test_an_executable_that_cannot_be_stored_is_said_once(tmp_path, caplog):
    import logging

    from jax_kvcached.engine.executables import ExecutableStore

    store = ExecutableStore(str(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="jax_kvcached.engine.executables"):
        for key in ("a", "b", "c"):
            store.save(key, object())  # (not an executable: serialization fails)
    said = [r.levelname for r in caplog.records if "cannot be serialized" in r.getMessage()]
    assert said == ["WARNING", "DEBUG", "DEBUG"]  # said once; the rest only at DEBUG
    assert store.saved == 0 and not list(tmp_path.iterdir())
