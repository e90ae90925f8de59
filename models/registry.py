"""Models by architecture (the config's ``model_type``): adding one is one module that
defines a :class:`~.interface.CausalLM` class and registers it here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

# A model class: cls(cfg, dtype=..., rngs=nnx.Rngs) -> CausalLM
_BY_TYPE: dict[str, type] = {}


def register(*model_types: str) -> Callable[[type], type]:
    """Class decorator: serves configs whose ``model_type`` is one of ``model_types``."""

    def deco(cls: type) -> type:
        for t in model_types:
            if t in _BY_TYPE and _BY_TYPE[t] is not cls:
                raise ValueError(f"model_type {t!r} is already registered to {_BY_TYPE[t]}")
            _BY_TYPE[t] = cls
        return cls

    return deco


def supported() -> tuple[str, ...]:
    return tuple(sorted(_BY_TYPE))


def model_class(model_type: str) -> type:
    cls = _BY_TYPE.get(model_type)
    if cls is None:
        raise ValueError(f"unsupported model_type {model_type!r} ({', '.join(supported())})")
    return cls


def build_model(cfg: Any, *, seed: int = 0, dtype: Any = jnp.float32) -> Any:
    """A randomly initialised model of ``cfg``'s architecture (the tiny presets use this)."""
    return model_class(cfg.model_type)(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def abstract_model(cfg: Any, *, dtype: Any = jnp.float32) -> Any:
    """The model's structure with shape-only parameters (no initialisation cost), for a
    loader to fill in."""
    cls = model_class(cfg.model_type)
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
