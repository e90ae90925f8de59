"""Flax NNX decoder models (Llama family, Qwen2), installed as ``jax_kvcached.models``."""

from .config import BUILTIN_CONFIGS, ModelConfig
from .gguf import GGUFCheckpoint, GGUFError
from .interface import Attend, CausalLM
from .llama import LlamaModel
from .loader import find_chat_template, load_checkpoint, load_tokenizer
from .pretrained import PRETRAINED, Pretrained, load_pretrained, pretrained_path
from .registry import abstract_model, build_model, model_class, register
from .sharding import shard_model
from .tokenizer import ByteTokenizer

__all__ = [
    "Attend",
    "CausalLM",
    "abstract_model",
    "model_class",
    "register",
    "shard_model",
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
