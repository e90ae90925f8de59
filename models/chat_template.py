"""Chat templates: a checkpoint's own Jinja template (``chat_template.jinja``,
``tokenizer_config.json`` or GGUF metadata) or a plain default."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any, NoReturn

log = logging.getLogger("jax_kvcached.models.chat_template")

# For checkpoints without a template (the built-in tiny models).
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    """Renders chat messages to a prompt string with a Jinja template."""

    def __init__(self, source: str = DEFAULT_TEMPLATE, **context: object) -> None:
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # The globals transformers' apply_chat_template gives templates.
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.source = source
        self._template = env.from_string(source)
        self._context = context

    @classmethod
    def for_model(cls, model_path: str | None) -> ChatTemplate:
        """The checkpoint's template (``chat_template.jinja``, ``tokenizer_config.json``,
        then GGUF metadata) or, with a warning, the plain default."""
        from .loader import find_chat_template

        return cls.from_source(*find_chat_template(model_path), where=model_path)

    @classmethod
    def from_source(
        cls, source: str | None, special: dict[str, str], where: str | None = None
    ) -> ChatTemplate:
        """A checkpoint's template, or (with a warning when it has none) the default."""
        if source is None:
            if where:
                log.warning("%s has no chat template: using a plain <|role|> one", where)
            return cls()
        return cls(source, **special)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt of ``messages``; ``tools`` (OpenAI's function list) reach the
        template as transformers passes them (``tools``; absent when None)."""
        extra = {} if tools is None else {"tools": list(tools)}
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **extra, **self._context,
        )  # fmt: skip


class TemplateError(ValueError):
    """A chat template refused the messages (its ``raise_exception``)."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)
