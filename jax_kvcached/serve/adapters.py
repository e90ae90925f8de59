"""LoRA adapters in the server (``--enable-lora``), as vLLM serves them: ``--lora-modules``
specs, an adapter loaded onto its base model's engine under a name no other model or
adapter has, and a request's ``model`` resolved to its base model and adapter.

A spec is ``NAME=PATH`` (a PEFT folder) or JSON ``{"name", "path", "base_model_name"}``;
without a base, the server's only model is the base (with several, the spec must say).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    base: str | None = None  # the served model it adapts (None: the only one)


def parse_spec(text: str) -> AdapterSpec:
    """A ``--lora-modules`` value; ValueError saying the two forms."""
    forms = 'NAME=PATH or JSON {"name": ..., "path": ..., "base_model_name": ...}'
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: not JSON ({e}); {forms}") from None
        if not isinstance(obj, dict) or set(obj) - {"name", "path", "base_model_name"} or not (
            isinstance(obj.get("name"), str) and isinstance(obj.get("path"), str)
        ):
            raise ValueError(f"--lora-modules {text!r}: {forms}")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        return AdapterSpec(obj["name"], obj["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: {forms}")
    return AdapterSpec(name, path)


def base_of(models: dict[str, Any], name: str) -> str | None:
    """The served model whose engine holds adapter ``name`` (None: no such adapter)."""
    for base, m in models.items():
        table = getattr(m.engine, "adapters", None)
        if table is not None and name in table.names():
            return base
    return None


def load(models: dict[str, Any], spec: AdapterSpec) -> Any:
    """Loads ``spec`` onto its base's engine; ValueError naming what is wrong (a name in
    use, an unknown or ambiguous base, an adapter that does not fit: the file and field)."""
    if spec.name in models or base_of(models, spec.name) is not None:
        raise ValueError(f"the name {spec.name!r} is taken (a served model or adapter)")
    base = spec.base
    if base is None:
        if len(models) != 1:
            have = ", ".join(sorted(models))
            raise ValueError(f"adapter {spec.name!r}: several models are served ({have}): "
                             "give its base_model_name")  # fmt: skip
        base = next(iter(models))
    if base not in models:
        raise ValueError(f"adapter {spec.name!r}: no served model {base!r} "
                         f"(have {', '.join(sorted(models))})")  # fmt: skip
    return models[base].engine.load_adapter(spec.name, spec.path)


def cards(models: dict[str, Any]) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the loaded adapters: ``parent`` their base model,
    ``root`` their folder (as vLLM lists them)."""
    out = []
    for base, m in models.items():
        table = getattr(m.engine, "adapters", None)
        for a in table.stats()["adapters"] if table is not None else []:
            out.append({"id": a["name"], "object": "model", "created": m.created,
                        "owned_by": "jax-kvcached", "root": a["path"], "parent": base,
                        "max_model_len": m.engine.max_model_len})  # fmt: skip
    return out
