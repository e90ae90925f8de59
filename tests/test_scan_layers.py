"""Layers stored stacked and run under jax.lax.scan: the same logits as the unrolled
layers, one layer body in the step program whatever the depth."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.attention import no_cache_attend
from jax_kvcached.engine.runner import ModelRunner, StepInput
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.stack import layer_slice, num_stacked


def _tokens(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, size=(1, n)).astype(np.int32)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_scanned_and_unrolled_layers_give_the_same_logits(name):
    cfg = BUILTIN_CONFIGS[name]
    model = build_model(cfg, seed=1)
    assert num_stacked(model.layers) == cfg.num_layers
    ids = jnp.asarray(_tokens(24, cfg.vocab_size))
    pos = jnp.arange(24)[None]
    scanned = np.asarray(model(ids, pos, no_cache_attend))
    model.scan_layers = False
    unrolled = np.asarray(model(ids, pos, no_cache_attend))
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)
    # Layer by layer by hand (each layer its own module): the stacked rows are the layers.
    x = model.embed_tokens(ids)
    from jax_kvcached.models.llama import rope_inv_freq

    def no_cache_attend_layer(q, k, v, c):
        return no_cache_attend(None, q, k, v, c)

    for i in range(cfg.num_layers):
        layer = layer_slice(model.layers, i)
        x, _ = layer(x, pos, rope_inv_freq(cfg), no_cache_attend_layer, None)
    by_hand = np.asarray(model.logits(model.norm(x)))
    np.testing.assert_allclose(scanned, by_hand, rtol=1e-5, atol=1e-5)


def test_the_scan_threads_the_carry_in_layer_order():
    """The attention's carry goes through every layer in order, its index an int32."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    model = build_model(cfg, seed=0)

    def attend(i, q, k, v, seen):
        assert i.dtype == jnp.int32 and i.shape == ()
        return no_cache_attend(i, q, k, v)[0], seen * 10 + i + 1

    ids = jnp.asarray(_tokens(4, cfg.vocab_size))
    _, seen = jax.jit(lambda t: model.hidden_states(t, jnp.arange(4)[None], attend, 0))(ids)
    assert int(seen) == int("".join(str(i + 1) for i in range(cfg.num_layers)))


def _step_hlo(layers: int) -> tuple[str, np.ndarray]:
    cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], num_layers=layers)
    model = build_model(cfg, seed=0)
    pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
    c = pool.create_kv_cache("a", layers, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(model, c, attention="host", max_batch=2, max_num_batched_tokens=16,
                         max_model_len=64, scan_layers=True)  # fmt: skip
    blocks = c.alloc(2).tolist()
    logits = runner.run([StepInput([3, 4, 5], 0, blocks)])
    text = runner.lower((16, runner.widths[0])).as_text()
    pool.close()
    return text, np.asarray(logits)


def test_the_step_program_holds_one_layer_body_whatever_the_depth():
    """Compile time does not grow with depth: a 2-layer and an 8-layer model lower to the
    same number of instructions, with one K/V write and one attention call (in the loop)."""
    counts = {}
    for layers in (2, 8):
        text, logits = _step_hlo(layers)
        assert np.isfinite(logits).all()
        assert text.count("custom_call @kvcached_write_kv_async(") == 1
        assert text.count("custom_call @kvcached_paged_attention(") == 1
        assert "stablehlo.while" in text
        counts[layers] = len([ln for ln in text.splitlines() if "=" in ln])
    assert counts[2] == counts[8], counts


def test_the_runner_steps_scanned_and_unrolled_alike():
    """The paged step (host custom calls, layer index an operand) gives the same logits
    as the same model with its layers unrolled over per-layer weight arrays (static
    layer indices: the CPU default)."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    out = []
    for scan in (True, False):
        model = build_model(cfg, seed=2)
        pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
        c = pool.create_kv_cache("a", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
        runner = ModelRunner(model, c, attention="host", max_batch=2, max_num_batched_tokens=32,
                             max_model_len=128, scan_layers=scan)  # fmt: skip
        assert runner.scan_layers == scan and model.scan_layers  # the model given: as it was
        a, b = c.alloc(2).tolist(), c.alloc(2).tolist()
        prompt = _tokens(20, cfg.vocab_size, seed=3)[0].tolist()
        first = runner.run([StepInput(prompt, 0, a), StepInput(prompt[:7], 0, b)])
        second = runner.run([StepInput([5], 20, a), StepInput(prompt[7:12], 7, b)])
        out.append((np.asarray(first), np.asarray(second)))
        pool.close()
    for x, y in zip(out[0], out[1], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_an_abstract_model_has_the_built_models_stacked_shapes():
    from flax import nnx

    from jax_kvcached.models import abstract_model

    cfg = BUILTIN_CONFIGS["tiny-qwen2"]
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m))  # noqa: E731
    assert shapes(abstract_model(cfg)) == shapes(build_model(cfg))


# A slice materialised: a fusion named after one, or the op itself; its 2-D f32 output.
_SLICES = (
    re.compile(r"%(?:dynamic-)?slice[\w.-]* = f32\[(\d+),(\d+)\]"),
    re.compile(r"= f32\[(\d+),(\d+)\]\{[^}]*\} (?:dynamic-)?slice\("),
)


def _slices(text: str, elements: int) -> list[str]:
    out = []
    for ln in text.splitlines():
        for pat in _SLICES:
            m = pat.search(ln)
            if m and int(m.group(1)) * int(m.group(2)) >= elements:
                out.append(ln.strip()[:120])
                break
    return out


def test_the_cpu_step_copies_no_weights():
    """On a CPU the layers run unrolled over per-layer arrays: no slice of a stacked
    weight is materialised (XLA:CPU copies each one before its dot: +50% on SmolLM2's
    decode step); the scanned step, for contrast, does copy them."""
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    weight = cfg.hidden_size * cfg.intermediate_size  # one layer's gate/up/down kernel
    copies = {}
    for scan in (False, True):
        pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
        c = pool.create_kv_cache("a", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
        runner = ModelRunner(build_model(cfg), c, attention="host", max_batch=2,
                             max_num_batched_tokens=16, max_model_len=64,
                             scan_layers=None if not scan else True)  # fmt: skip
        assert runner.scan_layers == scan
        text = runner.lower((1, runner.widths[0])).compile().as_text()
        copies[scan] = _slices(text, weight)
        pool.close()
    assert copies[False] == [], copies[False][:3]
    assert copies[True], "the detector finds the scanned step's weight slices"
