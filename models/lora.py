"""LoRA adapters: PEFT folders read and checked against a base model, stacked in slots,
and their deltas computed for a batch that mixes adapters and base-only rows.

An adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as PEFT saves it)
adds ``scaling * (x @ A^T) @ B^T`` to the outputs of the projections it targets (q, k,
v, o, gate, up, down), with ``scaling`` ``lora_alpha / r`` (``lora_alpha / sqrt(r)``
with rsLoRA). A :class:`LoRASlots` holds up to ``max_loras`` adapters of rank up to
``max_rank`` in fixed-shape stacks (a smaller rank is zero-padded, the scaling folded
into B), so loading, replacing or dropping an adapter changes array values, never a
program's shapes: nothing recompiles. In a step, each token carries its slot (0: the
base model alone); :class:`LoRABatch` sorts the tokens by slot once and each
projection's delta is two grouped matmuls over the adapter rows
(:func:`~.moe.grouped_matmul`: the C++ kernel on a CPU, ``ragged_dot`` elsewhere); the
base-only rows sort last, past the groups' sizes, and are not multiplied at all.

A model reaches the batch through its ``attend`` (:func:`lora_of`), as recurrent
layers reach their state; the adapter stays in float32 whatever the base's weights
(packed int8 / int4 included).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .moe import grouped_matmul

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
_ALIASES = {"all-linear": TARGETS}


class AdapterError(ValueError):
    """An adapter that cannot serve this base model: names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter's float32 weights: ``(layer, target) -> (A (in, rank), B (rank,
    out) x scaling)``."""

    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) features in a dense layer of ``cfg``."""
    h, kvh, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    inter = cfg.intermediate_size
    return {"q_proj": (hidden, h * d), "k_proj": (hidden, kvh * d), "v_proj": (hidden, kvh * d),
            "o_proj": (h * d, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}  # fmt: skip


def _config(folder: str) -> tuple[str, dict[str, Any]]:
    path = os.path.join(folder, "adapter_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no adapter_config.json (a PEFT LoRA adapter folder "
                           "has adapter_config.json and adapter_model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path}: cannot read it: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: not a JSON object")
    return path, cfg


def _targets(path: str, cfg: dict[str, Any]) -> tuple[str, ...]:
    raw = cfg.get("target_modules")
    if isinstance(raw, str):
        raw = list(_ALIASES.get(raw, [raw]))
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        raise AdapterError(f"{path}: target_modules must name the projections it adapts")
    names = [t.rsplit(".", 1)[-1] for t in raw]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        raise AdapterError(f"{path}: target_modules {unknown} are not served (LoRA targets: "
                           f"{', '.join(TARGETS)})")  # fmt: skip
    return tuple(t for t in TARGETS if t in names)


def read_peft(folder: str, base: ModelConfig, max_rank: int, name: str | None = None) -> Adapter:
    """The PEFT LoRA adapter in ``folder`` for base model ``base`` (AdapterError naming
    the file and field when it cannot serve it: another method, DoRA, biases, a rank
    above ``max_rank``, a target or a layer the base lacks, a shape of another base)."""
    path, cfg = _config(folder)
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{path}: peft_type {kind!r} is not served (LORA only)")
    for key, ok, what in (("use_dora", lambda v: not v, "DoRA is not served"),
                          ("bias", lambda v: v in (None, "none"), "bias must be 'none'"),
                          ("modules_to_save", lambda v: not v, "modules_to_save is not served"),
                          ("rank_pattern", lambda v: not v, "rank_pattern is not served"),
                          ("alpha_pattern", lambda v: not v, "alpha_pattern is not served"),
                          ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out is not served")):
        if not ok(cfg.get(key)):  # fmt: skip
            raise AdapterError(f"{path}: {key}: {what}")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: r {rank} is above the server's max LoRA rank "
                           f"{max_rank} (--max-lora-rank)")  # fmt: skip
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    targets = _targets(path, cfg)
    weights = _weights(folder, base, rank, scaling, targets)
    return Adapter(name or os.path.basename(os.path.normpath(folder)), folder, rank, scaling,
                   targets, weights)  # fmt: skip


Weights = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def _weights(folder: str, base: ModelConfig, rank: int, scaling: float,
             targets: tuple[str, ...]) -> Weights:  # fmt: skip
    from safetensors.numpy import load_file

    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise AdapterError(f"{folder}: no adapter_model.safetensors")
    try:
        tensors = load_file(path)
    except Exception as e:  # (safetensors' own errors)
        raise AdapterError(f"{path}: cannot read it: {e}") from None
    shapes = projection_shapes(base)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A / B weight")
        target = parts[-3]
        try:
            layer = int(parts[parts.index("layers") + 1])
        except (ValueError, IndexError):
            raise AdapterError(f"{path}: tensor {key!r} names no layer") from None
        if target not in targets:
            raise AdapterError(f"{path}: tensor {key!r}: {target} is not in target_modules")
        if not 0 <= layer < base.num_layers:
            raise AdapterError(f"{path}: tensor {key!r}: the base has {base.num_layers} "
                               "layers")  # fmt: skip
        pairs.setdefault((layer, target), {})[parts[-2]] = value
    out = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{path}: layer {layer} {target} has lora_A or lora_B alone")
        fin, fout = shapes[target]
        a, b = ab["lora_A"], ab["lora_B"]
        if a.shape != (rank, fin) or b.shape != (fout, rank):
            raise AdapterError(
                f"{path}: layer {layer} {target}: lora_A {a.shape} / lora_B {b.shape}, the "
                f"base needs ({rank}, {fin}) / ({fout}, {rank}): an adapter of another model"
            )  # fmt: skip
        out[(layer, target)] = (np.asarray(a, np.float32).T.copy(),
                                (np.asarray(b, np.float32).T * scaling).astype(np.float32))
    if not out:
        raise AdapterError(f"{path}: no LoRA weights")
    return out


class LoRASlots:
    """``max_loras`` adapter slots of rank ``max_rank`` for base ``cfg``: per target, A
    ``(max_loras, in, max_rank)`` and B ``(max_loras, max_rank, out)`` float32 device
    arrays per layer (slot ``s`` of a step's tokens is row ``s - 1``; 0: none): a list of
    one array per layer when the layers run unrolled (a CPU: XLA would copy each slice of
    a stacked array before its dot), else stacked ``(layers, ...)`` for a scan."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int,
                 device: Any = None, *, unroll: bool = True) -> None:  # fmt: skip
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras}, {max_rank}")
        self.max_loras, self.max_rank, self.num_layers = max_loras, max_rank, cfg.num_layers
        self.shapes, self.unroll = projection_shapes(cfg), unroll
        n, r, layers = max_loras, max_rank, cfg.num_layers

        def zeros(shape: tuple[int, ...]) -> Any:
            def one(s: tuple[int, ...]) -> jax.Array:
                x = jnp.zeros(s, jnp.float32)
                return jax.device_put(x, device) if device is not None else x

            return [one(shape) for _ in range(layers)] if unroll else one((layers, *shape))

        self.a = {t: zeros((n, fin, r)) for t, (fin, _) in self.shapes.items()}
        self.b = {t: zeros((n, r, fout)) for t, (_, fout) in self.shapes.items()}

    def set(self, slot: int, adapter: Adapter | None) -> None:
        """Puts ``adapter`` in ``slot`` (1..max_loras); None empties it."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot must be in [1, {self.max_loras}], got {slot}")
        if adapter is not None and adapter.rank > self.max_rank:
            raise AdapterError(f"{adapter.path}: r {adapter.rank} is above {self.max_rank}")
        for t, (fin, fout) in self.shapes.items():
            a = np.zeros((self.num_layers, fin, self.max_rank), np.float32)
            b = np.zeros((self.num_layers, self.max_rank, fout), np.float32)
            if adapter is not None:
                for (layer, target), (wa, wb) in adapter.weights.items():
                    if target == t:
                        a[layer, :, : adapter.rank], b[layer, : adapter.rank] = wa, wb
            if self.unroll:
                self.a[t] = [x.at[slot - 1].set(a[i]) for i, x in enumerate(self.a[t])]
                self.b[t] = [x.at[slot - 1].set(b[i]) for i, x in enumerate(self.b[t])]
            else:
                self.a[t] = self.a[t].at[:, slot - 1].set(a)
                self.b[t] = self.b[t].at[:, slot - 1].set(b)

    def arrays(self) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        return self.a, self.b

    @property
    def nbytes(self) -> int:
        """Device bytes of the stacks (every slot, loaded or not)."""
        return sum(x.nbytes for d in (self.a, self.b) for v in d.values()
                   for x in (v if isinstance(v, list) else [v]))  # fmt: skip


