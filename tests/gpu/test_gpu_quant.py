"""Packed weights on a GPU: the dequantization folds into the matmul (the optimized HLO
holds no dequantized weight), the products are right, and an engine over packed
weights runs. Skipped only when no GPU is present."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpus, needs_gpu

from jax_kvcached.models.quant_format import INT4_MIN, INT8, QuantFormat, quantize
from jax_kvcached.models.quant_linear import quant_matmul

pytestmark = needs_gpu("GPU quant tests")

FORMATS = [INT8, INT4_MIN, QuantFormat(4), QuantFormat(4, 128, True)]


def _args(p, dev):
    mins = None if p.mins is None else jax.device_put(p.mins, dev)
    return jax.device_put(p.q, dev), jax.device_put(p.scales, dev), mins


def materialized(hlo: str, out: int, inputs: int) -> list[str]:
    """Instructions of the optimized HLO's entry computation (outside any fusion) whose
    result is a float array as large as the whole dequantized weight (any layout)."""
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[: entry.index("\n}\n")] if "\n}\n" in entry else entry
    found = []
    for line in entry.splitlines():
        m = re.search(r"=\s*(bf16|f16|f32)\[([\d,]+)\]", line)
        if m and np.prod([int(d) for d in m.group(2).split(",")]) == out * inputs:
            found.append(line.strip())
    return found


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 32])
def test_the_dequantization_fuses_into_the_matmul(fmt, rows):
    dev = gpus()[0]
    out, inputs = 1536, 576
    rng = np.random.default_rng(0)
    p = quantize(rng.standard_normal((out, inputs)).astype(np.float32), fmt)
    x = jax.device_put(rng.standard_normal((rows, inputs)).astype(np.float32), dev)
    xb = x.astype(jnp.bfloat16)
    fn = jax.jit(lambda x, q, s, m: quant_matmul(x, q, s, m, fmt))
    args = _args(p, dev)
    hlo = fn.lower(xb, *args).compile().as_text()
    assert not materialized(hlo, out, inputs), materialized(hlo, out, inputs)
    got = np.asarray(fn(x, *args))  # fp32 activations: the exact product
    want = np.asarray(x) @ p.dequantize().T
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max(), rtol=0)
    got16 = np.asarray(fn(xb, *args), np.float32)
    assert np.abs(got16 - want).max() < 0.02 * np.abs(want).max()


def test_an_engine_over_packed_weights_runs_on_the_gpu():
    import jax_kvcached as kv
    from jax_kvcached import Engine, SamplingParams
    from jax_kvcached.models import load_pretrained

    with jax.default_device(gpus()[0]):
        pre = load_pretrained("tiny-llama", dtype=jnp.bfloat16, quantization="int4")
        with kv.Pool("256MiB", backend="cuda") as pool:
            eng = Engine(pre.model, pool, max_batch=4, max_model_len=256)
            outs = eng.generate([[1, 2, 3, 4]] * 3, SamplingParams(max_tokens=8, ignore_eos=True))
            assert all(len(o.token_ids) == 8 for o in outs)
            assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
            stats = eng.stats()
            assert stats["weight_packed_bytes"] > 0.8 * stats["weight_bytes"]
