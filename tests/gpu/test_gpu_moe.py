"""Mixtures of experts on a GPU: jax.lax.ragged_dot computes each expert's rows only (no
product against every expert in the optimized HLO), its products are right, and an
engine over the tiny MoE preset gives the CPU's greedy tokens. Skipped only when no GPU
is present."""

import re

import jax
import numpy as np
import pytest
from conftest import gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.moe import grouped_matmul

pytestmark = needs_gpu("GPU MoE tests")


@pytest.mark.parametrize("rows", [8, 256])
def test_ragged_dot_computes_only_each_experts_rows(rows):
    dev = gpus()[0]
    e, k, n = 64, 256, 512
    rng = np.random.default_rng(0)
    sizes = np.bincount(rng.integers(0, e, rows), minlength=e).astype(np.int32)
    x = jax.device_put(rng.standard_normal((rows, k)).astype(np.float32), dev)
    w = jax.device_put(rng.standard_normal((e, k, n)).astype(np.float32), dev)
    s = jax.device_put(sizes, dev)
    f = jax.jit(lambda x, w, s: grouped_matmul(x, w, s))
    got = np.asarray(f(x, w, s))
    ends = np.cumsum(sizes)
    xs, ws = np.asarray(x), np.asarray(w)
    ref = np.concatenate([xs[end - n_g : end] @ ws[g] for g, (n_g, end) in
                          enumerate(zip(sizes, ends, strict=True))])  # fmt: skip
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.sqrt(k))  # (TF32 dots)
    hlo = f.lower(x, w, s).compile().as_text()
    dense = [ln for ln in hlo.splitlines()
             if re.search(rf"\[{e},{rows},{k}\]|\[{e},{rows},{n}\]", ln)]  # fmt: skip
    assert not dense, f"ragged_dot expanded over every expert: {dense[:3]}"


def test_the_tiny_moe_preset_gives_the_cpus_tokens_on_the_gpu():
    cfg = BUILTIN_CONFIGS["tiny-qwen3-moe"]
    prompts = [[256, *range(20, 60)], [256, 9, 8, 7]]
    outs = {}
    for backend, device in (("host", jax.devices("cpu")[0]), ("cuda", gpus()[0])):
        with jax.default_device(device):
            pool = kv.Pool("64MiB", backend=backend)
            eng = Engine(build_model(cfg, seed=0), pool, max_batch=2, max_model_len=128)
            got = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
            outs[backend] = [o.token_ids for o in got]
            eng.close()
            pool.close()
    assert outs["cuda"] == outs["host"]
