"""Tokenizers: tokenizer.json through `tokenizers` when present, else byte-level."""

from __future__ import annotations

import os
from typing import Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS and 257 EOS."""

    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(path)
        self.bos_token_id = None
        self.eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(model_dir: str | None) -> Tokenizer:
    """The checkpoint's tokenizer.json when it and `tokenizers` exist, else bytes."""
    if model_dir:
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.exists(path):
            try:
                return HFTokenizer(path)
            except ImportError:
                pass
    return ByteTokenizer()
