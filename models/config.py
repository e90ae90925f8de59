"""Model configuration, from a Hugging Face config.json or a built-in tiny preset."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from . import registry
from .gated_deltanet import LinearAttentionConfig, linear_from_hf
from .interface import RECURRENT
from .mamba2 import Mamba2Config, mamba2_from_hf
from .mla import MLAConfig, mla_from_hf, softmax_scale
from .moe import MoEConfig, gpt_oss_moe, moe_from_hf
from .rope import ROPE_TYPES


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3: factor, low/high freq...
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # the output projection's bias (attention_bias: Llama, GPT-OSS)
    # GPT-OSS: a learned logit per head in the softmax's denominator (attention sinks)
    attention_sinks: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Sliding-window attention: a query at p sees keys above p - sliding_window, on every
    # layer (Mistral) or on the layers ``layer_types`` marks "sliding_attention" (the
    # others "full_attention": Gemma, GPT-OSS).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3, Gemma 3)
    # Gemma 3: the query scale is query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5),
    # and sliding layers rotate with their own RoPE base (None: rope_theta).
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    # Mixture-of-experts feed-forward (models/moe.py) on every layer not in its
    # dense_layers; None: dense MLPs of intermediate_size everywhere.
    moe: MoEConfig | None = None
    # Multi-head latent attention (models/mla.py: DeepSeek-V2/V3): the KV cache holds one
    # latent per token and layer, so num_kv_heads is 1 and head_dim the latent's width.
    mla: MLAConfig | None = None
    # Qwen3-Next: Gated DeltaNet on the layers ``layer_types`` marks "linear_attention"
    # (models/gated_deltanet.py; recurrent state, no KV cache) and RoPE on the first
    # partial_rotary_factor of each head (its gated attention: models/qwen3_next.py).
    # Granite 4.0-H: Mamba2 on the "linear_attention" layers instead (models/mamba2.py).
    linear: LinearAttentionConfig | Mamba2Config | None = None
    partial_rotary_factor: float = 1.0
    # Granite's scalars: embeddings x embedding_multiplier, each sublayer's output x
    # residual_multiplier, logits / logits_scaling; rope False: no positional rotation.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rope: bool = True

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, f) <= 0:
                raise ValueError(f"model config: {f} must be positive")
        dense = self.moe.dense_layers if self.moe is not None else ()
        if any(not 0 <= i < self.num_layers for i in dense):
            raise ValueError(f"model config: moe dense_layers {self.moe.dense_layers} outside "
                             f"the {self.num_layers} layers")  # fmt: skip
        if self.mla is not None and (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim):
            raise ValueError("model config: a latent-attention model's cache has 1 KV head of "
                             f"the latent's width {self.mla.latent_dim}")  # fmt: skip
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model config: num_heads must be a multiple of num_kv_heads")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError("model config: sliding_window must be positive (or None)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"model config: {len(self.layer_types)} layer_types for "
                    f"{self.num_layers} layers"
                )
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ValueError(f"model config: layer_types {sorted(bad)} not in {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("model config: sliding_attention layers need a sliding_window")
            if ("linear_attention" in self.layer_types) != (self.linear is not None):
                raise ValueError("model config: linear_attention layers come with a linear "
                                 "attention config (and only with them)")  # fmt: skip
        elif self.linear is not None:
            raise ValueError("model config: a linear attention config needs layer_types")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError("model config: partial_rotary_factor must be in (0, 1]")

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window (0: full attention; ``RECURRENT``: a recurrent
        layer), the engine's KV cache groups and attention windows come from."""
        w = self.sliding_window or 0
        if self.layer_types is None:
            return (w,) * self.num_layers
        kinds = {"sliding_attention": w, "linear_attention": RECURRENT}
        return tuple(kinds.get(t, 0) for t in self.layer_types)

    @property
    def state_elems(self) -> int:
        """Values of one sequence's recurrent state per recurrent layer (0: none)."""
        return self.linear.state_elems if self.linear is not None else 0

    @property
    def rotary_dim(self) -> int:
        """Dimensions RoPE rotates per head (MLA: only its rotary part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_latent(self) -> bool:
        """Whether the KV cache holds a latent per token (one plane) instead of K and V."""
        return self.mla is not None

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type in ("gemma3_text", "gemma3"):
            return _gemma3_from_hf(cfg.get("text_config") or cfg)
        if model_type == "granitemoehybrid":
            return _granite_hybrid_from_hf(cfg)
        if model_type not in registry.supported():
            raise ValueError(
                f"unsupported model_type {model_type!r} ({', '.join(registry.supported())})"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes "rope_parameters" (theta inside); 4.x "rope_scaling".
        rope_params = dict(cfg.get("rope_parameters") or {})
        theta = rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope_params or cfg.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in (*ROPE_TYPES, None):
                raise ValueError(
                    f"unsupported rope_scaling type {kind!r} ({', '.join(ROPE_TYPES)})"
                )
            scaling = None if kind in ("default", None) else scaling
        eos = cfg.get("eos_token_id")
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None  # Qwen2 configs carry a window they do not use
        layer_types = cfg.get("layer_types")
        mla = mla_from_hf(cfg, scaling) if model_type in MLA_TYPES else None
        linear = linear_from_hf(cfg) if model_type in LINEAR_TYPES else None
        partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        if linear is not None and layer_types is None:
            every = int(cfg.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % every else "full_attention"
                           for i in range(cfg["num_hidden_layers"])]  # fmt: skip
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if mla else cfg.get("num_key_value_heads", heads),
            head_dim=mla.latent_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if model_type == "qwen2" else 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type not in ("qwen2", "mistral") and bool(cfg.get("attention_bias")),
            attention_sinks=model_type == "gpt_oss",
            qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_next"),
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            sliding_window=int(window) if window else None,
            layer_types=tuple(layer_types) if layer_types and (window or linear) else None,
            moe=moe_from_hf(cfg, model_type) if model_type in MOE_TYPES else None,
            mla=mla,
            linear=linear,
            partial_rotary_factor=float(partial),
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))


def _granite_hybrid_from_hf(cfg: dict[str, Any]) -> ModelConfig:
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
    rope_params = dict(cfg.get("rope_parameters") or {})
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
        rope_theta=float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
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


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
MOE_TYPES = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_next")
LINEAR_TYPES = ("qwen3_next",)
MLA_TYPES = ("deepseek_v2", "deepseek_v3")


def _gemma3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Gemma 3 (text) from its config.json (transformers 4.x or 5.x spelling)."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise ValueError(f"gemma3: {cap} is not supported")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3: hidden_activation {act!r} is not supported")
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    local = rope.get("sliding_attention", {}) if isinstance(rope, dict) else {}
    for params in (full, local, cfg.get("rope_scaling") or {}):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ValueError(f"gemma3: rope type {kind!r} is not supported yet")
    heads = cfg.get("num_attention_heads", 8)
    layers = cfg.get("num_hidden_layers", 26)
    eos = cfg.get("eos_token_id", 1)
    return ModelConfig(
        vocab_size=cfg.get("vocab_size", 262208),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", 4),
        head_dim=cfg.get("head_dim", 256),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        model_type="gemma3",
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        sliding_window=int(cfg.get("sliding_window", 4096)),
        layer_types=tuple(cfg.get("layer_types") or gemma3_layer_types(layers)),
        qk_norm=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
    )


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's attention per layer: every ``pattern``-th layer global, the rest local."""
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    )


