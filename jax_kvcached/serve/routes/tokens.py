"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jax_kvcached.serve.context import AppContext
from jax_kvcached.serve.protocol import APIError, chat_messages, is_token_id


def _body(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        msg = f"unrecognized request argument supplied: {unknown[0]}"
        raise APIError(400, msg, param=unknown[0])
    if not isinstance(body.get("model"), str):
        raise APIError(400, "'model' is required and must be a string", param="model")
    return body


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise APIError(400, f"'{key}' must be a boolean, got {v!r}", param=key)
    return v


def routes(ctx: AppContext) -> list[Route]:
    async def tokenize(request: Request) -> Response:
        """``{"model", "prompt"}`` or ``{"model", "messages"}`` -> ``{"count",
        "max_model_len", "tokens"}`` (``token_strs`` with ``return_token_strs``)."""
        ctx.auth.check(request, admin=False)
        allowed = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs"}  # fmt: skip
        body = _body(await ctx.read_json(request), allowed)
        m = ctx.served(body["model"])
        if ("prompt" in body) == ("messages" in body):
            raise APIError(400, "give one of 'prompt' or 'messages'")
        if "messages" in body:
            if m.chat_template is None:
                raise APIError(400, f"model {body['model']!r} has no chat template: "
                               "tokenize a 'prompt'", param="messages",
                               code="no_chat_template")  # fmt: skip
            messages = chat_messages(body["messages"])
            gen = _bool(body, "add_generation_prompt", True)
            try:
                text = m.chat_template.render(messages, add_generation_prompt=gen)
            except Exception as e:
                raise APIError(400, f"the chat template failed: {e}", param="messages") from None
            special = _bool(body, "add_special_tokens", False)  # the template brings its own
            ids = m.tokenizer.encode(text, add_special_tokens=special)
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt' must be a string", param="prompt")
            special = _bool(body, "add_special_tokens", True)
            ids = m.tokenizer.encode(prompt, add_special_tokens=special)
        out: dict[str, Any] = {
            "count": len(ids), "max_model_len": m.engine.max_model_len, "tokens": list(ids),
        }  # fmt: skip
        if _bool(body, "return_token_strs", False):
            out["token_strs"] = [m.tokenizer.decode([t]) for t in ids]
        return JSONResponse(out)

    async def detokenize(request: Request) -> Response:
        """``{"model", "tokens"}`` -> ``{"prompt"}``."""
        ctx.auth.check(request, admin=False)
        body = _body(await ctx.read_json(request), {"model", "tokens"})
        m = ctx.served(body["model"])
        tokens = body.get("tokens")
        vocab = m.engine.config.vocab_size
        if not isinstance(tokens, list) or not all(is_token_id(t) and t < vocab for t in tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})",
                           param="tokens")  # fmt: skip
        return JSONResponse({"prompt": m.tokenizer.decode(tokens)})

    async def version(request: Request) -> Response:
        from jax_kvcached import __version__

        return JSONResponse({"version": __version__})

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
    ]