class LoRABatch:
    """A step's tokens grouped by adapter: each projection's delta for them.

    ``a`` / ``b``: :meth:`LoRASlots.arrays`; ``slots`` ``(N,)`` int32: each token's slot
    (0: base only), tokens in the order the model flattens them."""

    def __init__(self, a: dict[str, jax.Array], b: dict[str, jax.Array], slots: jax.Array,
                 impl: str = "auto") -> None:  # fmt: skip
        self.a, self.b, self.impl = a, b, impl
        first = next(iter(a.values()))
        self.per_layer = isinstance(first, list)
        n = (first[0] if self.per_layer else first).shape[-3]  # (the slots)
        slots = slots.reshape(-1).astype(jnp.int32)
        key = jnp.where(slots > 0, slots, n + 1)  # the base-only tokens last
        self.order = jnp.argsort(key, stable=True)
        self.inverse = jnp.argsort(self.order)
        self.sizes = jnp.zeros((n + 2,), jnp.int32).at[key].add(1)[1 : n + 1]

    def layer(self, index: Any, order: int) -> Any:
        """The layer key of :meth:`delta`: the layer's place in the model (``order``, a
        Python int) for per-layer arrays, else its int32 ``index`` (traced under a scan)."""
        return order if self.per_layer else index

    def delta(self, layer: Any, target: str, x: jax.Array) -> jax.Array | None:
        """The adapters' addition to projection ``target``'s output for input ``x``
        ``(..., in)`` (None: no adapter targets it)."""
        if target not in self.a:
            return None
        lead = x.shape[:-1]
        xs = x.reshape(-1, x.shape[-1]).astype(jnp.float32)[self.order]
        h = grouped_matmul(xs, self.a[target][layer], self.sizes, self.impl)
        d = grouped_matmul(h, self.b[target][layer], self.sizes, self.impl)
        return d[self.inverse].reshape(*lead, d.shape[-1])


