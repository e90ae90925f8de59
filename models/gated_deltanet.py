"""Gated DeltaNet (Qwen3-Next's linear attention) in Flax NNX: a recurrent layer whose
state per sequence is fixed, however long the context.

Per token: the projections give ``q``, ``k``, ``v`` (through a causal depthwise conv of
``conv_kernel`` taps and SiLU), a gate ``z``, a write strength ``beta = sigmoid(b)`` and
a decay ``g = -exp(A_log) * softplus(a + dt_bias)``. With ``q`` and ``k`` L2-normalized
(``q`` also scaled by ``head_k_dim ** -0.5``) and each key head serving
``num_v_heads / num_k_heads`` value heads, the state ``S`` ``(v heads, head_k_dim,
head_v_dim)`` follows the gated delta rule

    S = exp(g) S;   S += k (beta (v - S^T k))^T;   o = S^T q

and the output is ``out_proj(rmsnorm(o) * w * silu(z))``. The state a sequence carries
is the conv window (its last ``conv_kernel - 1`` inputs) and ``S``: ``state_elems``
values a layer. The per-token update runs through the ``recur`` seam
(:func:`~.interface.recurrence_of`), which the engine backs with its state slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .interface import Recur, chunk_size
from .norm import rms_normalize
from .scan_ops import causal_conv, conv_window, decay_matrix


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet's shape (Hugging Face's ``linear_*`` fields)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        for f in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"linear attention: {f} must be positive")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear attention: linear_num_value_heads {self.num_v_heads} is not a "
                f"multiple of linear_num_key_heads {self.num_k_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear attention: linear_conv_kernel_dim {self.conv_kernel} < 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_elems(self) -> int:
        """Values of one sequence's state in one layer: the conv window and ``S``."""
        return (self.conv_kernel - 1) * self.conv_dim + (
            self.num_v_heads * self.head_k_dim * self.head_v_dim
        )


