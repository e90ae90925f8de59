"""IBM Granite 4.0-H (``granitemoehybrid``) in Flax NNX: Mamba2 layers (:mod:`.mamba2`,
recurrent state) and attention layers (no RoPE when ``position_embedding_type`` is
"nope"), each followed by a mixture of experts beside a shared SwiGLU MLP (or the MLP
alone).

Granite's scalars: the embeddings are multiplied by ``embedding_multiplier``, each
sublayer's output by ``residual_multiplier`` before its residual add, the attention
scores by ``attention_multiplier`` (instead of ``head_dim ** -0.5``: the config's
``query_pre_attn_scalar``) and the logits divided by ``logits_scaling``. The checkpoint's
fused tensors (``block_sparse_moe.input_linear`` / ``output_linear`` / ``router.layer``,
``shared_mlp.input_linear`` / ``output_linear``) are split per expert at load
(:func:`split_granite_tensors`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import registry
from .config import ModelConfig, hf_rope
from .family import Family, GGUFArch
from .gguf import GGUFError
from .hybrid import HybridDecoder
from .llama import MLP, Attention, RMSNorm, attention_weights
from .mamba2 import Mamba2Config, Mamba2Mixer, mamba2_from_hf, mamba2_weights
from .moe import MoE, MoEConfig


class GraniteHybridLayer(nnx.Module):
    """A mixer (Mamba2 when ``kind`` is True, else attention), then the feed-forward."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs, mamba: bool) -> None:
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.linear, eps, dtype, rngs) if mamba else None
        self.self_attn = None if mamba else Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        if cfg.moe is not None:
            shared = MLP(cfg, dtype, rngs, units=cfg.moe.shared_intermediate_size)
            self.mlp = MoE(cfg.hidden_size, cfg.moe, dtype, rngs, shared=shared)
        else:
            self.mlp = MLP(cfg, dtype, rngs)
        self.residual = cfg.residual_multiplier

    def __call__(self, x, positions, inv_freq, attend_layer, recur_layer, carry):
        y = self.input_layernorm(x)
        if self.mamba is not None:
            a, carry = self.mamba(y, recur_layer, carry)
        else:
            a, carry = self.self_attn(y, positions, inv_freq, attend_layer, carry)
        x = x + a * jnp.asarray(self.residual, x.dtype)
        f = self.mlp(self.post_attention_layernorm(x))
        return x + f * jnp.asarray(self.residual, x.dtype), carry


def _mixer_weights(layer: GraniteHybridLayer, p: str, i: int) -> dict[str, tuple]:
    if layer.mamba is not None:
        return mamba2_weights(layer.mamba, p + "mamba.", i)
    return attention_weights(layer.self_attn, p, i)


class GraniteHybridModel(HybridDecoder):
    """Granite 4.0-H (see the module docstring)."""

    mixer_weights = staticmethod(_mixer_weights)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> None:
        if cfg.linear is None or cfg.layer_types is None:
            raise ValueError("granitemoehybrid: a config with Mamba2 layers is needed")
        kinds = [t == "linear_attention" for t in cfg.layer_types]

        def make(mamba):
            return GraniteHybridLayer(cfg, dtype, rngs, mamba)

        super().__init__(cfg, dtype, rngs, kinds, make, RMSNorm)


