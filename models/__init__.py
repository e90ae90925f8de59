"""Flax NNX decoder models, installed as ``jax_kvcached.models``, with their checkpoint
loaders, tokenizers and chat templates. Each model family is one module (:mod:`.family`)."""

# The model families register themselves on import: adding one is its module and its
# name on this line.
from . import deepseek, gemma3, gpt_oss, granite_hybrid, llama, qwen3_next  # noqa: F401
from .chat_template import ChatTemplate, TemplateError
from .config import ModelConfig
from .download import ModelNotDownloaded, fetch, model_cache_dir
from .gemma3 import Gemma3Model
from .gguf import GGUFCheckpoint, GGUFError
from .granite_hybrid import GraniteHybridModel
from .interface import Attend, CausalLM
from .llama import LlamaModel
from .loader import CheckpointError, find_chat_template, load_checkpoint, load_tokenizer
from .pretrained import (
    PRETRAINED,
    Pretrained,
    check_source,
    default_dtype,
    generation_config,
    load_pretrained,
    pretrained_path,
    weights_dtype,
)
from .qwen3_next import Qwen3NextModel
from .registry import abstract_model, build_model, model_class, presets, register
from .sharding import shard_model
from .tokenizer import ByteTokenizer

# Every family's tiny random presets, by name.
BUILTIN_CONFIGS = presets()

__all__ = [
    "ChatTemplate",
    "check_source",
    "ModelNotDownloaded",
    "TemplateError",
    "default_dtype",
    "fetch",
    "generation_config",
    "model_cache_dir",
    "weights_dtype",
    "Attend",
    "CausalLM",
    "abstract_model",
    "model_class",
    "register",
    "shard_model",
    "BUILTIN_CONFIGS",
    "ByteTokenizer",
    "GGUFCheckpoint",
    "CheckpointError",
    "GGUFError",
    "Gemma3Model",
    "PRETRAINED",
    "Pretrained",
    "find_chat_template",
    "load_pretrained",
    "pretrained_path",
    "GraniteHybridModel",
    "LlamaModel",
    "Qwen3NextModel",
    "ModelConfig",
    "build_model",
    "load_checkpoint",
    "load_tokenizer",
]
