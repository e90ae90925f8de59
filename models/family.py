"""What a model family declares about itself: its model class, its config.json reader,
the GGUF architectures llama.cpp writes it as, its presets and its checkpoint fix-ups.

A family is one module that builds a :class:`Family` and hands it to
:func:`.registry.add`; the package imports it on one line of ``models/__init__.py``. The
shared readers (:mod:`.config`'s ``hf_common``, :mod:`.gguf`'s common GGUF reader) do
everything every family shares and ask the family for the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# (checkpoint path, layer index as text, the parts by GGUF name, model config) -> weight
Join = Callable[[str, str, dict[str, np.ndarray], Any], np.ndarray]


def _no_fields(ck: Any) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Merge:
    """One Hugging Face weight that llama.cpp splits into several tensors of a layer:
    ``parts`` (GGUF names after ``blk.N.``, without ``.weight``) joined by ``join`` into
    ``hf`` (after ``model.layers.N.``)."""

    parts: tuple[str, ...]
    hf: str
    join: Join


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """One ``general.architecture`` as llama.cpp's converter writes it.

    ``fields`` reads the :class:`~.config.ModelConfig` fields the common reader does not
    (it may override ``model_type``, ``head_dim``, ``num_kv_heads``,
    ``intermediate_size``, ``vocab_size``, ``qkv_bias``); ``layer_names`` adds to (or
    overrides) the common GGUF -> Hugging Face tensor names; ``weight`` takes a tensor
    back to Hugging Face's form; ``merges`` joins split tensors; ``permuted``: Q / K rows
    permuted for llama.cpp's RoPE; ``yarn``: YaRN scaling is read (other files refuse
    it); ``spm_ranks_by_position`` / ``add_space_prefix``: its SentencePiece tokenizer's
    merge ranks (by place instead of score) and default space prefix."""

    name: str
    model_type: str
    fields: Callable[[Any], dict[str, Any]] = _no_fields
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    weight: Callable[[str, np.ndarray], np.ndarray] | None = None
    merges: tuple[Merge, ...] = ()
    permuted: bool = False
    yarn: bool = False
    spm_ranks_by_position: bool = False
    add_space_prefix: bool = True


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: ``model`` (a :class:`~.interface.CausalLM` class built as
    ``model(cfg, dtype=..., rngs=...)``) serves configs whose ``model_type`` is one of
    ``model_types``; ``from_hf`` reads a config.json (None: the family has no reader, as
    for a class given to :func:`.registry.register` alone); ``gguf`` its GGUF
    architectures; ``presets`` its tiny random configs by name; ``prepare_tensors``
    rewrites a Hugging Face checkpoint's tensors into the names ``model.hf_weights()``
    reads, in place, given the checkpoint's path."""

    name: str
    model: type
    model_types: tuple[str, ...]
    from_hf: Callable[[dict[str, Any]], Any] | None = None
    gguf: tuple[GGUFArch, ...] = ()
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prepare_tensors: Callable[[dict[str, Any], str], None] | None = None
