"""A request's structured-output fields, as OpenAI and vLLM spell them, read into one
:class:`~jax_kvcached.engine.structured.Structured` (or None: free text).

* OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
  "description"?}}``.
* vLLM's ``structured_outputs``: one of ``json`` (a schema, as an object or JSON text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, llguidance's dialect, or
  GBNF) or ``json_object``, with ``disable_any_whitespace``.

Malformed fields are a :class:`FieldError` (a 400 naming them); whether a schema or
grammar compiles is checked by the model's compiler (the route's 400 names the problem).
"""

from __future__ import annotations

import json
from typing import Any

from jax_kvcached.engine.structured import Structured

_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace",)


class FieldError(ValueError):
    """A malformed structured-output field (the request's 400 names ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _bad(message: str, param: str) -> FieldError:
    return FieldError(message, param)


def structured_of(body: dict[str, Any]) -> Structured | None:
    """The request's output constraint (None: free text); a 400 for a malformed one,
    or for both fields at once."""
    fmt = _response_format(body.get("response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    if fmt is not None and so is not None:
        raise _bad("give 'response_format' or 'structured_outputs', not both",
                   "structured_outputs")  # fmt: skip
    return fmt or so


def _response_format(fmt: Any) -> Structured | None:
    p = "response_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("'response_format' must be an object with a 'type'", p)
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return Structured("json_object")
    if kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
        js = fmt["json_schema"]
        if not isinstance(js, dict) or set(js) - {"name", "schema", "strict", "description"}:
            raise _bad("'response_format.json_schema' takes name, schema, strict and "
                       "description", p)  # fmt: skip
        name, schema = js.get("name"), js.get("schema")
        if not isinstance(name, str) or not name:
            raise _bad("'response_format.json_schema.name' must be a non-empty string", p)
        if not isinstance(schema, dict):
            raise _bad("'response_format.json_schema.schema' must be a JSON schema object", p)
        if not isinstance(js.get("strict", False), (bool, type(None))):
            raise _bad("'response_format.json_schema.strict' must be a boolean", p)
        return Structured("json", json.dumps(schema))
    raise _bad("'response_format' must be {'type': 'text'}, {'type': 'json_object'} or "
               "{'type': 'json_schema', 'json_schema': {...}}", p)  # fmt: skip


def _structured_outputs(so: Any) -> Structured | None:
    p = "structured_outputs"
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("'structured_outputs' must be an object", p)
    unknown = sorted(set(so) - set(_SO_KINDS) - set(_SO_OPTIONS))
    if unknown:
        raise _bad(f"'structured_outputs.{unknown[0]}' is not supported (one of "
                   f"{', '.join(_SO_KINDS)}; option {', '.join(_SO_OPTIONS)})", p)  # fmt: skip
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise _bad(f"'structured_outputs' needs exactly one of {', '.join(_SO_KINDS)}", p)
    compact = so.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise _bad("'structured_outputs.disable_any_whitespace' must be a boolean", p)
    kind, v = given[0], so[given[0]]
    if kind == "json_object":
        if v is not True:
            raise _bad("'structured_outputs.json_object' must be true", p)
        return Structured("json_object", compact=compact)
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise _bad(f"'structured_outputs.json' is not JSON: {e}", p) from None
        if not isinstance(v, dict):
            raise _bad("'structured_outputs.json' must be a JSON schema object", p)
        return Structured("json", json.dumps(v), compact=compact)
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise _bad("'structured_outputs.choice' must be a list of non-empty strings", p)
        return Structured("choice", json.dumps(v))
    if not isinstance(v, str) or not v:
        raise _bad(f"'structured_outputs.{kind}' must be a non-empty string", p)
    return Structured(kind, v)
