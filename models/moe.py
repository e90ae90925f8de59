"""Mixture-of-experts feed-forward layers: a router picks ``top_k`` experts per token, the
experts run as one grouped matmul over the tokens sorted by expert, and optional shared
experts run on every token.

Routing, in each family's form (:func:`route`):
- ``softmax`` (Qwen3-MoE, DeepSeek-V2): softmax over the experts, the top k, optionally
  renormalized (``norm_topk_prob``);
- ``sigmoid`` (DeepSeek-V3): sigmoid scores; the choice adds a score-correction bias
  (``e_score_correction_bias``, choice only) and is limited to the ``topk_group`` best of
  ``n_group`` expert groups (a group's score: the sum of its two best; DeepSeek-V2's
  ``group_limited_greedy``: its best, over softmax scores); the weights are the
  chosen experts' scores, optionally renormalized;
then scaled by ``routed_scaling_factor``.

Experts (:func:`grouped_matmul`): ``jax.lax.ragged_dot`` where XLA computes it per group
(GPU, TPU); on a CPU, whose XLA computes ragged_dot densely (every token against every
expert), the ``kvcached_grouped_matmul`` custom call of the C++ core. No loop over experts,
no dense compute of all of them. Under tensor parallelism the experts split along their
intermediate dimension (gate / up by outputs, down by inputs) and run per device under
``jax.shard_map`` with one ``psum``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2", "max")
# The expert MLP's gate: SiLU(gate) * up, or GPT-OSS's clamped form (gate <= limit,
# |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)).
ACTIVATIONS = ("silu", "swiglu_oai")
GROUPED_IMPLS = ("auto", "kernel", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A model's mixture-of-experts layers (every layer not in ``dense_layers``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited choice: experts in n_group groups,
    topk_group: int = 1  # tokens pick among the topk_group best groups
    group_score: str = "top2"  # a group's score: the sum of its two best, or "max"
    score_bias: bool = False  # e_score_correction_bias (DeepSeek-V3; choice only)
    shared_intermediate_size: int = 0  # the shared experts' width in all (0: none)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead
    activation: str = "silu"
    swiglu_alpha: float = 1.702  # swiglu_oai's
    swiglu_limit: float = 7.0
    router_bias: bool = False  # GPT-OSS: the router's logits have a bias
    expert_bias: bool = False  # GPT-OSS: gate/up and down have biases per expert
    # Qwen3-Next: the shared expert's output is scaled by sigmoid(shared_expert_gate(x))
    shared_gate: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe config: top_k {self.top_k} of {self.num_experts} experts")
        if self.intermediate_size < 1 or self.shared_intermediate_size < 0:
            raise ValueError("moe config: expert sizes must be positive")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"moe config: activation {self.activation!r} is not one of "
                             f"{ACTIVATIONS}")  # fmt: skip
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"moe config: group_score {self.group_score!r} is not one of "
                             f"{GROUP_SCORES}")  # fmt: skip
        if self.scoring not in SCORINGS:
            raise ValueError(f"moe config: scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"moe config: {self.num_experts} experts in {self.n_group} "
                             f"groups, topk_group {self.topk_group}")  # fmt: skip
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and (per_group < 2 or self.topk_group * per_group < self.top_k):
            raise ValueError(f"moe config: {self.topk_group} groups of {per_group} experts "
                             f"cannot hold top_k {self.top_k}")  # fmt: skip

    def is_moe(self, layer: int) -> bool:
        return layer not in self.dense_layers


def moe_from_hf(cfg: dict[str, Any], *, shared_gate: bool = False) -> MoEConfig:
    """The experts of a Qwen-style config.json (``num_experts``, ``moe_intermediate_size``,
    ``decoder_sparse_step``, ``mlp_only_layers``; with ``shared_gate`` one gated shared
    expert of ``shared_expert_intermediate_size``); a field we do not support fails the
    load naming it."""
    check_silu(cfg)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if shared_gate else 0
    layers = cfg["num_hidden_layers"]
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    n = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])  # (5.x)
    dense = tuple(i for i in range(layers) if i in only or not (n > 0 and (i + 1) % step == 0))
    return MoEConfig(
        num_experts=n,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=dense,
        shared_intermediate_size=shared,
        shared_gate=bool(shared),
    )


def check_silu(cfg: dict[str, Any]) -> None:
    """A config.json whose ``hidden_act`` is not SiLU fails, naming it."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{cfg.get('model_type')}: hidden_act {act!r} is not supported (silu)")


