"""Tokenizers: a checkpoint's own (``tokenizer.json`` or GGUF metadata, through the
``tokenizers`` package) or, for the built-in random models, byte-level."""

from __future__ import annotations

import json
import os
from typing import Any, Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS and 257 EOS."""

    bos_token_id = 256
    eos_token_id = 257
    special_tokens: dict[str, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Bytes, after BOS unless ``add_special_tokens`` is False (a rendered chat
        template brings its own special tokens)."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer``; special tokens in the text (``<|im_start|>``) stay
    whole, and decoding drops special tokens. ``add_special_tokens`` runs the tokenizer's
    post-processor (a ``tokenizer.json``'s BOS) and prepends BOS where a GGUF file asks
    for it (``add_bos``); a rendered chat template passes False, as transformers'
    ``apply_chat_template`` does."""

    def __init__(
        self,
        tok: Any,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos: bool = False,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.special_tokens = special_tokens or {}  # bos_token / eos_token strings

    @classmethod
    def from_tokenizer(cls, tok: Any, **kw: Any) -> HFTokenizer:
        return cls(tok, **kw)

    @classmethod
    def from_dir(cls, model_dir: str) -> HFTokenizer:
        """``tokenizer.json`` plus the special tokens of ``tokenizer_config.json``."""
        from tokenizers import Tokenizer as _Tok

        tok = _Tok.from_file(os.path.join(model_dir, "tokenizer.json"))
        cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        special = {k: _content(cfg.get(k)) for k in ("bos_token", "eos_token") if cfg.get(k)}
        ids = {k: tok.token_to_id(v) for k, v in special.items()}
        return cls(
            tok, bos_token_id=ids.get("bos_token"), eos_token_id=ids.get("eos_token"),
            special_tokens=special,  # BOS, if any, comes from the post-processor
        )  # fmt: skip

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return [self.bos_token_id, *ids] if self.add_bos and add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for grammar engines: llguidance)."""
        return self._tok.to_str()


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(v: Any) -> str:
    return v if isinstance(v, str) else (v or {}).get("content", "")
