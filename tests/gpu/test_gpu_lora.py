"""LoRA adapters on a GPU: the step's deltas through jax.lax.ragged_dot equal a per-token
reference (base-only rows untouched), and an engine with an adapter gives the CPU's
greedy tokens (the layers scanned, the stacks stacked). Skipped only when no GPU is
present."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from conftest import gpus, needs_gpu

import jax_kvcached as kv
from jax_kvcached.engine.engine import Engine
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.models import BUILTIN_CONFIGS, build_model
from jax_kvcached.models.lora import LoRABatch, projection_shapes

pytestmark = needs_gpu("GPU LoRA tests")


def test_the_deltas_through_ragged_dot_match_each_tokens_adapter():
    dev = gpus()[0]
    rng = np.random.default_rng(0)
    slots, fin, r, fout, tokens = 3, 64, 8, 96, 40
    a = rng.standard_normal((slots, fin, r)).astype(np.float32)
    b = rng.standard_normal((slots, r, fout)).astype(np.float32)
    x = rng.standard_normal((tokens, fin)).astype(np.float32)
    which = rng.integers(0, slots + 1, tokens).astype(np.int32)  # 0: the base alone
    batch = LoRABatch({"q_proj": jax.device_put(a[None], dev)},
                      {"q_proj": jax.device_put(b[None], dev)},
                      jax.device_put(which, dev), impl="ragged_dot")  # fmt: skip
    got = np.asarray(jax.jit(lambda x: batch.delta(jnp.int32(0), "q_proj", x))(
        jax.device_put(x, dev)))  # fmt: skip
    want = np.stack([x[i] @ a[s - 1] @ b[s - 1] if s else np.zeros(fout, np.float32)
                     for i, s in enumerate(which)])  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.sqrt(fin))  # (TF32)
    assert not got[which == 0].any()


def _adapter(folder, cfg, rank=4):
    """A random PEFT-format adapter of ``cfg`` on q and v (written with numpy alone)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    shapes, tensors = projection_shapes(cfg), {}
    for layer in range(cfg.num_layers):
        for t in ("q_proj", "v_proj"):
            fin, fout = shapes[t]
            p = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{p}.lora_A.weight"] = rng.standard_normal((rank, fin)).astype(np.float32)
            tensors[f"{p}.lora_B.weight"] = rng.standard_normal((fout, rank)).astype(np.float32)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"]}))  # fmt: skip
    return str(folder)


def test_an_adapter_gives_the_cpus_tokens_on_the_gpu(tmp_path):
    cfg = BUILTIN_CONFIGS["tiny-llama"]
    path = _adapter(tmp_path / "adapter", cfg)
    prompts = [[256, *range(20, 60)], [256, 9, 8, 7]]
    outs = {}
    for backend, device in (("host", jax.devices("cpu")[0]), ("cuda", gpus()[0])):
        with jax.default_device(device):
            pool = kv.Pool("64MiB", backend=backend)
            eng = Engine(build_model(cfg, seed=0), pool, max_batch=2, max_model_len=128,
                         max_loras=1, max_lora_rank=8)  # fmt: skip
            eng.load_adapter("a", path)
            got = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True),
                               adapter=["a", None])  # fmt: skip
            outs[backend] = [o.token_ids for o in got]
            eng.close()
            pool.close()
    assert outs["cuda"] == outs["host"]
