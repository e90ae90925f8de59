"""The interface every model implements: what the engine and the loaders rely on.

An engine needs the config fields that shape the KV cache and the step (``vocab_size``,
``num_layers``, ``num_kv_heads``, ``head_dim``, ``max_position_embeddings``, ``eos_ids``),
the parameter ``dtype``, and one pure call: ``model(tokens, positions, attend)`` -> fp32
logits, where ``attend(layer, q, k, v)`` is the paged attention the engine supplies (it
writes the new K/V into the cache and reads the context). Loaders fill the parameters
through ``hf_weights()``: Hugging Face tensor name -> (module, attribute, transpose).
Tensor parallelism splits the parameters ``tensor_parallel_plan(tp)`` names along the
axis it gives (see ``models.sharding``); ``attend`` then receives each device's heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

# attend(layer, q, k, v) -> attention output, (tokens, heads, head_dim)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


@runtime_checkable
class ModelConfigLike(Protocol):
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    model_type: str

    @property
    def eos_ids(self) -> tuple[int, ...]: ...


@runtime_checkable
class CausalLM(Protocol):
    config: Any  # a ModelConfigLike
    dtype: Any

    def __call__(self, tokens: jax.Array, positions: jax.Array, attend: Attend) -> jax.Array:
        """Logits (tokens, vocab_size) in float32: ``logits(hidden_states(...))``."""

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, attend: Attend) -> jax.Array:
        """The hidden states the logits are computed from (the engine computes logits
        only for the rows that sample or score)."""

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits of hidden states."""

    def hf_weights(self) -> dict[str, tuple[object, str, bool]]:
        """Hugging Face tensor name -> (module, attribute, transpose)."""

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        """(module, attribute, axis split over ``tp`` devices) per split parameter;
        ValueError when the model does not split over ``tp`` devices."""
