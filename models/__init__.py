"""Flax NNX decoder models (Llama family, Qwen2), installed as ``jax_kvcached.models``."""

from .config import BUILTIN_CONFIGS, ModelConfig
from .llama import LlamaModel, build_model
from .loader import load_checkpoint
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "BUILTIN_CONFIGS",
    "ByteTokenizer",
    "LlamaModel",
    "ModelConfig",
    "build_model",
    "load_checkpoint",
    "load_tokenizer",
]