def lora_targets(model: Any) -> tuple[str, ...]:
    """The projections an adapter may target in ``model`` (its class says; none for a
    family that does not apply adapters, or a layer that is not a dense attention and
    MLP: latent attention, mixture of experts)."""
    cfg = model.config
    targets = tuple(getattr(type(model), "lora_targets", ()))
    if cfg.mla is not None:
        targets = tuple(t for t in targets if t not in ATTENTION)
    if cfg.moe is not None:
        targets = tuple(t for t in targets if t not in MLP)
    return targets


def check_base(adapter: Adapter, model: Any) -> None:
    """AdapterError unless ``model`` applies every projection ``adapter`` targets."""
    served = lora_targets(model)
    missing = [t for t in adapter.targets if t not in served]
    if missing:
        raise AdapterError(f"{adapter.path}: target_modules {missing} are not served for "
                           f"{model.config.model_type} (it takes LoRA on "
                           f"{', '.join(served) or 'none'})")  # fmt: skip


def lora_of(attend: Any) -> LoRABatch | None:
    """The step's adapters, as its ``attend`` carries them (None: none)."""
    return getattr(attend, "lora", None)


def add_delta(y: jax.Array, x: jax.Array, lora: LoRABatch | None, layer: Any, target: str
              ) -> jax.Array:  # fmt: skip
    """``y`` (projection ``target`` of ``x``) plus the adapters' delta."""
    if lora is None:
        return y
    d = lora.delta(layer, target, x)
    return y if d is None else (y.astype(jnp.float32) + d).astype(y.dtype)