def split_granite_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """Granite's fused feed-forward tensors as the per-expert names :func:`expert_weights`
    reads (in place; returns ``tensors``): ``block_sparse_moe.input_linear`` ``(E, 2I,
    H)`` (gate rows, then up), ``output_linear`` ``(E, H, I)``, ``router.layer``; the
    shared MLP's ``input_linear`` ``(2S, H)`` and ``output_linear`` as the shared
    experts' (with experts) or the layer's MLP (without)."""
    for name in [n for n in tensors if n.endswith(".shared_mlp.input_linear.weight")]:
        p = name[: -len("shared_mlp.input_linear.weight")]
        moe = p + "block_sparse_moe.input_linear.weight" in tensors
        where = p + ("mlp.shared_experts." if moe else "mlp.")
        gu = np.asarray(tensors.pop(name))
        half = gu.shape[0] // 2
        tensors[where + "gate_proj.weight"] = gu[:half]
        tensors[where + "up_proj.weight"] = gu[half:]
        tensors[where + "down_proj.weight"] = tensors.pop(p + "shared_mlp.output_linear.weight")
        if not moe:
            continue
        gu = np.asarray(tensors.pop(p + "block_sparse_moe.input_linear.weight"))
        down = np.asarray(tensors.pop(p + "block_sparse_moe.output_linear.weight"))
        inter = gu.shape[1] // 2
        for j in range(gu.shape[0]):
            q = f"{p}mlp.experts.{j}."
            tensors[q + "gate_proj.weight"] = gu[j, :inter]
            tensors[q + "up_proj.weight"] = gu[j, inter:]
            tensors[q + "down_proj.weight"] = down[j]
        tensors[p + "mlp.gate.weight"] = tensors.pop(p + "block_sparse_moe.router.layer.weight")
    return tensors


# -- the family: config.json and GGUF readers, checkpoint layout, preset ---------------


def granite_hybrid_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Granite 4.0-H: Mamba2 and attention layers (``layer_types`` "mamba" / "attention",
    or transformers' "linear_attention" / "full_attention"), experts beside a shared MLP
    (or the shared MLP alone), Granite's multipliers."""
    names = {"mamba": "linear_attention", "attention": "full_attention"}
    types = tuple(names.get(t, t) for t in cfg.get("layer_types") or cfg["layers_block_type"])
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"granitemoehybrid: hidden_act {cfg['hidden_act']!r} is not supported")
    pos = cfg.get("position_embedding_type") or "nope"
    if pos not in ("rope", "nope"):
        raise ValueError(f"granitemoehybrid: position_embedding_type {pos!r} is not supported")
    if cfg.get("attention_bias"):
        raise ValueError("granitemoehybrid: attention_bias is not supported")
    theta, scaling, _ = hf_rope(cfg)
    if scaling is not None:
        raise ValueError(f"granitemoehybrid: rope scaling {scaling} is not supported")
    experts = int(cfg.get("num_local_experts") or 0)
    shared = int(cfg["shared_intermediate_size"])
    moe = None
    if experts:
        moe = MoEConfig(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                        intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                        shared_intermediate_size=shared)  # fmt: skip
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=shared, num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        model_type="granitemoehybrid", bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos, layer_types=types,
        # the score scale attention_multiplier: as Gemma's query_pre_attn_scalar ** -0.5
        query_pre_attn_scalar=float(cfg.get("attention_multiplier", 1.0)) ** -2,
        moe=moe, linear=mamba2_from_hf(cfg),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)), rope=pos == "rope",
    )  # fmt: skip


