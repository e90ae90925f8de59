"""Log-probabilities in OpenAI's response shapes: chat's ``logprobs.content`` and the
completions API's parallel lists, each token as its text."""

from __future__ import annotations

from typing import Any

from jax_kvcached.engine.engine import Prompt
from jax_kvcached.serve.context import ServedModel


def token_text(m: ServedModel, token: int) -> str:
    return m.tokenizer.decode([token])


def chat_logprobs(m: ServedModel, entries: list[Any], k: int) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: per token its text, bytes, logprob and top ``k``."""

    def one(token: int, lp: float) -> dict[str, Any]:
        s = token_text(m, token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = [
        {**one(t, lp), "top_logprobs": [one(i, v) for i, v in top[:k]]} for t, lp, top in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    m: ServedModel, entries: list[Any], k: int, prompt: Prompt | None = None,
    prompt_lps: list[Any] | None = None, offset: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's completions ``logprobs`` (tokens, token_logprobs, top_logprobs,
    text_offset); with ``prompt`` (echo) the prompt's tokens come first: the first with
    null, the others with their logprob and the top ``k`` at that position."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset

    def add(token: int, lp: float | None, top: dict[str, float] | None) -> None:
        nonlocal pos
        s = token_text(m, token)
        tokens.append(s)
        lps.append(lp)
        tops.append(top)
        offsets.append(pos)
        pos += len(s)

    if prompt is not None:
        for i, t in enumerate(prompt.token_ids):
            e = prompt_lps[i] if prompt_lps and i < len(prompt_lps) else None
            if e is None:
                add(t, None, None)
            else:
                alts = {}
                for j, v in e[1][:k]:
                    alts.setdefault(token_text(m, j), v)
                alts.setdefault(token_text(m, t), e[0])  # the prompt's token is always in
                add(t, e[0], alts)
    for t, lp, top in entries:
        alts = {}
        for i, v in top[:k]:
            alts.setdefault(token_text(m, i), v)
        add(t, lp, alts)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