def route(logits: jax.Array, bias: jax.Array | None, m: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits ``(N, E)`` -> (weights ``(N, k)`` float32, experts ``(N, k)`` int32),
    as the module's docstring says."""
    logits = logits.astype(jnp.float32)
    if m.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if m.n_group > 1:
        n = choice.shape[0]
        grouped = choice.reshape(n, m.n_group, -1)
        if m.group_score == "max":
            group_score = grouped.max(-1)  # (N, n_group)
        else:
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, keep = jax.lax.top_k(group_score, m.topk_group)
        mask = jnp.zeros((n, m.n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
        choice = jnp.where(mask[:, :, None], grouped, 0.0).reshape(n, -1)
    _, experts = jax.lax.top_k(choice, m.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if m.norm_topk_prob:
        eps = 1e-20 if m.scoring == "sigmoid" else 0.0  # (as each family writes it)
        weights = weights / (weights.sum(-1, keepdims=True) + eps)
    return weights * m.routed_scaling_factor, experts.astype(jnp.int32)


def _kernel(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    # The custom call's target lives in the C++ core: importing ffi_targets registers it
    # (the one import of the memory layer a model may make, here where the call is built).
    from jax_kvcached.memory import ffi_targets  # noqa: F401

    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), jnp.float32)
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        w = w.astype(jnp.float32)
    return jax.ffi.ffi_call("kvcached_grouped_matmul", out)(x.astype(jnp.float32), w, sizes)


def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, impl: str = "auto") -> jax.Array:
    """float32 ``x[r] @ w[g]`` for the rows of each group: ``x (rows, k)`` sorted by group,
    ``w (groups, k, n)``, ``sizes (groups,)`` int32 (rows past their sum are zero).
    ``impl``: ``kernel`` (a CPU), ``ragged_dot``, or ``auto`` (the kernel on a CPU)."""
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"impl must be one of {GROUPED_IMPLS}, got {impl!r}")
    sizes = sizes.astype(jnp.int32)
    if impl == "kernel":
        return _kernel(x, w, sizes)
    if impl == "ragged_dot":
        return _ragged(x, w, sizes)
    return jax.lax.platform_dependent(x, w, sizes, cpu=_kernel, default=_ragged)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token-expert pairs ``(N, k)`` sorted by expert: (the order of the flattened pairs,
    each sorted pair's token, rows per expert)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, order // experts.shape[1], sizes


class MoE(nnx.Module):
    """A mixture-of-experts SwiGLU feed-forward: ``router`` ``(E, hidden)`` (Hugging Face's
    layout, kept in the model dtype: never packed), ``gate_up`` ``(E, hidden, 2, I)``,
    ``down`` ``(E, I, hidden)``, optional ``score_bias`` ``(E,)``; ``shared``: the
    experts every token runs (DeepSeek; the model's own MLP module, with ``gate_proj``,
    ``up_proj`` and ``down_proj``), or None. ``tp``: the mesh when the experts are split
    over devices (set by ``shard_model``)."""

    def __init__(
        self, hidden: int, m: MoEConfig, dtype: Any, rngs: nnx.Rngs, shared: Any = None
    ) -> None:
        e, i = m.num_experts, m.intermediate_size
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Param(init(rngs.params(), (hidden, e), dtype).T)
        gate_up = init(rngs.params(), (e, hidden, 2 * i), dtype)
        self.gate_up = nnx.Param(gate_up.reshape(e, hidden, 2, i))
        self.down = nnx.Param(init(rngs.params(), (e, i, hidden), dtype))
        self.score_bias = nnx.Param(jnp.zeros((e,), jnp.float32)) if m.score_bias else None
        self.router_bias = nnx.Param(jnp.zeros((e,), dtype)) if m.router_bias else None
        self.gate_up_bias = nnx.Param(jnp.zeros((e, 2, i), dtype)) if m.expert_bias else None
        self.down_bias = nnx.Param(jnp.zeros((e, hidden), dtype)) if m.expert_bias else None
        if (shared is None) != (m.shared_intermediate_size == 0):
            raise ValueError("moe: shared experts are given exactly when the config has them")
        self.shared = shared
        self.shared_gate = (
            nnx.Linear(hidden, 1, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
            if m.shared_gate else None
        )  # fmt: skip
        self.cfg = m
        self.tp: Any = None

    def __call__(self, x: jax.Array) -> jax.Array:
        lead, hidden = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, hidden)
        logits = jnp.dot(x2, self.router[...].T, preferred_element_type=jnp.float32)
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        bias = None if self.score_bias is None else self.score_bias[...]
        weights, experts = route(logits, bias, self.cfg)
        order, token, sizes = sort_by_expert(experts, self.cfg.num_experts)
        pair_w = weights.reshape(-1)[order]
        pair_e = experts.reshape(-1)[order]  # each sorted pair's expert
        biases = (None if self.gate_up_bias is None
                  else (self.gate_up_bias[...][pair_e], self.down_bias[...][pair_e]))  # fmt: skip
        y = self._experts(x2, token, sizes, pair_w, biases, self.gate_up[...], self.down[...])
        out = y.astype(x.dtype).reshape(*lead, hidden)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                gate = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32))
                shared = (shared.astype(jnp.float32) * gate).astype(x.dtype)
            out = out + shared
        return out

    def _experts(self, x, token, sizes, pair_w, biases, gate_up, down) -> jax.Array:
        m = self.cfg
        if self.tp is None:
            return _expert_sum(m, x, token, sizes, pair_w, biases, gate_up, down)
        mesh = self.tp
        axis = mesh.axis_names[0]
        P = jax.sharding.PartitionSpec
        nd = gate_up.ndim

        def local(x, token, sizes, pair_w, biases, gu, dn):
            if biases is not None:  # the down bias is added once: on the first device
                first = (jax.lax.axis_index(axis) == 0).astype(biases[1].dtype)
                biases = (biases[0], biases[1] * first)
            return jax.lax.psum(_expert_sum(m, x, token, sizes, pair_w, biases, gu, dn), axis)

        bias_spec = None if biases is None else (P(None, None, axis), P())
        return jax.shard_map(
            local, mesh=mesh,
            in_specs=(P(), P(), P(), P(), bias_spec, P(*([None] * (nd - 1)), axis),
                      P(None, axis, None)),
            out_specs=P(), check_vma=False,
        )(x, token, sizes, pair_w, biases, gate_up, down)  # fmt: skip


