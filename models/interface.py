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
Recurrent layers (Gated DeltaNet, Mamba2) reach their per-sequence state through
:func:`recurrence_of` ``(attend)``: ``recur(layer, step_fn, init, xs, carry, chunk=None)
-> (ys, carry)`` runs ``step_fn(state, x) -> (state, y)`` (one sequence, one token) over
each sequence's tokens in order from its stored state (the engine's state slots:
``engine.recurrent``), ``init`` one sequence's zero state, ``xs`` / ``ys`` per-token
pytrees ``(B, T, ...)``; ``chunk`` ``(C, chunk_fn)``: the same update ``C`` tokens at a
time, ``chunk_fn(state, xs, n) -> (state, ys)`` with the first ``n`` of ``xs`` counting
(the engine runs prefill chunks with it). An ``attend`` without a cache has none: each
batch row is then one sequence from a zero state (:func:`dense_recurrence`).
Tensor parallelism splits the parameters ``tensor_parallel_plan(tp)`` names along the
axis it gives (see ``models.sharding``); ``attend`` then receives each device's heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

# attend(layer, q, k, v, carry, sinks=None) -> (attention output (B, T, heads, head_dim), carry)
Attend = Callable[..., tuple[jax.Array, Any]]
# recur(layer, step_fn, init, xs, carry) -> (per-token outputs, carry)
Recur = Callable[..., tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """What one layer keeps per sequence (``ModelConfig.layer_specs()``): the K/V of
    every token (``full``), of its last ``window`` tokens (``sliding``), or a fixed-size
    recurrent state (``recurrent``: Gated DeltaNet, Mamba2). Layers of one spec share a
    KV cache group, and the engine picks each group's manager by its kind."""

    kind: str = "full"
    window: int = 0

    KINDS: ClassVar[tuple[str, ...]] = ("full", "sliding", "recurrent")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"a layer's KV kind must be one of {self.KINDS}, got {self.kind!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise ValueError(f"a layer's window must be an int, got {self.window!r}")
        if (self.kind == "sliding") != (self.window > 0) or self.window < 0:
            raise ValueError(f"a sliding layer has a positive window, and only it: "
                             f"{self.kind} with window {self.window}")  # fmt: skip

    @classmethod
    def sliding(cls, window: int) -> KVSpec:
        return cls("sliding", window)

    @property
    def order(self) -> tuple[int, int]:
        """Groups go full first, then windows ascending, the recurrent group last."""
        return self.KINDS.index(self.kind), self.window


FULL = KVSpec()
RECURRENT = KVSpec("recurrent")


def chunk_size() -> int:
    """Tokens of a recurrent layer's chunked update: 64 on an accelerator (its matmuls'
    tile), 16 on a CPU (measured: 77 us a position for 32 sequences at 16, 323 at 64)."""
    return 16 if jax.default_backend() == "cpu" else 64


def dense_recurrence(
    layer: Any, step_fn: Callable, init: Any, xs: Any, carry: Any, chunk: Any = None
) -> tuple:
    """The recurrence without a cache: each batch row of ``xs`` is one sequence, run
    from the zero state ``init``, token by token (the reference: ``chunk`` unused)."""

    def one(seq):
        return jax.lax.scan(step_fn, init, seq)[1]

    return jax.vmap(one)(xs), carry


def recurrence_of(attend: Attend) -> Recur:
    """The recurrence an ``attend`` offers (``attend.recur``: the engine's state slots),
    or :func:`dense_recurrence` for one without a cache."""
    return getattr(attend, "recur", None) or dense_recurrence


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
