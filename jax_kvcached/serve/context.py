"""What every route module shares: the loop, the served models, auth, metrics, and
reading a bounded JSON body."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from typing import Any

from starlette.requests import Request

from jax_kvcached.engine.engine import Engine
from jax_kvcached.models.chat_template import ChatTemplate
from jax_kvcached.serve.adapters import base_of
from jax_kvcached.serve.adapters import cards as adapter_cards
from jax_kvcached.serve.auth import AuthConfig
from jax_kvcached.serve.loop import ServingLoop
from jax_kvcached.serve.metrics import ServerMetrics
from jax_kvcached.serve.protocol import APIError


@dataclasses.dataclass
class ServedModel:
    engine: Engine
    tokenizer: Any  # encode(str, add_special_tokens=True) -> ids, decode(ids) -> str
    # None: the checkpoint has none (and no --chat-template): chat is a 400.
    chat_template: ChatTemplate | None = dataclasses.field(default_factory=ChatTemplate)
    # Sampling defaults for fields a request omits (generation config + --default-*).
    defaults: dict[str, float] = dataclasses.field(default_factory=dict)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # The server's parsers (serve/tools.py, serve/reasoning.py): None: off (a tool_choice
    # "auto" request is then a 400; thought stays in the content).
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    # A structured output holds the thought too (else only the answer after </think>).
    constrain_thought: bool = False


def parse_json(raw: bytes) -> Any:
    """JSON from a request body; APIError 400 on anything that is not plain JSON."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise APIError(400, "could not parse the JSON body: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"could not parse the JSON body: {e}") from None
    if (found := _lone_surrogate(body)) is not None:
        where, param = found
        raise APIError(
            400, f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff escapes must pair)",
            param=param,
        )  # fmt: skip
    return body


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(value: Any) -> tuple[str, str | None] | None:
    """Where the first string (a key or a value) holding a lone surrogate is, and its
    top-level field: JSON escapes can carry one, but no tokenizer or response can encode
    it. None when there is none."""
    stack: list[tuple[Any, str, str | None]] = [(value, "", None)]
    while stack:
        v, at, top = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return (f"'{at}'" if at else "the body"), top
        elif isinstance(v, dict):
            for k, x in v.items():
                if _has_surrogate(k):
                    return (f"a key of '{at}'" if at else "a field name"), top
                stack.append((x, f"{at}.{k}" if at else k, top or k))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]", top) for i, x in enumerate(v))
    return None


@dataclasses.dataclass
class AppContext:
    loop: ServingLoop
    models: dict[str, ServedModel]
    auth: AuthConfig
    metrics: ServerMetrics
    max_body_bytes: int
    # Where chat templates render and prompts tokenize, off the event loop: one thread
    # of its own (a fixed count: anyio's pool keeps as many as were ever busy at once).
    prepare_pool: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvcached-prepare"))  # fmt: skip

    async def read_json(self, request: Request) -> Any:
        """The body, read chunk by chunk and refused (413) as soon as it is too large; a
        body not declared ``application/json`` is refused (415: a browser page can send
        other types cross-site with no preflight)."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            raise APIError(415, "the body must be JSON with 'Content-Type: application/json' "
                           f"(got {kind[:64]!r})")  # fmt: skip
        too_large = APIError(413, f"request body over {self.max_body_bytes} bytes")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, f"bad Content-Length {length[:32]!r}")
            if int(length) > self.max_body_bytes:
                raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def served(self, name: str) -> ServedModel:
        """The model ``name`` (an adapter's: its base model); APIError 404 if it is not
        served."""
        return self.models[self.resolve(name)[0]]

    def resolve(self, name: str) -> tuple[str, str | None]:
        """(the served model, the LoRA adapter or None) a request's ``model`` names;
        APIError 404 naming what is served."""
        if name in self.models:
            return name, None
        base = base_of(self.models, name)
        if base is None:
            have = sorted(self.models) + [c["id"] for c in adapter_cards(self.models)]
            raise APIError(404, f"the model '{name}' does not exist; have {have}",
                           param="model", code="model_not_found")  # fmt: skip
        return base, name
