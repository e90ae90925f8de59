"""A chat choice's output as OpenAI's message: ``reasoning_content`` (the server's
reasoning parser), ``content`` and ``tool_calls`` (the request's tools and the server's
tool-call parser), whole or as stream deltas; ``finish_reason`` ``tool_calls`` when the
output was calls."""

from __future__ import annotations

from typing import Any

from jax_kvcached.serve import reasoning
from jax_kvcached.serve.tools import Tools, holds_from, read_calls


def message(text: str, tools: Tools | None, tool_parser: str | None,
            reasoning_parser: str | None) -> dict[str, Any]:  # fmt: skip
    """The assistant message of a finished output."""
    thought, content = reasoning.split(text, reasoning_parser)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thought is not None:
        msg["reasoning_content"] = thought
    if tools is not None and tools.choice != "none":
        msg["content"], calls = read_calls(content, tools, tool_parser)
        if calls:
            msg["tool_calls"] = calls
    return msg


def finish_reason(reason: str | None, calls: list[dict[str, Any]] | None) -> str | None:
    """``tool_calls`` for an output that stopped as calls."""
    return "tool_calls" if calls and reason == "stop" else reason


class ChatStream:
    """One streamed choice: text in, delta dicts out. Thought streams as
    ``reasoning_content``; content streams until it may be a tool call, which is held
    and sent whole, as ``tool_calls``, when the output ends."""

    def __init__(self, tools: Tools | None, tool_parser: str | None,
                 reasoning_parser: str | None) -> None:  # fmt: skip
        self._tools, self._parser = tools, tool_parser
        self._thought = reasoning.ReasoningStream(reasoning_parser)
        self._content = ""  # all content so far
        self._sent = 0  # content sent as deltas (the rest may be a call: held)
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._thought.feed(text))

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": piece})
                continue
            self._content += piece
            h = holds_from(self._content, self._tools, self._parser)
            if h > self._sent:
                out.append({"content": self._content[self._sent : h]})
                self._sent = h
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The last deltas: held thought or content, and the calls."""
        out = self._deltas(self._thought.flush())
        rest = self._content[self._sent :]
        self._sent = len(self._content)
        if self._tools is not None and self._tools.choice != "none" and rest:
            content, self.calls = read_calls(rest, self._tools, self._parser)
            if self.calls:
                if content:
                    out.append({"content": content})
                for i, c in enumerate(self.calls):  # as OpenAI streams them: the call,
                    f = c["function"]  # then its arguments
                    out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                "function": {"name": f["name"],
                                                             "arguments": ""}}]})
                    out.append({"tool_calls": [{"index": i, "function": {
                        "arguments": f["arguments"]}}]})  # fmt: skip
                return out
        if rest:
            out.append({"content": rest})
        return out