def linear_from_hf(cfg: dict[str, Any]) -> LinearAttentionConfig:
    """The Gated DeltaNet fields of a Hugging Face config.json."""
    return LinearAttentionConfig(
        num_k_heads=int(cfg["linear_num_key_heads"]),
        num_v_heads=int(cfg["linear_num_value_heads"]),
        head_k_dim=int(cfg["linear_key_head_dim"]),
        head_v_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def delta_rule_step(lin: LinearAttentionConfig, conv_w: jax.Array):
    """The per-token update of one sequence: ``step(state, x) -> (state, o)`` with state
    ``{"conv": (conv_kernel - 1, conv_dim), "ssm": (v heads, head_k_dim, head_v_dim)}``
    and x ``{"qkv": (conv_dim,), "g": (v heads,), "beta": (v heads,)}`` (float32)."""
    w = conv_w.astype(jnp.float32).T  # (conv_kernel, conv_dim)

    def step(state, x):
        window, conv = conv_window(state["conv"], x["qkv"][None], 1)
        q, k, v = (a[0] for a in _conv_qkv(lin, w, window))
        s = state["ssm"] * jnp.exp(x["g"])[:, None, None]
        delta = (v - jnp.einsum("hkv,hk->hv", s, k)) * x["beta"][:, None]
        s = s + k[:, :, None] * delta[:, None, :]
        return {"conv": conv, "ssm": s}, jnp.einsum("hkv,hk->hv", s, q)

    return step


def _conv_qkv(lin: LinearAttentionConfig, w: jax.Array, window: jax.Array):
    """The conv (taps ``w`` ``(conv_kernel, conv_dim)``) and SiLU over a window of
    ``conv_kernel - 1 + n`` inputs: ``n`` tokens' normalized q (scaled), k (repeated to
    the value heads) and v."""
    y = causal_conv(window, w)
    n = y.shape[0]
    kd, r = lin.key_dim, lin.num_v_heads // lin.num_k_heads
    q = _l2norm(y[:, :kd].reshape(n, lin.num_k_heads, lin.head_k_dim))
    k = _l2norm(y[:, kd : 2 * kd].reshape(n, lin.num_k_heads, lin.head_k_dim))
    v = y[:, 2 * kd :].reshape(n, lin.num_v_heads, lin.head_v_dim)
    q = jnp.repeat(q, r, axis=1) * lin.head_k_dim**-0.5
    return q, jnp.repeat(k, r, axis=1), v


def unit_lower_inverse(m: jax.Array) -> jax.Array:
    """``(I + m)^-1`` for strictly lower-triangular ``m`` ``(..., C, C)``: ``m`` is
    nilpotent, so the inverse is ``(I - m)(I + m^2)(I + m^4)...`` up to ``m^C``: log2(C)
    squarings and products, matmuls only (no triangular solve)."""
    c = m.shape[-1]
    eye = jnp.eye(c, dtype=m.dtype)
    out, p = eye - m, m
    k = 2
    while k < c:
        p = p @ p
        out = out @ (eye + p)
        k *= 2
    return out


def delta_rule_chunk(lin: LinearAttentionConfig, conv_w: jax.Array):
    """The chunked form of :func:`delta_rule_step` (FLA's, as transformers'
    ``torch_chunk_gated_delta_rule`` writes it): ``chunk(state, xs, n) -> (state, o)``
    over ``C`` tokens of which the first ``n`` count; the others decay nothing and write
    nothing (``g``, ``beta`` 0). Within the chunk the delta rule's writes are one
    triangular inverse (the WY form): ``T = (I + tril(beta k k^T * decay, -1))^-1``
    (:func:`unit_lower_inverse`)."""
    w = conv_w.astype(jnp.float32).T

    def chunk(state, x, n):
        c = x["qkv"].shape[0]
        valid = jnp.arange(c) < n
        window, conv = conv_window(state["conv"], x["qkv"], n)
        q, k, v = _conv_qkv(lin, w, window)  # (C, H, dk) (C, H, dk) (C, H, dv)
        g = jnp.where(valid[:, None], x["g"], 0.0).T  # (H, C)
        beta = jnp.where(valid[:, None], x["beta"], 0.0).T
        q, k, v = (jnp.moveaxis(a, 0, 1) for a in (q, k, v))  # (H, C, .)
        gc = jnp.cumsum(g, axis=-1)
        decay = decay_matrix(gc)  # (H, C, C)
        kb = k * beta[..., None]
        m = jnp.einsum("hid,hjd->hij", kb, k) * decay * (1 - jnp.eye(c))
        t = unit_lower_inverse(m)
        value = jnp.einsum("hij,hjv->hiv", t, v * beta[..., None])
        kcd = jnp.einsum("hij,hjd->hid", t, kb * jnp.exp(gc)[..., None])
        s = state["ssm"]  # (H, dk, dv)
        v_new = value - jnp.einsum("hid,hdv->hiv", kcd, s)
        attn = jnp.einsum("hid,hjd->hij", q, k) * decay
        o = jnp.einsum("hid,hdv->hiv", q * jnp.exp(gc)[..., None], s)
        o = o + jnp.einsum("hij,hjv->hiv", attn, v_new)
        last = gc[:, -1]
        s = s * jnp.exp(last)[:, None, None] + jnp.einsum(
            "hjd,hjv->hdv", k * jnp.exp(last[:, None] - gc)[..., None], v_new
        )
        return {"conv": conv, "ssm": s}, jnp.moveaxis(o, 0, 1)

    return chunk


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's ``linear_attn``: Hugging Face's parameter names and layouts
    (``conv1d.weight`` ``(conv_dim, 1, conv_kernel)``; ``in_proj_qkvz`` and
    ``in_proj_ba`` grouped by key head)."""

    def __init__(self, hidden: int, lin: LinearAttentionConfig, eps: float, dtype: Any,
                 rngs: nnx.Rngs) -> None:  # fmt: skip
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.in_proj_qkvz = nnx.Linear(hidden, 2 * lin.key_dim + 2 * lin.value_dim, **kw)
        self.in_proj_ba = nnx.Linear(hidden, 2 * lin.num_v_heads, **kw)
        init = nnx.initializers.lecun_normal()
        self.conv1d = nnx.Param(init(rngs.params(), (lin.conv_dim, 1, lin.conv_kernel), dtype))
        self.dt_bias = nnx.Param(jnp.ones((lin.num_v_heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, lin.num_v_heads)).astype(dtype))
        self.norm = nnx.Param(jnp.ones((lin.head_v_dim,), dtype))
        self.out_proj = nnx.Linear(lin.value_dim, hidden, **kw)
        self.lin = lin
        self.eps = eps

    def __call__(self, x: jax.Array, recur_layer: Recur, carry: Any) -> tuple[jax.Array, Any]:
        lin = self.lin
        b, t, _ = x.shape
        nk, r = lin.num_k_heads, lin.num_v_heads // lin.num_k_heads
        dk, dv = lin.head_k_dim, lin.head_v_dim
        qkvz = self.in_proj_qkvz(x).reshape(b, t, nk, 2 * dk + 2 * r * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v, z = qkvz[..., 2 * dk : 2 * dk + r * dv], qkvz[..., 2 * dk + r * dv :]
        ba = self.in_proj_ba(x).reshape(b, t, nk, 2 * r).astype(jnp.float32)
        beta = jax.nn.sigmoid(ba[..., :r].reshape(b, t, lin.num_v_heads))
        a = ba[..., r:].reshape(b, t, lin.num_v_heads)
        dt_bias = self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + dt_bias)
        qkv = jnp.concatenate(
            [q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1
        ).astype(jnp.float32)
        init = {
            "conv": jnp.zeros((lin.conv_kernel - 1, lin.conv_dim), jnp.float32),
            "ssm": jnp.zeros((lin.num_v_heads, dk, dv), jnp.float32),
        }
        w = self.conv1d[...][:, 0, :]
        xs = {"qkv": qkv, "g": g, "beta": beta}
        chunk = (chunk_size(), delta_rule_chunk(lin, w))
        o, carry = recur_layer(delta_rule_step(lin, w), init, xs, carry, chunk=chunk)
        # the gated RMSNorm: rmsnorm(o) * w (in the model dtype) * silu(z)
        o = self.norm[...] * rms_normalize(o, self.eps).astype(x.dtype)
        z = z.reshape(b, t, lin.num_v_heads, dv).astype(jnp.float32)
        o = (o.astype(jnp.float32) * jax.nn.silu(z)).astype(x.dtype)
        return self.out_proj(o.reshape(b, t, lin.value_dim)), carry


def gated_deltanet_weights(mod: GatedDeltaNet, p: str, i: int) -> dict[str, tuple]:
    """The Hugging Face names of one layer's Gated DeltaNet weights (prefix ``p``)."""
    q = p + "linear_attn."
    return {
        q + "in_proj_qkvz.weight": (mod.in_proj_qkvz, "kernel", True, i),
        q + "in_proj_ba.weight": (mod.in_proj_ba, "kernel", True, i),
        q + "conv1d.weight": (mod, "conv1d", False, i),
        q + "dt_bias": (mod, "dt_bias", False, i),
        q + "A_log": (mod, "A_log", False, i),
        q + "norm.weight": (mod, "norm", False, i),
        q + "out_proj.weight": (mod.out_proj, "kernel", True, i),
    }
