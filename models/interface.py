"""The interface every model implements: what the engine and the loaders rely on.

An engine needs the config fields that shape the KV cache and the step (``vocab_size``,
``num_layers``, ``num_kv_heads``, ``head_dim``, ``max_position_embeddings``, ``eos_ids``),
the parameter ``dtype``, and one pure call: ``model(tokens, positions, attend)`` -> fp32
logits, where ``attend(layer, q, k, v, carry, sinks=None) -> (out, carry)`` is the paged
attention the engine supplies (it writes the new K/V into the cache and reads the
context; ``sinks`` ``(heads,)``: a learned logit per head in the softmax's denominator,
GPT-OSS's attention sinks).
``layer`` is an int32 scalar, traced when the layers run under ``jax.lax.scan`` (they do:
see ``models.stack``), and ``carry`` the state the attention threads through the layers
(the engine's ordering token; a dense cache; None). Loaders fill the parameters through
``hf_weights()``: Hugging Face tensor name -> (module, attribute, transpose, index), the
index a layer's row of a stacked parameter, or a tuple into it (one expert's slice of a
mixture of experts' weight); None: the whole parameter.
Tensor parallelism splits the parameters ``tensor_parallel_plan(tp)`` names along the
axis it gives (see ``models.sharding``); ``attend`` then receives each device's heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

# attend(layer, q, k, v, carry, sinks=None) -> (attention output (B, T, heads, head_dim), carry)
Attend = Callable[..., tuple[jax.Array, Any]]


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

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> jax.Array:
        """Logits (tokens, vocab_size) in float32: ``logits(hidden_states(...)[0])``."""

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, attend: Attend, carry: Any = None
    ) -> tuple[jax.Array, Any]:
        """The hidden states the logits are computed from (the engine computes logits
        only for the rows that sample or score) and the attention's final carry."""

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits of hidden states."""

    def hf_weights(self) -> dict[str, tuple[object, str, bool, int | None]]:
        """Hugging Face tensor name -> (module, attribute, transpose, stacked index)."""

    def tensor_parallel_plan(self, tp: int) -> list[tuple[object, str, int]]:
        """(module, attribute, axis split over ``tp`` devices) per split parameter;
        ValueError when the model does not split over ``tp`` devices."""
