"""Flax NNX decoder models (Llama family, Qwen2), installed as ``jax_kvcached.models``."""

from .config import BUILTIN_CONFIGS, ModelConfig
from .gguf import GGUFCheckpoint, GGUFError
from .llama import LlamaModel, build_model
from .loader import find_chat_template, load_checkpoint, load_tokenizer
from .pretrained import PRETRAINED, Pretrained, load_pretrained, pretrained_path
from .tokenizer import ByteTokenizer

__all__ = [
    "BUILTIN_CONFIGS",
    "ByteTokenizer",
    "GGUFCheckpoint",
    "GGUFError",
    "PRETRAINED",
    "Pretrained",
    "find_chat_template",
    "load_pretrained",
    "pretrained_path",
    "LlamaModel",
    "ModelConfig",
    "build_model",
    "load_checkpoint",
    "load_tokenizer",
]
