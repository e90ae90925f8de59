"""Load local Hugging Face checkpoints (config.json + safetensors, sharded or not).

Nothing is downloaded: ``path`` must be a directory on disk.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .llama import LlamaModel, build_model


def _tensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for file in _tensor_files(path):
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _targets(model: LlamaModel) -> dict[str, tuple[object, str, bool]]:
    """HF tensor name -> (module, attribute, transpose)."""
    t: dict[str, tuple[object, str, bool]] = {
        "model.embed_tokens.weight": (model.embed_tokens, "embedding", False),
        "model.norm.weight": (model.norm, "weight", False),
    }
    if model.lm_head is not None:
        t["lm_head.weight"] = (model.lm_head, "kernel", True)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (layer.input_layernorm, "weight", False)
        t[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm, "weight", False)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mod = getattr(layer.self_attn, name)
            t[p + f"self_attn.{name}.weight"] = (mod, "kernel", True)
            if mod.bias is not None:
                t[p + f"self_attn.{name}.bias"] = (mod, "bias", False)
        for name in ("gate_proj", "up_proj", "down_proj"):
            t[p + f"mlp.{name}.weight"] = (getattr(layer.mlp, name), "kernel", True)
    return t


def load_checkpoint(path: str, *, dtype=jnp.float32) -> tuple[ModelConfig, LlamaModel]:
    """Reads config.json and the safetensors weights in ``path`` into a LlamaModel."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, dtype=dtype)
    tensors = _read_tensors(path)
    targets = _targets(model)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    # Rotary caches some exporters save are derived, not weights.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(targets) - set(tensors))
    unexpected = sorted(set(tensors) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match a {cfg.model_type} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, (module, attr, transpose) in targets.items():
        value = jnp.asarray(tensors[name])
        if transpose:
            value = value.T
        param = getattr(module, attr)
        current = param[...]
        if value.shape != current.shape:
            raise ValueError(f"{name}: shape {value.shape} != model's {current.shape}")
        param[...] = value.astype(current.dtype)
    return cfg, model