def granitehybrid_fields(ck: Any) -> dict[str, Any]:
    """Granite 4.0-H as llama.cpp writes it (``granitehybrid``): Mamba2's shape under
    ``ssm.*`` (``time_step_rank`` the heads, ``inner_size`` their total width), the
    attention layers those with KV heads in the per-layer ``head_count_kv``, experts of
    ``feed_forward_length`` beside the shared MLP (or the MLP alone), Granite's scales,
    RoPE only when ``rope.scaling.finetuned`` says so (the converter's flag for it)."""
    a = "granitehybrid"
    kv = ck.meta(f"{a}.attention.head_count_kv")
    layers = int(ck.meta(f"{a}.block_count"))
    kv = [int(x) for x in (kv if isinstance(kv, (list, tuple, np.ndarray)) else [kv] * layers)]
    ssm = [i for i, n in enumerate(kv) if n == 0]
    if not ssm:
        raise GGUFError(f"{ck.path}: a {a} file without Mamba2 layers (head_count_kv {kv})")
    heads = int(ck.meta(f"{a}.ssm.time_step_rank"))
    names = ck.tensor_names
    mamba = Mamba2Config(
        num_heads=heads, head_dim=int(ck.meta(f"{a}.ssm.inner_size")) // heads,
        num_groups=int(ck.meta(f"{a}.ssm.group_count")),
        d_state=int(ck.meta(f"{a}.ssm.state_size")), d_conv=int(ck.meta(f"{a}.ssm.conv_kernel")),
        conv_bias=f"blk.{ssm[0]}.ssm_conv1d.bias" in names,
        proj_bias=f"blk.{ssm[0]}.ssm_in.bias" in names,
    )  # fmt: skip
    experts = int(ck.meta(f"{a}.expert_count", 0))
    shared = int(ck.meta(f"{a}.expert_shared_feed_forward_length"))
    moe = None
    if experts:
        moe = MoEConfig(num_experts=experts, top_k=int(ck.meta(f"{a}.expert_used_count")),
                        intermediate_size=int(ck.meta(f"{a}.feed_forward_length")),
                        norm_topk_prob=True, shared_intermediate_size=shared)  # fmt: skip
    scale = float(ck.meta(f"{a}.attention.scale", 1.0))
    return dict(
        model_type="granitemoehybrid", linear=mamba, moe=moe, num_kv_heads=max(kv),
        layer_types=tuple("linear_attention" if n == 0 else "full_attention" for n in kv),
        intermediate_size=shared, query_pre_attn_scalar=scale**-2,
        embedding_multiplier=float(ck.meta(f"{a}.embedding_scale", 1.0)),
        residual_multiplier=float(ck.meta(f"{a}.residual_scale", 1.0)),
        logits_scaling=float(ck.meta(f"{a}.logit_scale", 1.0)),
        rope=bool(ck.meta(f"{a}.rope.scaling.finetuned", False)),
        vocab_size=int(ck.tensor_dims("token_embd.weight")[0]),  # (the token list is padded)
    )  # fmt: skip


def granitehybrid_weight(hf: str, w: np.ndarray) -> np.ndarray:
    """A granitehybrid Mamba2 tensor back in Hugging Face's form: ``A`` = -exp(A_log)
    and ``D`` stored ``(heads, 1)``, the conv squeezed, the norm ``(groups, width)``."""
    if hf.endswith("mamba.A_log"):
        return np.log(-w.reshape(-1))
    if hf.endswith(("mamba.D", "mamba.norm.weight")):
        return w.reshape(-1)
    if hf.endswith("mamba.conv1d.weight"):
        return w.reshape(w.shape[0], 1, w.shape[-1])
    return w


# Mamba2's tensors under ssm_*.
_GGUF_NAMES = {
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_in.bias": "mamba.in_proj.bias",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_dt.bias": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm.weight": "mamba.norm.weight",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ssm_out.bias": "mamba.out_proj.bias",
}
# Granite 4.0-H's shape in small: Mamba2 (8 heads of 16 in 2 groups, a 16-wide state) on
# 3 of 4 layers, attention without RoPE on the other, 4 experts beside a shared MLP and
# Granite's multipliers.
PRESETS = {
    "tiny-granite-4.0-h": ModelConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
        model_type="granitemoehybrid", bos_token_id=256, eos_token_id=257,
        layer_types=("linear_attention",) * 2 + ("full_attention", "linear_attention"),
        query_pre_attn_scalar=16.0, embedding_multiplier=4.0, residual_multiplier=0.5,
        logits_scaling=2.0, rope=False,
        linear=Mamba2Config(num_heads=8, head_dim=16, num_groups=2, d_state=16),
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True,
                      shared_intermediate_size=96),
    ),
}  # fmt: skip

FAMILY = registry.add(Family(
    name="granitemoehybrid", model=GraniteHybridModel, model_types=("granitemoehybrid",),
    from_hf=granite_hybrid_from_hf,
    gguf=(GGUFArch("granitehybrid", "granitemoehybrid", fields=granitehybrid_fields,
                   layer_names=_GGUF_NAMES, weight=granitehybrid_weight, permuted=True),),
    presets=PRESETS, prepare_tensors=lambda tensors, path: split_granite_tensors(tensors),
))  # fmt: skip
