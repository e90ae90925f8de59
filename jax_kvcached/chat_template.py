"""Chat templates: a checkpoint's own (tokenizer_config.json, Jinja) or a plain default."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

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
        self.source = source
        self._template = env.from_string(source)
        self._context = context

    @classmethod
    def for_model(cls, model_dir: str | None) -> ChatTemplate:
        """The checkpoint's ``chat_template`` when it has one, else the default."""
        path = os.path.join(model_dir, "tokenizer_config.json") if model_dir else ""
        if path and os.path.exists(path):
            with open(path) as f:
                cfg = json.load(f)
            source = cfg.get("chat_template")
            if isinstance(source, list):  # named templates: take "default"
                source = next((t["template"] for t in source if t.get("name") == "default"), None)
            if isinstance(source, str):
                special = {
                    k: v if isinstance(v, str) else (v or {}).get("content", "")
                    for k, v in cfg.items()
                    if k in ("bos_token", "eos_token")
                }
                return cls(source, **special)
        return cls()

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self._template.render(
            messages=list(messages), add_generation_prompt=True, **self._context
        )
