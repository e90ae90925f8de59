"""Structured outputs: a request's output held to a JSON schema, any JSON object, a
regular expression, one of a list of strings or a Lark grammar, by llguidance.

A :class:`Structured` is the request's constraint (plain data: it travels in
:class:`~jax_kvcached.engine.sampling.SamplingParams`). A :class:`GrammarCompiler` (one
per engine, for its tokenizer) compiles it once into llguidance's grammar, validated
against the vocabulary, and caches it; a bad schema or grammar is a ValueError naming
the problem. Each constrained sequence holds a :class:`GrammarState` (llguidance's
matcher): before a step samples its next token, the input builder asks it for the
bitmask of the tokens the grammar allows (the sampler sets the others to -inf); the
output processor gives it each sampled token, and the sequence stops when the grammar
is complete. A constrained sequence's mask needs its previous token, so the engine
completes the step in flight before dispatching one with constrained rows.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_kvcached.engine.thinking import END, PARSERS, START, ThinkingGrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHE = 256  # compiled grammars kept per engine


@dataclasses.dataclass(frozen=True)
class Structured:
    """An output constraint. ``kind``: ``json`` (``value``: a JSON schema, as JSON
    text), ``json_object`` (any JSON object; no value), ``regex`` (a regular
    expression the whole output matches), ``choice`` (``value``: a JSON list of the
    strings allowed) or ``grammar`` (a Lark grammar in llguidance's dialect, or a GBNF
    one, converted)."""

    kind: str
    value: str = ""
    # JSON without whitespace between tokens (vLLM's ``disable_any_whitespace``).
    compact: bool = False
    # A thinking model's reasoning parser (``deepseek_r1`` or ``qwen3``): the constraint
    # holds the answer after ``</think>``, the thought runs free (engine.thinking).
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if self.reasoning not in (None, *PARSERS):
            raise ValueError(f"structured output reasoning must be one of {PARSERS} or None, "
                             f"got {self.reasoning!r}")  # fmt: skip
        if not isinstance(self.value, str) or (self.kind != "json_object" and not self.value):
            raise ValueError(f"a {self.kind!r} structured output needs its text")

    def grammar(self) -> str:
        """llguidance's grammar text of this constraint (ValueError naming a bad one)."""
        from llguidance import LLMatcher

        try:
            over = {"whitespace_flexible": False} if self.compact else None
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=over)
            if self.kind == "json":
                return LLMatcher.grammar_from_json_schema(json.loads(self.value), overrides=over)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                choices = json.loads(self.value)
                if not (isinstance(choices, list) and choices
                        and all(isinstance(c, str) and c for c in choices)):  # fmt: skip
                    raise ValueError("a choice needs a list of non-empty strings")
                alts = " | ".join(json.dumps(c) for c in choices)  # (Lark reads JSON strings)
                return LLMatcher.grammar_from_lark(f"start: {alts}")
            lark = self.value
            if "::=" in lark:  # GBNF (llama.cpp's, and vLLM's xgrammar's EBNF) to Lark
                from llguidance.gbnf_to_lark import gbnf_to_lark

                lark = gbnf_to_lark(lark)
            return LLMatcher.grammar_from_lark(lark)
        except ValueError:
            raise
        except Exception as e:  # llguidance's own errors
            raise ValueError(f"{self.kind}: {e}") from None


class GrammarState:
    """One sequence's matcher: the tokens allowed next, and the tokens it took."""

    def __init__(self, matcher: Any, words: int, eos_ids: Sequence[int] = ()) -> None:
        self._m = matcher
        self._words = words
        self._eos = list(eos_ids)

    @property
    def words(self) -> int:
        """int32 words of the bitmask."""
        return self._words

    def mask(self) -> np.ndarray:
        """The next token's bitmask ``(words,)`` int32: bit ``t % 32`` of word
        ``t // 32`` set for each token the grammar allows. A matcher that failed (a
        grammar past llguidance's limits) allows only EOS; its next token is then
        refused, and the request ends with the error (never a token the grammar did
        not allow)."""
        out = np.zeros(self._words, np.int32)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            out[:] = 0
            for t in self._eos:
                out[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        return out

    def accept(self, token: int) -> bool:
        """Takes a sampled token; False if the grammar refuses it (its mask did not
        allow it)."""
        return bool(self._m.consume_token(token))

    def rollback(self, n: int) -> None:
        """Gives back the last ``n`` tokens taken (drafted tokens a verification
        rejected)."""
        if n and not self._m.rollback(n):
            raise ValueError(f"the structured output cannot roll back {n} tokens: "
                             f"{self.error}")  # fmt: skip

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing may follow."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and vocabulary (thread-safe: a
    server compiles off its event loop), keeping the last ``_CACHE`` grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = list(eos_ids)
        self._lltok: Any = None
        self._cache: OrderedDict[Structured, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        """int32 words of one bitmask row."""
        return (self._vocab + 31) // 32

    def _ll_tokenizer(self) -> Any:
        if self._lltok is None:
            self._lltok = ll_tokenizer(self._tokenizer, self._vocab, self._eos)
        return self._lltok

    def compile(self, spec: Structured) -> str:
        """The validated grammar of ``spec`` (cached); ValueError naming the problem."""
        from llguidance import LLMatcher

        spec = dataclasses.replace(spec, reasoning=None)  # (the thought is not grammar)
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            lltok = self._ll_tokenizer()
        grammar = spec.grammar()
        err = LLMatcher.validate_grammar(grammar, lltok)
        if err:
            raise ValueError(f"{spec.kind}: {err}")
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return grammar

    def state(self, spec: Structured) -> GrammarState | ThinkingGrammar:
        """A fresh matcher of ``spec`` for one sequence (behind its thought where
        ``spec.reasoning`` names a parser)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), self.compile(spec))
        if matcher.is_error():
            raise ValueError(f"{spec.kind}: {matcher.get_error()}")
        state = GrammarState(matcher, self.words, self._eos)
        if spec.reasoning is None:
            return state
        enc = self._tokenizer.encode
        return ThinkingGrammar(state, spec.reasoning, enc(START, add_special_tokens=False),
                               enc(END, add_special_tokens=False), self._eos, self._vocab,
                               self._tokenizer.decode)  # fmt: skip


class _ByteVocabulary:
    """llguidance's view of the byte tokenizer: ids 0-255 are the bytes, the rest
    special (BOS, EOS and the unused ids up to the model's vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.bos_token_id = tokenizer.bos_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<|special_{i}|>".encode() for i in range(256, vocab_size)
        ]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer of a model's: a ``tokenizers`` one (by its JSON) or the
    byte tokenizer of the random presets; ValueError for anything else."""
    from llguidance import LLTokenizer, TokenizerWrapper

    from jax_kvcached.models.tokenizer import ByteTokenizer

    eos = list(eos_ids) or None
    if isinstance(tokenizer, ByteTokenizer):
        wrapped = TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size))
        return LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=eos)
    to_json = getattr(tokenizer, "to_json", None)
    if to_json is None:
        raise ValueError("structured outputs need the model's tokenizer (a tokenizer.json "
                         "or GGUF one, or the byte tokenizer)")  # fmt: skip
    return LLTokenizer(to_json(), n_vocab=vocab_size, eos_token=eos)
