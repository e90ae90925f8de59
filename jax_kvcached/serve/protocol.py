"""OpenAI-compatible request parsing, error bodies and incremental detokenization."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax_kvcached.engine.sampling import SamplingParams

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logprobs",
    "ignore_eos", "cache_salt",
    # accepted and ignored (they change nothing here): see _HARMLESS
    "metadata", "store", "service_tier", "parallel_tool_calls", "tools", "tool_choice",
    "response_format",
}  # fmt: skip
# Field -> what it must be to be ignored safely (anything else is a 400).
_HARMLESS: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),
    "store": (bool,),
    "service_tier": (str,),
    "parallel_tool_calls": (bool,),
}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
_ROLES = ("system", "user", "assistant", "developer")


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code,
        )  # fmt: skip

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclasses.dataclass
class GenerationRequest:
    model: str
    chat: bool
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat, content flattened to text
    max_tokens: int | None  # None: up to the model's length limit
    temperature: float
    top_p: float
    top_k: int
    seed: int | None  # None: a fresh random seed per request (reported in the response)
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str | None

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        ).seeded()


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


INT32_MAX = (1 << 31) - 1


def _int(body: dict, key: str, default: int | None, lo: int, hi: int = INT32_MAX) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        shown = v if not isinstance(v, int) or abs(v) < 10**30 else f"{str(v)[:12]}..."
        raise _bad(f"'{key}' must be an integer in [{lo}, {hi}], got {shown!r}", key)
    return v


def _seed(body: dict) -> int | None:
    """The request's seed (a signed or unsigned 64-bit integer) folded to 32 bits; None
    when it gives none."""
    if body.get("seed") is None:
        return None
    v = _int(body, "seed", 0, -(1 << 63), (1 << 64) - 1)
    return v % (1 << 32)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be a boolean, got {v!r}", key)
    return v


def _unsupported(body: dict, key: str, allowed: tuple) -> None:
    if body.get(key) not in allowed:
        raise _bad(f"'{key}'={body[key]!r} is not supported by this server", key)


def _check_ignored(body: dict) -> None:
    """Fields clients send by default that change nothing here are accepted (and
    ignored) when well-formed; ones that would change the output are refused."""
    for key, types in _HARMLESS.items():
        v = body.get(key)
        if v is not None and (not isinstance(v, types) or (types == (str,) and not v)):
            raise _bad(f"'{key}' must be a {types[0].__name__}, got {v!r}", key)
    if body.get("tools") not in (None, []):
        raise _bad("'tools' (function calling) is not supported by this server", "tools")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("'tool_choice' must be 'none' or 'auto' (no tools are supported)", "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("json_object", "json_schema"):
            raise _bad(
                f"response_format {kind!r} (constrained decoding) is not supported yet; "
                "use {'type': 'text'}",
                "response_format",
            )
        if kind != "text" or set(fmt) != {"type"}:
            raise _bad("'response_format' must be {'type': 'text'}", "response_format")


def _parse_common(body: Any, chat: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    allowed = _CHAT if chat else _COMPLETION
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    for key, ok in (
        ("n", (None, 1)),
        ("presence_penalty", (None, 0, 0.0)),
        ("frequency_penalty", (None, 0, 0.0)),
        ("logprobs", (None, False) if chat else (None,)),
        ("top_logprobs", (None, 0)),
        ("echo", (None, False)),
        ("best_of", (None, 1)),
        ("suffix", (None,)),
    ):
        if key in body:
            _unsupported(body, key, ok)
    _check_ignored(body)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > 4
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise _bad("'stream_options' supports only include_usage", "stream_options")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad("'cache_salt' must be a string", "cache_salt")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("'user' must be a string", "user")
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    return dict(
        model=model,
        chat=chat,
        max_tokens=_int(body, max_key, None if chat else 16, 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_int(body, "top_k", 0, 0) if body.get("top_k") != -1 else 0,
        seed=_seed(body),
        stop=stop,
        stream=_flag(body, "stream"),
        include_usage=bool(opts.get("include_usage", False)),
        ignore_eos=_flag(body, "ignore_eos"),
        cache_salt=salt,
    )


def parse_completion(body: Any) -> GenerationRequest:
    """Validates a ``/v1/completions`` body (one prompt: a string or token ids)."""
    common = _parse_common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad("'prompt' must be a string or a list of token ids (one prompt)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    return GenerationRequest(prompt=prompt, messages=None, **common)


def parse_chat(body: Any) -> GenerationRequest:
    """Validates a ``/v1/chat/completions`` body (text messages)."""
    common = _parse_common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] needs a 'role' among {list(_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}] needs a string 'content'", "messages")
        flat.append({"role": m["role"], "content": content})
    return GenerationRequest(prompt=None, messages=flat, **common)


class TextStream:
    """Turns generated token ids into text deltas, incrementally.

    Each token decodes only a short window of recent ids (from the last emitted point),
    so a long output costs O(tokens), not O(tokens^2). A token whose text ends in an
    incomplete character (U+FFFD) is held back, but at most ``max_hold_tokens`` tokens:
    invalid bytes are then released as U+FFFD instead of stalling the stream. Text that
    may be the start of a stop string is held back until it can be decided.
    """

    def __init__(
        self, decode: Callable[[list[int]], str], stop: list[str], max_hold_tokens: int = 6
    ) -> None:
        self._decode = decode
        self.stop = stop
        self.max_hold_tokens = max_hold_tokens
        self.ids: list[int] = []
        self.text = ""  # the text so far (cut at a stop string once one appears)
        self.sent = 0  # characters already returned
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] give context for decoding the next ids
        self._read = 0  # ids whose text is in self.text
        self._longest_stop = max((len(x) for x in stop), default=0)

    def _decode_new(self) -> str | None:
        """Text of the ids after ``_read``, or None while it is an incomplete character."""
        before = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        held = len(self.ids) - self._read
        if full.endswith("\ufffd") and held < self.max_hold_tokens:
            return None
        if not full.startswith(before):  # the context changed its own text: rare
            new = self._decode(self.ids[self._read :])
        else:
            new = full[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return new

    def feed(self, token: int) -> str:
        """The text that is final after ``token`` (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        new = self._decode_new()
        if not new:
            return ""
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new
        hits = [i for i in (self.text.find(x, start) for x in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        end = len(self.text)
        if not self.stopped:
            hold = 0  # the longest end that may be the start of a stop string
            for x in self.stop:
                for k in range(min(len(x) - 1, end - self.sent), hold, -1):
                    if self.text[end - k : end] == x[:k]:
                        hold = k
                        break
            end -= hold
        delta, self.sent = self.text[self.sent : end], max(self.sent, end)
        return delta

    def flush(self) -> str:
        """What is left at the end of the request (held ids decoded as they are)."""
        if not self.stopped and self._read < len(self.ids):
            self.text += self._decode(self.ids[self._read :])
            self._read = len(self.ids)
            hits = [i for i in (self.text.find(x, self.sent) for x in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
