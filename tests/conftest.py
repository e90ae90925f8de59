import atexit
import functools
import os
import pathlib
import shutil
import tempfile

# On a GPU, JAX would otherwise preallocate 75% of device memory and leave the CUDA
# backend's physical pages no room.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Four CPU devices for the tensor-parallel tests (set before JAX starts; no effect on
# GPUs). Single-device tests run on the first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ["XLA_FLAGS"] = flags.strip()
# On a machine without a GPU, the CPU backend's LLVM passes at their lowest level: the
# suite is mostly compiling small programs, and this cuts 12% of its time (measured on
# test_gguf + test_tensor_parallel + test_quant: 182 -> 160 s). The programs compute the
# same (XLA's HLO passes and fast-math settings are unchanged); benchmarks and `serve`
# keep the default. A GPU run keeps every default, so it tests what users run.
if not os.path.exists("/dev/nvidiactl") and "xla_backend_optimization_level" not in os.environ[
    "XLA_FLAGS"
]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One JAX compilation cache for the whole session, fresh each session (the cold run is
# what CI pays): every program compiles once, later engines and `serve` subprocesses of
# the same shapes load it. xdist workers inherit the controller's folder; whoever made
# the folder removes it. Tests whose subject is a cold or broken cache pass their own.
SESSION_CACHE_ENV = "KVCACHED_TEST_COMPILE_CACHE"
if not os.environ.get(SESSION_CACHE_ENV):
    os.environ[SESSION_CACHE_ENV] = tempfile.mkdtemp(prefix="kvcached-test-xla-")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE_ENV], ignore_errors=True)
COMPILE_CACHE = os.environ[SESSION_CACHE_ENV]
os.environ["KVCACHED_COMPILE_CACHE"] = COMPILE_CACHE  # `serve`'s default folder

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_kvcached as kv  # noqa: E402

jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Under pytest-xdist (pyproject's addopts: -n 2), a module that makes a module-scoped
# fixture (a server, replicas, a real model, a transformers model or tokenizer) runs on
# one worker, so the fixture is made once; the other tests spread over the workers one
# by one. (A scheduler of our own: xdist's loadgroup marks do not reach pytest 9.2's node
# ids, and its loadfile would pin every module.)
@functools.cache
def shares_a_fixture(path: str) -> bool:
    """Whether the test module at ``path`` defines a module-scoped fixture."""
    text = pathlib.Path(path).read_text()
    return 'scope="module"' in text or "scope='module'" in text


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrTest(LoadScopeScheduling):
        """Work units: a whole module where it shares a fixture, else one test."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            full = config.rootpath / path
            return path if full.is_file() and shares_a_fixture(str(full)) else nodeid

    return ModuleOrTest(config, log)


@pytest.fixture(autouse=True)
def _cpu_default_device(request):
    """Host-backend tests run on the CPU device, also on machines that have a GPU."""
    if "gpu" in request.node.path.parts:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def host_pool(memory="64MiB", page_size=None, **kw) -> kv.Pool:
    """A host pool with no pre-created reserve (unless ``kw`` asks), so page counts are
    exact: the pool most tests use."""
    kw.setdefault("min_reserved_pages", 0)
    kw.setdefault("max_reserved_pages", 0)
    if page_size is not None:
        kw["page_size"] = page_size
    return kv.Pool(memory, backend="host", **kw)


@pytest.fixture
def pool():
    """A small host pool with no pre-created reserve, so page counts are exact."""
    p = host_pool()
    yield p
    p.close()


def gpus() -> list:
    """The GPUs JAX sees (none on a machine without one)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def needs_gpu(what: str):
    """The mark of a GPU test module: skipped where no GPU is present, saying so."""
    return pytest.mark.skipif(not gpus(), reason=f"no GPU present: {what} need one")


def free_port() -> int:
    """A free loopback TCP port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_addr() -> str:
    """A loopback ``--dist-init-addr`` whose PORT and PORT+1 (the step channel) are both
    free now (a free PORT alone once met PORT+1 taken by another test's connection)."""
    import socket

    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return f"127.0.0.1:{port}"
    raise RuntimeError("no two free adjacent loopback ports")


_DENSE: dict[int, tuple] = {}  # id(model) -> (model, jitted logits_at)


def dense_greedy(model, prompt, n, width=None, with_logits=False):
    """``n`` greedy tokens of ``model`` after ``prompt`` with no KV cache (the reference:
    every layer's window and sinks included). One jitted program per model and width: the
    tokens are padded at the end to ``width`` (default: the next multiple of 64; causal,
    so the padding changes no earlier logit) and the weights are an argument, so every
    step runs the same compiled program (another model of the same config loads it from
    the session's compile cache).
    ``with_logits``: also each step's logits at the last position."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jax_kvcached.engine.attention import no_cache_attention

    if id(model) not in _DENSE or _DENSE[id(model)][0] is not model:
        graphdef, _ = nnx.split(model)
        attend = no_cache_attention(model.config)

        @jax.jit
        def logits_at(state, toks, i):
            pos = jnp.arange(toks.shape[0])[None]
            return nnx.merge(graphdef, state)(toks[None], pos, attend)[0, i]

        _DENSE[id(model)] = (model, logits_at)
    logits_at = _DENSE[id(model)][1]
    state = nnx.state(model)
    width = width or -(-(len(prompt) + n) // 64) * 64
    toks = np.zeros(width, np.int32)
    toks[: len(prompt)] = prompt
    out = []
    for i in range(len(prompt) - 1, len(prompt) + n - 1):
        logits = logits_at(state, toks, i)
        toks[i + 1] = int(jnp.argmax(logits))
        out.append(np.asarray(logits))
    tokens = toks[len(prompt) : len(prompt) + n].tolist()
    return (tokens, out) if with_logits else tokens


def hf_greedy(hf, prompt, n):
    """``n`` greedy tokens of a transformers model's ``generate`` after ``prompt``."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_logits_match(hf, model, cfg, tol=1e-4):
    """The model's fp32 logits of 40 random token ids (below 300), run without a cache,
    within ``tol`` x max(1, the largest logit) of a transformers model's."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from jax_kvcached.engine.attention import no_cache_attention

    ids = np.random.default_rng(0).integers(0, 300, 40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(model(jnp.asarray([ids]), jnp.arange(40)[None], no_cache_attention(cfg))[0])
    assert np.abs(got - ref).max() < tol * max(1.0, np.abs(ref).max())


def check_group_accounting(eng):
    """Per KV cache group: mapped pages are exactly the pages of its cached blocks;
    nothing held by a request."""
    for g, group in enumerate(eng.cache.groups):
        pc = eng.kv.prefix_caches[g] if eng.kv.prefix_caches else None
        cached = pc.cached_blocks() if pc else []
        assert group.num_used_blocks == len(cached), g
        assert set(group.mapped_page_ids()) == {group.page_of(b) for b in cached}, g
        assert eng.kv.pools[g].num_held_blocks == 0, g  # one count per block, all 0
        eng.kv.pools[g].check()
    assert eng.cache.mapped_pages == sum(g.mapped_pages for g in eng.cache.groups)


def gguf_writer(path, arch, c):
    """A ``gguf.GGUFWriter`` with the keys every test file's architecture shares, from a
    transformers config ``c``; the caller adds its own keys and tensors, then
    :func:`gguf_write`."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    return w


def gguf_write(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tp_pool(tp, memory="64MiB", **kw):
    """A host pool over the first ``tp`` CPU devices (a plain one-device pool for 1)."""
    if tp == 1:
        return kv.Pool(memory, backend="host", **kw)
    return kv.Pool(memory, backend="host", devices=jax.devices("cpu")[:tp], **kw)


def make_cache(pool, name="a", layers=2, heads=2, dim=64, dtype="float32", block_size=16):
    return pool.create_kv_cache(name, layers, heads, dim, dtype, block_size=block_size)


# An FFI error surfaces as JaxRuntimeError, or as ValueError when JAX ran the call
# synchronously during dispatch (small eager ops); the message is the handler's.
FFI_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


def hold_prefix(pc, cache, toks, extra=b""):
    """What a sequence does with a prefix cache: match the cached prefix, allocate the
    rest, cache its full blocks. Returns the sequence's blocks."""
    from jax_kvcached.engine.prefix_cache import hash_blocks

    hs = hash_blocks(toks, cache.block_size, extra)
    blocks = pc.match(hs)
    blocks += pc.pool.alloc(-(-len(toks) // cache.block_size) - len(blocks))
    for h, b in zip(hs, blocks, strict=False):
        if not pc.is_cached(b):
            pc.insert(h, b)
    return blocks


# -- the suite's durations ---------------------------------------------------------------
# Every test's setup + call + teardown seconds, written after the session (by the
# controller under xdist) to test-durations.tsv beside pyproject.toml, slowest first, and
# the 25 slowest printed.
_DURATIONS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or not _DURATIONS:
        return  # an xdist worker: the controller writes the file
    rows = sorted(_DURATIONS.items(), key=lambda kv: -kv[1])
    path = session.config.rootpath / "test-durations.tsv"
    path.write_text("".join(f"{s:.2f}\t{n}\n" for n, s in rows))
    total = sum(_DURATIONS.values())
    tw = session.config.get_terminal_writer()
    tw.sep("=", f"the 25 slowest of {len(rows)} tests (setup + call + teardown)")
    for n, sec in rows[:25]:
        tw.line(f"{sec:8.2f}s {n}")
    tw.line(f"{total:.0f} s of tests in all (summed over workers); each in {path.name}")