# Tiny random-initialised presets for demos and tests (byte-level vocabulary).
BUILTIN_CONFIGS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_scaling=(
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 256),
            ("rope_type", "llama3"),
        ),
        tie_word_embeddings=True,
        model_type="llama",
        bos_token_id=256,
        eos_token_id=257,
    ),
    "tiny-qwen2": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=320,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        model_type="qwen2",
        bos_token_id=256,
        eos_token_id=257,
    ),
    # Mistral-style: one sliding window on every layer.
    "tiny-mistral": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        model_type="mistral",
        bos_token_id=256,
        eos_token_id=257,
        sliding_window=24,
    ),
    # GPT-OSS-style: sliding-window and full layers alternate.
    "tiny-swa": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        model_type="llama",
        bos_token_id=256,
        eos_token_id=257,
        sliding_window=16,
        layer_types=("sliding_attention", "full_attention") * 2,
    ),
    "tiny-qwen3": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        model_type="qwen3",
        bos_token_id=256,
        eos_token_id=257,
        qk_norm=True,
    ),
    # Gemma 3's shape in small: 5 local layers (window 16) to 1 global one.
    "tiny-gemma3": ModelConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        model_type="gemma3",
        bos_token_id=256,
        eos_token_id=257,
        sliding_window=16,
        layer_types=gemma3_layer_types(6),
        qk_norm=True,
        query_pre_attn_scalar=32.0,
        rope_local_theta=10000.0,
    ),
}

