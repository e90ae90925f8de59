"""The model families (:mod:`.family`), found by ``model_type``, GGUF architecture or
preset name. Each family module calls :func:`add` once; ``models/__init__.py`` imports
every family on one line, so adding a family is its module plus that line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from .family import Family, GGUFArch

_FAMILIES: dict[str, Family] = {}
_BY_TYPE: dict[str, Family] = {}
_BY_ARCH: dict[str, GGUFArch] = {}
_PRESETS: dict[str, Any] = {}


def add(family: Family) -> Family:
    """Registers ``family``; a model_type, GGUF architecture or preset another family
    already has is an error naming both."""
    for t in family.model_types:
        if t in _BY_TYPE and _BY_TYPE[t].model is not family.model:
            raise ValueError(f"model_type {t!r} is already registered to {_BY_TYPE[t].model}")
    for a in family.gguf:
        if a.name in _BY_ARCH:
            raise ValueError(f"GGUF architecture {a.name!r} is already registered")
    for p in family.presets:
        if p in _PRESETS:
            raise ValueError(f"preset {p!r} is already registered")
    _FAMILIES[family.name] = family
    _BY_TYPE.update(dict.fromkeys(family.model_types, family))
    _BY_ARCH.update({a.name: a for a in family.gguf})
    _PRESETS.update(family.presets)
    return family


def register(*model_types: str) -> Callable[[type], type]:
    """Class decorator for a model class alone (no config reader, GGUF or presets):
    serves configs whose ``model_type`` is one of ``model_types``."""

    def deco(cls: type) -> type:
        add(Family(name=model_types[0], model=cls, model_types=model_types))
        return cls

    return deco


def supported() -> tuple[str, ...]:
    return tuple(sorted(_BY_TYPE))


def family(model_type: str) -> Family:
    """The family serving ``model_type``; an unknown one is an error listing the rest."""
    fam = _BY_TYPE.get(model_type)
    if fam is None:
        raise ValueError(f"unsupported model_type {model_type!r} ({', '.join(supported())})")
    return fam


def model_class(model_type: str) -> type:
    return family(model_type).model


def gguf_arch(name: str) -> GGUFArch | None:
    """The GGUF architecture ``name`` (None: no family reads it)."""
    return _BY_ARCH.get(name)


def gguf_archs() -> tuple[str, ...]:
    return tuple(_BY_ARCH)


def presets() -> dict[str, Any]:
    """Every family's tiny random presets by name (the registry's own dict: the
    package exposes it as ``BUILTIN_CONFIGS``)."""
    return _PRESETS


def build_model(cfg: Any, *, seed: int = 0, dtype: Any = jnp.float32) -> Any:
    """A randomly initialised model of ``cfg``'s architecture (the tiny presets use this)."""
    return model_class(cfg.model_type)(cfg, dtype=dtype, rngs=nnx.Rngs(seed))


def abstract_model(cfg: Any, *, dtype: Any = jnp.float32) -> Any:
    """The model's structure with shape-only parameters (no initialisation cost), for a
    loader to fill in."""
    cls = model_class(cfg.model_type)
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
