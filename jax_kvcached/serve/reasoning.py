"""Reasoning parsers: a thinking model's ``<think> ... </think>`` as the message's
``reasoning_content``, the rest as its ``content`` (vLLM's ``--reasoning-parser``).

``deepseek_r1``: the template opens the thought in the prompt, so the output is thought
until ``</think>`` (an output that never closes it is all thought). ``qwen3``: a thought
only when the output opens with ``<think>`` (Qwen3 with thinking off writes none). A
structured output of a chat request holds only the answer (engine.thinking).
"""

from __future__ import annotations

from jax_kvcached.engine.thinking import END, PARSERS, START

__all__ = ["END", "PARSERS", "START", "ReasoningStream", "split"]


def split(text: str, parser: str | None) -> tuple[str | None, str]:
    """(reasoning, content) of a finished output (reasoning None: none)."""
    if parser is None:
        return None, text
    body = text.lstrip()
    opened = body.startswith(START)
    if parser == "qwen3" and not opened:
        return None, text
    if opened:
        body = body[len(START) :]
    if END not in body:
        return body, ""
    thought, _, rest = body.partition(END)
    return thought, rest.lstrip("\n")


def _tail_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Splits a streamed output into ("reasoning", text) and ("content", text) pieces as
    they arrive, holding back only what may be the start of a tag."""

    def __init__(self, parser: str | None) -> None:
        self._parser = parser
        # "open": undecided (before any text, qwen3), "thought", "content"
        self._state = "content" if parser is None else "open"
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        if self._state == "open":
            body = self._buf.lstrip()
            if body.startswith(START):
                self._state, self._buf = "thought", body[len(START) :]
            elif START.startswith(body):
                return out  # (whitespace or a prefix of <think>: undecided)
            else:
                self._state = "thought" if self._parser == "deepseek_r1" else "content"
        if self._state == "thought":
            at = self._buf.find(END)
            if at < 0:
                keep = _tail_prefix(self._buf, END)
                thought, self._buf = self._buf[: len(self._buf) - keep], self._buf[
                    len(self._buf) - keep :]  # fmt: skip
                if thought:
                    out.append(("reasoning", thought))
                return out
            if at:
                out.append(("reasoning", self._buf[:at]))
            self._state, self._buf = "content", self._buf[at + len(END) :].lstrip("\n")
        if self._state == "content" and self._buf:
            out.append(("content", self._buf))
            self._buf = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is still held when the output ends."""
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        return [("reasoning" if self._state == "thought" else "content", rest)]
