"""Model configuration: the fields every family shares, the sub-configs some carry, and
the config.json reading every family shares (each family reads the rest: :mod:`.family`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from . import registry
from .gated_deltanet import LinearAttentionConfig
from .interface import FULL, RECURRENT, KVSpec
from .mamba2 import Mamba2Config
from .mla import MLAConfig
from .moe import MoEConfig
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

    def layer_specs(self) -> tuple[KVSpec, ...]:
        """What each layer keeps per sequence (full attention, a sliding window, a
        recurrent state): the engine's KV cache groups and their managers come from it."""
        w = self.sliding_window or 0
        attention = KVSpec.sliding(w) if w else FULL
        if self.layer_types is None:
            return (attention,) * self.num_layers
        kinds = {"sliding_attention": attention, "linear_attention": RECURRENT}
        return tuple(kinds.get(t, FULL) for t in self.layer_types)

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens (0: all of them; a recurrent layer,
        which does not attend, 0)."""
        return tuple(s.window for s in self.layer_specs())

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
        """A config.json's model, read by the family its ``model_type`` names."""
        model_type = cfg.get("model_type", "llama")
        fam = registry.family(model_type)
        if fam.from_hf is None:
            raise ValueError(f"model_type {model_type!r} has a model class but no "
                             "config.json reader")  # fmt: skip
        return fam.from_hf(cfg)

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, dict[str, Any]]:
    """A config.json's RoPE: (theta, its scaling or None for plain RoPE, the other
    ``rope_parameters``). transformers >= 5 writes ``rope_parameters`` (theta inside),
    4.x ``rope_scaling``; an unknown scaling type fails naming it."""
    rope_params = dict(cfg.get("rope_parameters") or {})
    theta = float(rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(rope_params or cfg.get("rope_scaling") or {}) or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (*ROPE_TYPES, None):
            raise ValueError(f"unsupported rope_scaling type {kind!r} ({', '.join(ROPE_TYPES)})")
        scaling = None if kind in ("default", None) else scaling
    return theta, scaling, rope_params


def hf_common(cfg: dict[str, Any], **fields: Any) -> ModelConfig:
    """The fields every Llama-style config.json spells alike, with ``fields`` (a
    family's own) over them."""
    heads = cfg["num_attention_heads"]
    theta, scaling, _ = hf_rope(cfg)
    eos = cfg.get("eos_token_id")
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    bias = bool(cfg.get("attention_bias", False))
    common = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        model_type=cfg.get("model_type", "llama"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        sliding_window=int(window) if window else None,
        layer_types=tuple(layer_types) if layer_types and window else None,
    )
    return ModelConfig(**{**common, **fields})
