"""Function calling in chat: a request's ``tools`` and ``tool_choice``, the constraint
that forces a call, and the calls read back out of the model's text.

* ``tool_choice`` ``none``: the tools reach the chat template only.
* ``required`` or a named function: the output is held (structured outputs) to a JSON
  array of ``{"name", "parameters"}`` calls (vLLM's form) or to the named function's
  parameters (compact JSON; an object that does not say ``additionalProperties`` takes
  only its properties), and becomes ``tool_calls``.
* ``auto``: the model decides, and the server's ``--tool-call-parser`` reads its calls
  out of the text, like vLLM's ``--enable-auto-tool-choice``:
  ``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks, as Hermes, Qwen
  2.5 / 3 and many others write them; ``llama3_json``: a JSON object ``{"name",
  "parameters"}`` as the whole output, or several separated by ``;``; ``mistral``:
  ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``, or, from Mistral's v11
  tokenizers on, ``[TOOL_CALLS]name[ARGS]{...}`` per call (the markers may be skipped as
  special tokens).
* A call the parser cannot read stays text (``content``), as in vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from jax_kvcached.engine.structured import Structured

PARSERS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
HERMES_START = "<tool_call>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


class ToolsError(ValueError):
    """A malformed ``tools`` / ``tool_choice`` (the request's 400 names ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Tools:
    """A chat request's tools: the list as given (for the template), the choice
    (``none``, ``auto``, ``required`` or ``function``: ``name``) and whether several
    calls may come at once."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def constraint(self) -> Structured | None:
        """The structured output that forces a call (None: ``auto`` / ``none``)."""
        if self.choice == "function":
            params = _closed(self.function(self.name).get("parameters") or {"type": "object"})
            return Structured("json", json.dumps(params), compact=True)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {
                      "name": {"enum": [t["function"]["name"]]},
                      "parameters": _closed(t["function"].get("parameters")
                                            or {"type": "object"})},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in self.tools]  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Structured("json", json.dumps(schema), compact=True)


def _closed(schema: Any) -> Any:
    """A function's parameters as the arguments it takes: an object schema that does not
    say ``additionalProperties`` takes only its ``properties`` (as OpenAI's strict tools,
    and vLLM's default xgrammar backend, read it); the rest as given."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: _closed(v) for name, v in schema[k].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then",
               "else", "additionalProperties", "contains")  # fmt: skip


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body (None: no
    tools); ToolsError naming the field for a malformed one."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ToolsError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolsError(f"'tools' must be a list of up to {MAX_TOOLS} tools", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ToolsError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                             "tools")  # fmt: skip
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolsError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . -",
                             "tools")  # fmt: skip
        if not isinstance(f.get("parameters", {}), dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object",
                             "tools")  # fmt: skip
        if not isinstance(f.get("description", ""), str):
            raise ToolsError(f"tools[{i}].function.description must be a string", "tools")
        names.append(name)
    if len(set(names)) != len(names):
        raise ToolsError("'tools' names a function twice", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolsError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(tuple(tools), choice or "auto", parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and named in names):
        raise ToolsError("'tool_choice' must be none, auto, required or {'type': 'function', "
                         "'function': {'name': <one of the tools>}}", "tool_choice")  # fmt: skip
    return Tools(tuple(tools), "function", named, parallel)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": args}}  # fmt: skip


def read_calls(
    text: str, tools: Tools, parser: str | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """(the message's content, its tool calls) of a finished output."""
    names = {t["function"]["name"] for t in tools.tools}
    if tools.choice == "function":
        return None, [_call(tools.name, text)]
    if tools.choice == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["parameters"]) for c in calls]
        except (ValueError, TypeError, KeyError):  # (cut by max_tokens: left as text)
            return text, []
    if tools.choice != "auto" or parser is None:
        return text, []
    try:  # each parser's calls, as parsed JSON: any unreadable, all stays text
        if parser == "hermes":  # <tool_call>{"name", "arguments"}</tool_call> blocks
            calls = _known_calls([json.loads(b) for b in _HERMES.findall(text)], names,
                                 "arguments")  # fmt: skip
            rest = _HERMES.sub("", text).strip()
            return ((rest or None), calls) if calls else (text, [])
        body = text.strip()
        if parser == "mistral" and not body.startswith(("[{", "[TOOL_CALLS] [", "[TOOL_CALLS][")):
            return _mistral_v11(text, names)
        if parser == "mistral":  # [TOOL_CALLS] [{"name", "arguments"}, ...]
            calls = _known_calls(json.loads(body.removeprefix("[TOOL_CALLS]").strip()),
                                 names, "arguments")  # fmt: skip
        else:  # llama3_json: the whole output one call, or several separated by ";"
            body = body.removeprefix("<|python_tag|>")
            if not body.startswith("{"):
                return text, []
            calls = _known_calls([json.loads(p) for p in body.split(";")], names,
                                 "parameters", "arguments")  # fmt: skip
    except ValueError:
        return text, []
    return (None, calls) if calls else (text, [])


