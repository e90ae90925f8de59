"""A structured output that applies after the model's thought: the constraint of a
thinking model's answer (vLLM's reasoning parsers with structured outputs).

A thinking model writes ``<think> ... </think>`` and then its answer. Held to a JSON
schema from its first token, it could not think; so a :class:`ThinkingGrammar` lets the
thought run free and holds only what follows ``</think>`` to the grammar. It reads the
output as the reasoning parsers read it (``serve/reasoning.py``):

* ``deepseek_r1``: the output is thought until ``</think>`` (the template opened it);
* ``qwen3``: a thought only when the output opens with ``<think>``: the first token is
  either the grammar's or ``<think>``'s (then the rest of ``<think>`` is forced).

The thought may not end the output (EOS is refused until ``</think>``: the answer is
owed), so a thought that outruns ``max_tokens`` ends with ``length``. ``</think>`` is
seen by its token ids (its own token in a thinking model's vocabulary) or in the text.
Every token is logged with the phase it was taken in, so drafted tokens roll back
across the end of the thought too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"

_OPEN, _OPENING, _THOUGHT, _ANSWER = "open", "opening", "thought", "answer"


class Matcher(Protocol):
    """What a :class:`ThinkingGrammar` needs of the answer's matcher (engine.structured's
    ``GrammarState``)."""

    words: int
    finished: bool
    error: str

    def mask(self) -> np.ndarray: ...
    def accept(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...


def _bit(mask: np.ndarray, token: int) -> None:
    mask[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))


class ThinkingGrammar:
    """A sequence's matcher behind its thought: the interface of
    ``GrammarState`` (mask, accept, rollback, finished, error)."""

    def __init__(
        self,
        grammar: Matcher,
        parser: str,
        start_ids: Sequence[int],
        end_ids: Sequence[int],
        eos_ids: Sequence[int],
        vocab_size: int,
        decode: Callable[[list[int]], str],
    ) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {parser!r}")
        if not start_ids or not end_ids:
            raise ValueError("the tokenizer encodes <think> or </think> as nothing")
        self._g = grammar
        self._start, self._end = list(start_ids), list(end_ids)
        self._decode = decode
        self._phase = _THOUGHT if parser == "deepseek_r1" else _OPEN
        self._opened = 0  # tokens of <think> written (phase "opening")
        self._tail: list[int] = []  # the thought's last tokens (to see </think>)
        self._text = ""  # the thought's last characters
        # per token taken: the state before it, and whether the grammar took it
        self._log: list[tuple[str, int, tuple[int, ...], str, bool]] = []
        words = grammar.words
        self._free = np.full(words, -1, np.int32)  # a thought: anything but EOS
        for t in eos_ids:
            self._free[t // 32] &= ~np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        spare = words * 32 - vocab_size  # (bits past the vocabulary stay clear)
        if spare:
            self._free[-1] &= np.int32(np.uint32((1 << (32 - spare)) - 1).view(np.int32))

    @property
    def thinking(self) -> bool:
        """The answer (and its constraint) has not begun."""
        return self._phase != _ANSWER

    def mask(self) -> np.ndarray:
        """The next token's bitmask (see ``GrammarState.mask``)."""
        if self._phase == _ANSWER:
            return self._g.mask()
        if self._phase == _THOUGHT:
            return self._free.copy()
        if self._phase == _OPENING:
            out = np.zeros_like(self._free)
            _bit(out, self._start[self._opened])
            return out
        out = self._g.mask()  # open: the grammar's first token, or <think>'s
        _bit(out, self._start[0])
        return out

    def accept(self, token: int) -> bool:
        """Takes a sampled token; False if neither the thought nor the grammar allows it."""
        before = (self._phase, self._opened, tuple(self._tail), self._text)
        took = False
        if self._phase == _OPEN and token == self._start[0]:
            self._phase, self._opened = _OPENING, 1
        elif self._phase == _OPEN:
            if not self._g.accept(token):
                return False
            self._phase, took = _ANSWER, True
        elif self._phase == _OPENING:
            if token != self._start[self._opened]:
                return False
            self._opened += 1
        elif self._phase == _THOUGHT:
            self._thought(token)
        else:
            if not self._g.accept(token):
                return False
            took = True
        if self._phase == _OPENING and self._opened == len(self._start):
            self._phase = _THOUGHT
        self._log.append((*before, took))
        return True

    def _thought(self, token: int) -> None:
        self._tail = (self._tail + [token])[-len(self._end) :]
        self._text = (self._text + self._decode([token]))[-4 * len(END) :]
        if self._tail == self._end or END in self._text:
            self._phase = _ANSWER

    def rollback(self, n: int) -> None:
        """Gives back the last ``n`` tokens taken, on either side of the thought's end."""
        if n > len(self._log):
            raise ValueError(f"the structured output cannot roll back {n} tokens: it "
                             f"took {len(self._log)}")  # fmt: skip
        if not n:
            return
        undone = self._log[-n:]
        del self._log[-n:]
        self._g.rollback(sum(1 for *_, took in undone if took))
        phase, opened, tail, text, _ = undone[0]
        self._phase, self._opened, self._tail, self._text = phase, opened, list(tail), text

    @property
    def finished(self) -> bool:
        """The answer's grammar is complete: nothing may follow."""
        return self._phase == _ANSWER and self._g.finished

    @property
    def error(self) -> str:
        return self._g.error
