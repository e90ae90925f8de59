"""OpenAI-compatible request parsing, error bodies and incremental detokenization."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.structured import Structured
from jax_kvcached.serve.structured_request import FieldError, structured_of
from jax_kvcached.serve.tools import Tools, ToolsError, parse_tools

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
    "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logprobs",
    "ignore_eos", "cache_salt", "logit_bias", "repetition_penalty", "min_tokens",
    "stop_token_ids",
    # accepted and ignored (they change nothing here): see _HARMLESS
    "metadata", "store", "service_tier",
    # function calling (serve/tools.py) and structured outputs (serve/structured_request.py)
    "parallel_tool_calls", "tools", "tool_choice", "response_format", "structured_outputs",
    # vLLM's extensions (https://docs.vllm.ai: "Extra parameters"): see _vllm_extras
    "include_stop_str_in_output", "add_special_tokens", "truncate_prompt_tokens", "request_id",
    "priority", "skip_special_tokens", "spaces_between_special_tokens",
}  # fmt: skip
# Field -> what it must be to be ignored safely (anything else is a 400).
_HARMLESS: dict[str, tuple[type, ...]] = {
    "metadata": (dict,),
    "store": (bool,),
    "service_tier": (str,),
    "parallel_tool_calls": (bool,),
}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                   "add_generation_prompt", "continue_final_message"}  # fmt: skip
_ROLES = ("system", "user", "assistant", "developer", "tool")


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


MAX_N = 16  # samples per prompt (n, best_of)
# What a request that omits a sampling field gets when the model has no default: OpenAI's.
SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
}  # fmt: skip
MAX_PROMPTS = 64  # prompts of one completions request


@dataclasses.dataclass
class GenerationRequest:
    model: str
    chat: bool
    prompts: list[str | list[int]] | None  # completions: one or a batch
    messages: list[dict[str, Any]] | None  # chat, content flattened to text
    max_tokens: int | None  # None: up to the model's length limit; 0: echo scoring only
    # None: the field was omitted: the served model's default applies (see sampling()).
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None  # None: a fresh random seed per request (reported in the response)
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str | None
    n: int = 1
    best_of: int = 1  # samples drawn per prompt; the n most likely are returned
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    echo: bool = False  # completions: the prompt (and its logprobs) comes first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's stream_options.continuous_usage_stats: running usage in every chunk (with
    # include_usage only, as vLLM does).
    continuous_usage: bool = False
    # vLLM's extensions
    include_stop: bool = False  # include_stop_str_in_output: the stop string stays
    add_special_tokens: bool = True  # (chat: False, the template brings them)
    truncate_prompt_tokens: int | None = None  # keep only a prompt's last k tokens
    request_id: str | None = None  # the response's id: cmpl-<request_id>
    add_generation_prompt: bool = True  # chat
    continue_final_message: bool = False  # chat: the last (assistant) message goes on
    # The output held to a schema, regex, choice or grammar (response_format,
    # structured_outputs); None: free text.
    structured: Structured | None = None
    structured_param: str = "response_format"  # the field that gave it
    tools: Tools | None = None  # chat: its tools and tool_choice (serve/tools.py)
    adapter: str | None = None  # the LoRA adapter ``model`` named (``model``: its base)

    def sampling(
        self, max_tokens: int, index: int = 0, defaults: dict[str, float] | None = None,
        reasoning_parser: str | None = None,
    ) -> SamplingParams:  # fmt: skip
        """The parameters of sample ``index`` of a prompt: seed ``seed + index`` (so
        sample i equals a single request with that seed). A field the request omitted
        takes the served model's ``defaults`` (its generation config, the operator's
        ``--default-*`` flags), else OpenAI's (temperature 1, top_p 1, no top_k). A chat
        request's constraint holds the answer after the thought where the model has a
        ``reasoning_parser``."""
        structured = self.structured
        if structured is not None and self.chat and reasoning_parser is not None:
            structured = dataclasses.replace(structured, reasoning=reasoning_parser)
        seed = None if self.seed is None else (self.seed + index) % (1 << 32)
        scoring = self.echo and self.logprobs is not None
        given = {k: getattr(self, k) for k in SAMPLING_DEFAULTS}
        pick = {
            k: v if v is not None else (defaults or {}).get(k, SAMPLING_DEFAULTS[k])
            for k, v in given.items()
        }
        return SamplingParams(
            max_tokens=max(max_tokens, 1),  # 0 (echo scoring): one token, dropped
            temperature=float(pick["temperature"]),
            top_p=float(pick["top_p"]),
            top_k=int(pick["top_k"]),
            seed=seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=float(pick["repetition_penalty"]),
            logit_bias=self.logit_bias,
            min_tokens=min(self.min_tokens, max(max_tokens, 1)),
            stop_token_ids=self.stop_token_ids,
            stop=tuple(self.stop),
            # best_of ranks the samples by their log-probability
            logprobs=0 if self.logprobs is None and self.best_of > self.n else self.logprobs,
            prompt_logprobs=scoring,
            structured=structured,
        ).seeded()


def _number(body: dict, key: str, default: float | None, lo: float, hi: float) -> float | None:
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


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
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


def _vllm_extras(body: dict, chat: bool) -> dict[str, Any]:
    """vLLM's extra request fields that make sense here; the rest stay a 400."""
    for key in ("skip_special_tokens", "spaces_between_special_tokens"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):  # (1 == True in Python: not a bool)
            raise _bad(f"'{key}' must be a boolean, got {v!r}", key)
        if v is False:
            raise _bad(f"'{key}': false is not supported by this server (special tokens "
                       "are always skipped in text)", key)  # fmt: skip
    prio = body.get("priority")
    if prio is not None and (type(prio) is not int or prio != 0):  # (False == 0: refused)
        raise _bad(f"'priority' must be the integer 0: requests are served first come, "
                   f"first served (got {prio!r})", "priority")  # fmt: skip
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= 128
                            or not rid.isprintable()):  # fmt: skip
        raise _bad("'request_id' must be a printable string of 1 to 128 characters",
                   "request_id")  # fmt: skip
    out = dict(
        include_stop=_flag(body, "include_stop_str_in_output"),
        # (vLLM's defaults: on for a completion's prompt, off for a rendered chat)
        add_special_tokens=_flag(body, "add_special_tokens", not chat),
        truncate_prompt_tokens=_int(body, "truncate_prompt_tokens", None, 1),
        request_id=rid,
    )
    if chat:
        gen = body.get("add_generation_prompt", True)
        if not isinstance(gen, bool):  # (null too: it has no "omitted" meaning here)
            raise _bad("'add_generation_prompt' must be a boolean", "add_generation_prompt")
        cont = _flag(body, "continue_final_message")
        if gen and cont:
            raise _bad("'continue_final_message' needs 'add_generation_prompt': false",
                       "continue_final_message")  # fmt: skip
        out.update(add_generation_prompt=gen, continue_final_message=cont)
    return out


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
    if "suffix" in body:
        _unsupported(body, "suffix", (None,))
    if not chat and body.get("tools") not in (None, []):
        raise _bad("'tools' are for /v1/chat/completions", "tools")
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
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise _bad(
            "'stream_options' supports only include_usage and continuous_usage_stats",
            "stream_options",
        )
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt.isprintable()):
        raise _bad("'cache_salt' must be a string of printable characters", "cache_salt")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("'user' must be a string", "user")
    max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    n = _int(body, "n", 1, 1, MAX_N)
    stream = _flag(body, "stream")
    if opts and not stream:  # (as OpenAI and vLLM answer)
        raise _bad("'stream_options' needs 'stream': true", "stream_options")
    echo = False if chat else _flag(body, "echo")
    if chat:
        top = _int(body, "top_logprobs", None, 0, 20)
        if top is not None and not _flag(body, "logprobs"):
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if _flag(body, "logprobs") else None
        best_of = n
    else:
        logprobs = _int(body, "logprobs", None, 0, 20)
        best_of = _int(body, "best_of", n, 1, MAX_N)
        if best_of < n:
            raise _bad(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
        if stream and best_of > n:
            raise _bad("'best_of' > 'n' cannot be streamed", "best_of")
    # max_tokens 0: only the echoed prompt (scoring with logprobs), as OpenAI allows.
    least = 0 if echo else 1
    return dict(
        model=model,
        chat=chat,
        max_tokens=_int(body, max_key, None if chat else 16, least),
        n=n,
        best_of=best_of,
        logprobs=logprobs,
        echo=echo,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", None, 1e-3, 100.0),
        logit_bias=_logit_bias(body),
        min_tokens=_int(body, "min_tokens", 0, 0),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        temperature=_number(body, "temperature", None, 0.0, 2.0),
        top_p=_number(body, "top_p", None, 1e-9, 1.0),
        top_k=_int(body, "top_k", None, 0) if body.get("top_k") != -1 else 0,
        seed=_seed(body),
        stop=stop,
        stream=stream,
        include_usage=_flag(opts, "include_usage"),
        continuous_usage=_flag(opts, "continuous_usage_stats") and _flag(opts, "include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
        cache_salt=salt,
        structured=_structured(body),
        structured_param="structured_outputs" if body.get("structured_outputs") is not None
        else "response_format",
        **_vllm_extras(body, chat),
    )


def _structured(body: dict) -> Structured | None:
    try:
        return structured_of(body)
    except FieldError as e:
        raise _bad(str(e), e.param) from None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` with biases in [-100, 100] (OpenAI's form)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > 1024:
        raise _bad("'logit_bias' must be an object of up to 1024 token ids", "logit_bias")
    out = []
    for k, b in v.items():
        # ASCII decimal ids only: str.isdigit() accepts other scripts' digits too
        if not (isinstance(k, str) and k.isascii() and k.isdigit()) or int(k) > INT32_MAX:
            raise _bad(f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad(f"'logit_bias' values must be in [-100, 100], got {b!r}", "logit_bias")
        out.append((int(k), float(b)))
    return tuple(out)


def _token_ids(body: dict, key: str) -> tuple[int, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > 256 or not all(is_token_id(t) for t in v):
        raise _bad(f"'{key}' must be a list of up to 256 token ids", key)
    return tuple(v)


def is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def parse_completion(body: Any) -> GenerationRequest:
    """Validates a ``/v1/completions`` body: one prompt (a string or token ids) or a
    batch (a list of strings or of token-id lists)."""
    common = _parse_common(body, chat=False)
    prompt = body.get("prompt")
    what = "'prompt' must be a non-empty string, a list of token ids, or a list of those"
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_token_id(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS:
        prompts = prompt
    else:
        raise _bad(f"{what} (at most {MAX_PROMPTS})", "prompt")
    for p in prompts:
        ids = isinstance(p, list) and p and all(is_token_id(t) for t in p)
        ok = (isinstance(p, str) and p) or ids
        if not ok:
            raise _bad(what, "prompt")
    return GenerationRequest(prompts=prompts, messages=None, **common)


def parse_chat(body: Any) -> GenerationRequest:
    """Validates a ``/v1/chat/completions`` body (text messages; tools)."""
    common = _parse_common(body, chat=True)
    try:
        tools = parse_tools(body)
    except ToolsError as e:
        raise _bad(str(e), e.param) from None
    forced = tools.constraint() if tools is not None else None
    if forced is not None:  # tool_choice required or a named function
        if common["structured"] is not None:
            raise _bad(f"tool_choice {tools.choice!r} cannot combine with "
                       f"'{common['structured_param']}'", "tool_choice")  # fmt: skip
        common.update(structured=forced, structured_param="tool_choice")
    messages = chat_messages(body.get("messages"))
    return GenerationRequest(prompts=None, messages=messages, tools=tools, **common)


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """Validated chat messages with their content flattened to text."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    flat: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] needs a 'role' among {list(_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise _bad(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if content is None and calls:  # an assistant turn of calls only
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}] needs a string 'content'", "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise _bad(f"messages[{i}]: a tool message needs its 'tool_call_id'", "messages")
            msg["tool_call_id"] = tid
        if calls is not None:
            msg["tool_calls"] = _message_calls(calls, i)
        flat.append(msg)
    return flat


def _message_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, their arguments as objects (the form chat
    templates read, as transformers gives them)."""
    what = f"messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', " \
           "'function': {'name', 'arguments'}}"
    if not isinstance(calls, list):
        raise _bad(what, "messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad(what, "messages")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise _bad(f"messages[{i}]: a tool call's arguments are not JSON",
                           "messages") from None  # fmt: skip
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})  # fmt: skip
    return out