def _mistral_v11(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Mistral's tokenizer v11+ form: ``[TOOL_CALLS]name[ARGS]{...}`` per call (a
    ``[CALL_ID]id`` may follow the name), after any content; with the markers skipped as
    special tokens, ``name{...}`` calls of the request's functions make the whole output."""
    if _MISTRAL_CALLS not in text:
        return _mistral_bare(text, names)
    head, *pieces = text.split(_MISTRAL_CALLS)
    objs = []
    for piece in pieces:
        name, sep, args = piece.partition(_MISTRAL_ARGS)
        if not sep:
            return text, []
        objs.append({"name": name.partition("[CALL_ID]")[0].strip(),
                     "arguments": json.loads(args)})  # fmt: skip
    calls = _known_calls(objs, names, "arguments")
    return ((head.strip() or None), calls) if calls else (text, [])


def _mistral_bare(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    body, at, objs = text.strip(), 0, []
    decoder = json.JSONDecoder()
    while at < len(body):
        m = _NAME.match(body, at)
        if m is None or m.group() not in names or not body.startswith("{", m.end()):
            return text, []
        args, at = decoder.raw_decode(body, m.end())
        objs.append({"name": m.group(), "arguments": args})
        while at < len(body) and body[at].isspace():
            at += 1
    calls = _known_calls(objs, names, "arguments")
    return (None, calls) if calls else (text, [])


def _known_calls(objs: Any, names: set[str], *arg_keys: str) -> list[dict[str, Any]]:
    """The tool calls of parsed JSON objects ``{"name", <the first of arg_keys>}``; none
    (the output stays text) unless every one names a function of the request."""
    if not isinstance(objs, list):
        return []
    calls = []
    for c in objs:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or (
            c["name"] not in names
        ):
            return []
        calls.append(_call(c["name"], next((c[k] for k in arg_keys if k in c), {})))
    return calls


def holds_from(text: str, tools: Tools | None, parser: str | None) -> int:
    """Where a streamed output's text stops being content and may be a call (held back
    until the output ends); ``len(text)`` when none of it may."""
    if tools is None or tools.choice == "none":
        return len(text)
    if tools.choice in ("required", "function"):
        return 0
    stripped = text.lstrip()
    if parser in ("llama3_json", "mistral") and (not stripped or stripped[0] in "{<["):
        return 0  # a call is the whole output
    if parser == "mistral":  # a bare name{...} call, or content then [TOOL_CALLS]
        names = [t["function"]["name"] for t in tools.tools]
        head = _NAME.match(stripped)
        if head is not None:
            name, rest = head.group(), stripped[head.end() :]
            if (name in names and rest[:1] == "{") or (
                not rest and any(n.startswith(name) for n in names)
            ):  # fmt: skip
                return 0
        return _held_at(text, _MISTRAL_CALLS)
    if parser == "hermes":
        return _held_at(text, HERMES_START)
    return len(text)


def _held_at(text: str, tag: str) -> int:
    """Where ``tag`` begins in ``text``, or a prefix of it at the end (else the end)."""
    at = text.find(tag)
    if at >= 0:
        return at
    for k in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)
