"""The GPT-OSS family: attention sinks, biases on every attention projection, sliding
and full layers alternating, YaRN, experts with biases and the clamped SwiGLU (MXFP4 in
OpenAI's checkpoints), on :class:`~.llama.LlamaModel`'s decoder. Its config.json and GGUF
(``gpt-oss``) readers, checkpoint layout and preset."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from . import registry
from .config import ModelConfig, hf_common
from .family import Family, GGUFArch
from .gguf import yarn_scaling
from .llama import PRESETS as LLAMA_PRESETS
from .llama import LlamaModel
from .moe import MoEConfig
from .quant_format import dequantize_mxfp4

log = logging.getLogger("jax_kvcached.models")


def gpt_oss_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """GPT-OSS from a config.json (``hidden_act`` names its clamped SwiGLU)."""
    moe = gpt_oss_moe(
        int(cfg["num_local_experts"]),
        int(cfg["num_experts_per_tok"]),
        int(cfg["intermediate_size"]),
        float(cfg.get("swiglu_limit", 7.0)),
    )
    return hf_common(cfg, attention_sinks=True, moe=moe)


def gpt_oss_moe(experts: int, top_k: int, width: int, limit: float = 7.0) -> MoEConfig:
    """GPT-OSS's experts: top-k of the router's biased logits with a softmax over those k
    (the renormalized softmax), the clamped SwiGLU, biases on the experts."""
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=width,
                     norm_topk_prob=True, activation="swiglu_oai", swiglu_limit=limit,
                     router_bias=True, expert_bias=True)  # fmt: skip


def split_gpt_oss_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's expert tensors (``mlp.router.{weight,bias}``; ``mlp.experts.gate_up_proj``
    ``(E, hidden, 2I)`` with gate and up interleaved by column, ``down_proj`` ``(E, I,
    hidden)``, and their ``_bias``) as the per-expert tensors :func:`expert_weights`
    names (in place; returns ``tensors``). MXFP4 experts (``*_blocks`` / ``*_scales``, as
    OpenAI's checkpoints hold them) are dequantized first (to float32; the loader casts
    them to the model dtype)."""
    for name in [n for n in tensors if n.endswith("_blocks") and ".mlp.experts." in n]:
        base = name[: -len("_blocks")]
        scales = tensors.pop(base + "_scales", None)
        if scales is None:
            raise ValueError(f"mxfp4 expert weight {name} has no {base}_scales")
        tensors[base] = dequantize_mxfp4(tensors.pop(name), scales)
    for name in [n for n in tensors if n.endswith("mlp.router.weight")]:
        base = name[: -len("router.weight")]
        tensors[base + "gate.weight"] = tensors.pop(name)
        if base + "router.bias" in tensors:
            tensors[base + "gate.bias"] = tensors.pop(base + "router.bias")
        ex = base + "experts."
        gu = tensors.pop(ex + "gate_up_proj", None)
        if gu is None:
            continue
        gu, down = np.asarray(gu), np.asarray(tensors.pop(ex + "down_proj"))
        gub = tensors.pop(ex + "gate_up_proj_bias", None)
        db = tensors.pop(ex + "down_proj_bias", None)
        for j in range(gu.shape[0]):
            tensors[f"{ex}{j}.gate_proj.weight"] = np.ascontiguousarray(gu[j][:, 0::2].T)
            tensors[f"{ex}{j}.up_proj.weight"] = np.ascontiguousarray(gu[j][:, 1::2].T)
            tensors[f"{ex}{j}.down_proj.weight"] = np.ascontiguousarray(down[j].T)
            if gub is not None:
                tensors[f"{ex}{j}.gate_proj.bias"] = np.asarray(gub[j][0::2])
                tensors[f"{ex}{j}.up_proj.bias"] = np.asarray(gub[j][1::2])
            if db is not None:
                tensors[f"{ex}{j}.down_proj.bias"] = np.asarray(db[j])
    return tensors


def prepare_tensors(tensors: dict[str, Any], path: str) -> None:
    """The router and fused interleaved experts (MXFP4 or not) as per-expert weights."""
    mxfp4 = any(k.endswith("_blocks") for k in tensors)
    split_gpt_oss_experts(tensors)
    if mxfp4:
        log.info("%s: MXFP4 experts dequantized to the model's dtype (the packed path holds "
                 "int8 / int4 only)", path)  # fmt: skip


def gpt_oss_fields(ck: Any) -> dict[str, Any]:
    """GPT-OSS: sinks, biases on every attention projection, sliding (even) and full
    (odd) layers, experts with biases and the clamped SwiGLU."""
    a = "gpt-oss"
    layers = int(ck.meta(f"{a}.block_count"))
    moe = gpt_oss_moe(int(ck.meta(f"{a}.expert_count")), int(ck.meta(f"{a}.expert_used_count")),
                      int(ck.meta(f"{a}.expert_feed_forward_length")))  # fmt: skip
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                  for i in range(layers))  # fmt: skip
    yarn = ck.meta(f"{a}.rope.scaling.type", None) == "yarn"
    return dict(moe=moe, attention_sinks=True, o_bias=True, layer_types=types,
                sliding_window=int(ck.meta(f"{a}.attention.sliding_window")),
                rope_scaling=yarn_scaling(ck, None, truncate=False) if yarn else None)  # fmt: skip


# GPT-OSS's shape in small: sliding (16 tokens) and full layers alternate, attention sinks
# and biases on every projection, YaRN, 8 experts (2 a token) with the clamped SwiGLU.
PRESETS = {
    "tiny-gpt-oss": dataclasses.replace(
        LLAMA_PRESETS["tiny-swa"], model_type="gpt_oss", intermediate_size=64, qkv_bias=True,
        o_bias=True, attention_sinks=True, rope_theta=150000.0, max_position_embeddings=1024,
        rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 8.0),
                      ("original_max_position_embeddings", 128), ("rope_type", "yarn"),
                      ("truncate", False)),
        moe=gpt_oss_moe(8, 2, 64),
    ),
}  # fmt: skip

FAMILY = registry.add(Family(
    name="gpt_oss", model=LlamaModel, model_types=("gpt_oss",), from_hf=gpt_oss_from_hf,
    gguf=(GGUFArch("gpt-oss", "gpt_oss", fields=gpt_oss_fields, yarn=True),),
    presets=PRESETS, prepare_tensors=prepare_tensors,
))  # fmt: skip
