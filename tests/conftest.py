import os

# On a GPU, JAX would otherwise preallocate 75% of device memory and leave the CUDA
# backend's physical pages no room.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Four CPU devices for the tensor-parallel tests (set before JAX starts; no effect on
# GPUs). Single-device tests run on the first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ["XLA_FLAGS"] = flags.strip()

import jax
import pytest

import jax_kvcached as kv


@pytest.fixture(autouse=True)
def _cpu_default_device(request):
    """Host-backend tests run on the CPU device, also on machines that have a GPU."""
    if "gpu" in request.node.path.parts:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def pool():
    """A small host pool with no pre-created reserve, so page counts are exact."""
    p = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    yield p
    p.close()


def dense_greedy(model, prompt, n):
    """``n`` greedy tokens of ``model`` after ``prompt`` with no KV cache (the reference
    every layer's window and sinks included)."""
    import jax.numpy as jnp

    from jax_kvcached.engine.attention import no_cache_attention

    attend = no_cache_attention(model.config)
    toks = list(prompt)
    for _ in range(n):
        logits = model(jnp.asarray([toks]), jnp.arange(len(toks))[None], attend)
        toks.append(int(jnp.argmax(logits[0, -1])))
    return toks[len(prompt) :]


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
    blocks += cache.alloc(-(-len(toks) // cache.block_size) - len(blocks)).tolist()
    for h, b in zip(hs, blocks, strict=False):
        if not pc.is_cached(b):
            pc.insert(h, b)
    return blocks