# Qwen3-MoE's shape in small: tiny-qwen3 with 8 experts, 2 a token, the first layer dense
# (mlp_only_layers), so both kinds of layer run.
BUILTIN_CONFIGS["tiny-qwen3-moe"] = dataclasses.replace(
    BUILTIN_CONFIGS["tiny-qwen3"], model_type="qwen3_moe", tie_word_embeddings=False,
    moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True,
                  dense_layers=(0,)),
)  # fmt: skip

# DeepSeek-V3's shape in small: latent attention (a 24 + 8 latent a token and layer, the
# query through a q_lora of 32), YaRN with mscale_all_dim, and sigmoid-routed experts in 2
# groups with a shared one, the first layer dense.
_DEEPSEEK_YARN = (("beta_fast", 32), ("beta_slow", 1), ("factor", 4.0), ("mscale", 1.0),
                  ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 256),
                  ("rope_type", "yarn"))  # fmt: skip
BUILTIN_CONFIGS["tiny-deepseek-v3"] = ModelConfig(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4,
    num_kv_heads=1, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope_scaling=_DEEPSEEK_YARN,
    model_type="deepseek_v3", bos_token_id=256, eos_token_id=257,
    moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, scoring="sigmoid",
                  norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                  score_bias=True, shared_intermediate_size=64, dense_layers=(0,)),
    mla=MLAConfig(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  q_lora_rank=32, softmax_scale=softmax_scale(24, dict(_DEEPSEEK_YARN))),
)  # fmt: skip

# DeepSeek-V2-Lite's form: the query through q_proj (no q_lora), softmax routing over all
# experts, two shared experts, plain RoPE.
BUILTIN_CONFIGS["tiny-deepseek-v2-lite"] = dataclasses.replace(
    BUILTIN_CONFIGS["tiny-deepseek-v3"], model_type="deepseek_v2", rope_scaling=None,
    moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, routed_scaling_factor=1.0,
                  shared_intermediate_size=128, dense_layers=(0,)),
    mla=MLAConfig(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
)  # fmt: skip

# GPT-OSS's shape in small: sliding (16 tokens) and full layers alternate, attention sinks
# and biases on every projection, YaRN, 8 experts (2 a token) with the clamped SwiGLU.
BUILTIN_CONFIGS["tiny-gpt-oss"] = dataclasses.replace(
    BUILTIN_CONFIGS["tiny-swa"], model_type="gpt_oss", intermediate_size=64, qkv_bias=True,
    o_bias=True, attention_sinks=True, rope_theta=150000.0, max_position_embeddings=1024,
    rope_scaling=(("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 8.0),
                  ("original_max_position_embeddings", 128), ("rope_type", "yarn"),
                  ("truncate", False)),
    moe=gpt_oss_moe(8, 2, 64),
)  # fmt: skip

# Qwen3-Next's shape in small: Gated DeltaNet (2 key heads, 4 value heads of 16) on 3 of
# every 4 layers, gated full attention with a partial RoPE on the 4th, and experts with
# a gated shared expert.
BUILTIN_CONFIGS["tiny-qwen3-next"] = ModelConfig(
    vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
    rms_norm_eps=1e-6, model_type="qwen3_next", bos_token_id=256, eos_token_id=257,
    qk_norm=True, partial_rotary_factor=0.25,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    linear=LinearAttentionConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16),
    moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=True,
                  shared_intermediate_size=64, shared_gate=True),
)  # fmt: skip

# Granite 4.0-H's shape in small: Mamba2 (8 heads of 16 in 2 groups, a 16-wide state) on
# 3 of 4 layers, attention without RoPE on the other, 4 experts beside a shared MLP and
# Granite's multipliers.
BUILTIN_CONFIGS["tiny-granite-4.0-h"] = ModelConfig(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
    model_type="granitemoehybrid", bos_token_id=256, eos_token_id=257,
    layer_types=("linear_attention",) * 2 + ("full_attention", "linear_attention"),
    query_pre_attn_scalar=16.0, embedding_multiplier=4.0, residual_multiplier=0.5,
    logits_scaling=2.0, rope=False,
    linear=Mamba2Config(num_heads=8, head_dim=16, num_groups=2, d_state=16),
    moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True,
                  shared_intermediate_size=96),
)  # fmt: skip