def _gate(m: MoEConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    if m.activation == "silu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, m.swiglu_limit)
    up = jnp.clip(up, -m.swiglu_limit, m.swiglu_limit)
    return gate * jax.nn.sigmoid(gate * m.swiglu_alpha) * (up + 1)


def _expert_sum(m, x, token, sizes, pair_w, biases, gate_up, down) -> jax.Array:
    """Sum over each token's chosen experts of weight x gated expert (float32 (N, hidden));
    ``biases``: each sorted pair's expert's gate/up ``(P, 2, I)`` and down ``(P, hidden)``
    biases, or None."""
    e, hidden, _, inter = gate_up.shape
    xs = x[token]  # the pairs' tokens, sorted by expert
    h = grouped_matmul(xs, gate_up.reshape(e, hidden, 2 * inter), sizes)
    h = h.reshape(-1, 2, inter)
    if biases is not None:
        h = h + biases[0].astype(jnp.float32)
    a = _gate(m, h[:, 0], h[:, 1]).astype(x.dtype)
    y = grouped_matmul(a, down, sizes)
    if biases is not None:
        y = y + biases[1].astype(jnp.float32)
    return jnp.zeros((x.shape[0], hidden), jnp.float32).at[token].add(y * pair_w[:, None])


def expert_weights(moe: MoE, p: str, layer: int) -> dict[str, tuple]:
    """The Hugging Face names of one MoE layer's weights (prefix ``p`` = "model.layers.N.",
    ``layer``: the index into the stacked parameters): the router ``mlp.gate``, each
    expert's ``gate_proj`` / ``up_proj`` / ``down_proj``, the score bias and the shared
    experts where the model has them."""
    t: dict[str, tuple] = {p + "mlp.gate.weight": (moe, "router", False, layer)}
    for j in range(moe.cfg.num_experts):
        q = f"{p}mlp.experts.{j}."
        t[q + "gate_proj.weight"] = (moe, "gate_up", True, (layer, j, slice(None), 0))
        t[q + "up_proj.weight"] = (moe, "gate_up", True, (layer, j, slice(None), 1))
        t[q + "down_proj.weight"] = (moe, "down", True, (layer, j))
    if moe.score_bias is not None:
        t[p + "mlp.gate.e_score_correction_bias"] = (moe, "score_bias", False, layer)
    if moe.router_bias is not None:
        t[p + "mlp.gate.bias"] = (moe, "router_bias", False, layer)
    if moe.gate_up_bias is not None:
        for j in range(moe.cfg.num_experts):
            q = f"{p}mlp.experts.{j}."
            t[q + "gate_proj.bias"] = (moe, "gate_up_bias", False, (layer, j, 0))
            t[q + "up_proj.bias"] = (moe, "gate_up_bias", False, (layer, j, 1))
            t[q + "down_proj.bias"] = (moe, "down_bias", False, (layer, j))
    if moe.shared is not None:
        # Qwen's one gated shared expert, DeepSeek's shared experts
        where = "shared_expert" if moe.shared_gate is not None else "shared_experts"
        for name in ("gate_proj", "up_proj", "down_proj"):
            mod = getattr(moe.shared, name)
            t[p + f"mlp.{where}.{name}.weight"] = (mod, "kernel", True, layer)
    if moe.shared_gate is not None:
        t[p + "mlp.shared_expert_gate.weight"] = (moe.shared_gate, "kernel", True, layer)
    return t


def split_fused_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    """Expert tensors in transformers 5's fused layout (``mlp.experts.gate_up_proj``
    ``(E, 2I, hidden)``, ``mlp.experts.down_proj`` ``(E, hidden, I)``) as the per-expert
    tensors the Hub's checkpoints hold (in place; returns ``tensors``)."""
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gu = np.asarray(tensors.pop(name))
        inter = gu.shape[1] // 2
        for j in range(gu.shape[0]):
            tensors[f"{base}{j}.gate_proj.weight"] = gu[j, :inter]
            tensors[f"{base}{j}.up_proj.weight"] = gu[j, inter:]
        down = tensors.pop(base + "down_proj", None)
        if down is not None:
            for j in range(down.shape[0]):
                tensors[f"{base}{j}.down_proj.weight"] = np.asarray(down[j])
    return tensors
