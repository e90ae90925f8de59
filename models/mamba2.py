"""Mamba2 (the SSD mixer of Granite 4.0-H and other hybrids) in Flax NNX: a recurrent
layer whose state per sequence is fixed, however long the context.

Per token: ``in_proj`` gives a gate ``z``, ``xBC`` (through a causal depthwise conv with
bias and SiLU: ``x`` ``(heads, head_dim)``, ``B`` and ``C`` ``(groups, d_state)``, each
group serving ``heads / groups`` heads) and ``dt`` (``softplus(dt + dt_bias)``, clamped to
``time_step_limit``). With ``A = -exp(A_log)`` the state ``S`` ``(heads, head_dim,
d_state)`` follows

    S = exp(dt A) S + dt x B^T;   y = S C + D x

and the output is ``out_proj(grouped_rmsnorm(y * silu(z)) * w)``. A sequence carries the
conv window and ``S``. :func:`mamba2_step` is the per-token update (decode),
:func:`mamba2_chunk` the chunked form (SSD's, as transformers' ``mamba2_chunk_scan``
writes it) for prefill chunks; both run through the ``recur`` seam.
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
class Mamba2Config:
    """A Mamba2 mixer's shape (Granite's ``mamba_*`` fields)."""

    num_heads: int
    head_dim: int
    num_groups: int
    d_state: int
    d_conv: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_min: float = 0.0
    time_step_max: float = float("inf")

    def __post_init__(self) -> None:
        for f in ("num_heads", "head_dim", "num_groups", "d_state"):
            if getattr(self, f) <= 0:
                raise ValueError(f"mamba2: {f} must be positive")
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba2: mamba_n_heads {self.num_heads} is not a multiple of "
                             f"mamba_n_groups {self.num_groups}")  # fmt: skip
        if self.d_conv < 2:
            raise ValueError(f"mamba2: mamba_d_conv {self.d_conv} < 2")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.num_groups * self.d_state

    @property
    def state_elems(self) -> int:
        """Values of one sequence's state in one layer: the conv window and ``S``."""
        return (self.d_conv - 1) * self.conv_dim + self.num_heads * self.head_dim * self.d_state


def mamba2_from_hf(cfg: dict[str, Any]) -> Mamba2Config:
    """The Mamba2 fields of a Granite 4.0-H config.json."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["mamba_n_heads"])
    inner = int(cfg.get("mamba_expand", 2)) * hidden
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in ("auto", None) else int(head_dim)
    if head_dim * heads != inner:
        raise ValueError(f"mamba2: mamba_n_heads {heads} x mamba_d_head {head_dim} is not "
                         f"mamba_expand x hidden_size = {inner}")  # fmt: skip
    # (transformers 5 writes infinity as {"__float__": "Infinity"})
    lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v)
              for v in cfg.get("time_step_limit") or (0.0, float("inf")))  # fmt: skip
    return Mamba2Config(
        num_heads=heads, head_dim=head_dim, num_groups=int(cfg.get("mamba_n_groups", 1)),
        d_state=int(cfg["mamba_d_state"]), d_conv=int(cfg.get("mamba_d_conv", 4)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        time_step_min=float(lo), time_step_max=float(hi),
    )  # fmt: skip


def _conv_xbc(m: Mamba2Config, w: jax.Array, b: jax.Array, window: jax.Array):
    """The conv (taps ``w`` ``(d_conv, conv_dim)``, bias ``b``) and SiLU over a window of
    ``d_conv - 1 + n`` inputs: ``n`` tokens' x ``(n, heads, head_dim)`` and B, C
    ``(n, heads, d_state)`` (each group's repeated to its heads)."""
    y = causal_conv(window, w, b)
    n = y.shape[0]
    gs, r = m.num_groups * m.d_state, m.num_heads // m.num_groups
    x = y[:, : m.d_inner].reshape(n, m.num_heads, m.head_dim)
    bb = y[:, m.d_inner : m.d_inner + gs].reshape(n, m.num_groups, m.d_state)
    cc = y[:, m.d_inner + gs :].reshape(n, m.num_groups, m.d_state)
    return x, jnp.repeat(bb, r, axis=1), jnp.repeat(cc, r, axis=1)


def mamba2_step(m: Mamba2Config, w: jax.Array, b: jax.Array, a: jax.Array, d: jax.Array):
    """The per-token update of one sequence: ``step(state, x) -> (state, y)`` with state
    ``{"conv": (d_conv - 1, conv_dim), "ssm": (heads, head_dim, d_state)}``, x
    ``{"xbc": (conv_dim,), "dt": (heads,)}`` (float32, ``dt`` discretized) and ``y``
    ``(heads, head_dim)``; ``a`` = A ``(heads,)``, ``d`` = D."""

    def step(state, x):
        window, conv = conv_window(state["conv"], x["xbc"][None], 1)
        xh, bh, ch = (v[0] for v in _conv_xbc(m, w, b, window))
        dt = x["dt"]
        s = state["ssm"] * jnp.exp(dt * a)[:, None, None]
        s = s + (dt[:, None] * xh)[:, :, None] * bh[:, None, :]
        y = jnp.einsum("hpn,hn->hp", s, ch) + d[:, None] * xh
        return {"conv": conv, "ssm": s}, y

    return step


def mamba2_chunk(m: Mamba2Config, w: jax.Array, b: jax.Array, a: jax.Array, d: jax.Array):
    """The chunked form of :func:`mamba2_step`: ``chunk(state, xs, n) -> (state, y)``
    over ``C`` tokens of which the first ``n`` count (the others: ``dt`` 0, no decay and
    no input). Within the chunk ``y = (C B^T * L) (dt x) + exp(cumsum(dt A)) C S0 + D x``
    with ``L`` the decays between positions."""

    def chunk(state, x, n):
        c = x["xbc"].shape[0]
        window, conv = conv_window(state["conv"], x["xbc"], n)
        xh, bh, ch = _conv_xbc(m, w, b, window)  # (C, H, P) (C, H, N) (C, H, N)
        dt = jnp.where((jnp.arange(c) < n)[:, None], x["dt"], 0.0)  # (C, H)
        acum = jnp.cumsum(dt * a, axis=0)  # (C, H)
        decay = decay_matrix(acum.T)  # (H, l, s)
        xdt = xh * dt[..., None]
        g = jnp.einsum("lhn,shn->hls", ch, bh) * decay
        s0 = state["ssm"]
        y = jnp.einsum("hls,shp->lhp", g, xdt)
        y = y + jnp.einsum("lhn,hpn->lhp", ch, s0) * jnp.exp(acum)[..., None]
        y = y + d[None, :, None] * xh
        last = acum[-1]
        s = s0 * jnp.exp(last)[:, None, None] + jnp.einsum(
            "shn,shp,sh->hpn", bh, xdt, jnp.exp(last[None] - acum)
        )
        return {"conv": conv, "ssm": s}, y

    return chunk


class Mamba2Mixer(nnx.Module):
    """A Mamba2 mixer with Hugging Face's parameter names and layouts (Granite 4.0-H's
    ``mamba``: ``conv1d.weight`` ``(conv_dim, 1, d_conv)``, ``norm.weight`` over
    ``d_inner`` in ``num_groups`` groups)."""

    def __init__(self, hidden: int, m: Mamba2Config, eps: float, dtype: Any,
                 rngs: nnx.Rngs) -> None:  # fmt: skip
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.in_proj = nnx.Linear(hidden, m.d_inner + m.conv_dim + m.num_heads,
                                  use_bias=m.proj_bias, **kw)  # fmt: skip
        init = nnx.initializers.lecun_normal()
        self.conv1d = nnx.Param(init(rngs.params(), (m.conv_dim, 1, m.d_conv), dtype))
        self.conv_bias = nnx.Param(jnp.zeros((m.conv_dim,), dtype)) if m.conv_bias else None
        self.dt_bias = nnx.Param(jnp.ones((m.num_heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, m.num_heads + 1, dtype=jnp.float32)
                                       ).astype(dtype))  # fmt: skip
        self.D = nnx.Param(jnp.ones((m.num_heads,), dtype))
        self.norm = nnx.Param(jnp.ones((m.d_inner,), dtype))
        self.out_proj = nnx.Linear(m.d_inner, hidden, use_bias=m.proj_bias, **kw)
        self.m = m
        self.eps = eps

    def __call__(self, x: jax.Array, recur_layer: Recur, carry: Any) -> tuple[jax.Array, Any]:
        m = self.m
        bsz, t, _ = x.shape
        proj = self.in_proj(x)
        z = proj[..., : m.d_inner]
        xbc = proj[..., m.d_inner : m.d_inner + m.conv_dim].astype(jnp.float32)
        dt = proj[..., m.d_inner + m.conv_dim :].astype(jnp.float32)
        dt = jax.nn.softplus(dt + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, m.time_step_min, m.time_step_max)
        w = self.conv1d[...][:, 0, :].astype(jnp.float32).T
        b = (jnp.zeros((m.conv_dim,), jnp.float32) if self.conv_bias is None
             else self.conv_bias[...].astype(jnp.float32))  # fmt: skip
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        d = self.D[...].astype(jnp.float32)
        init = {
            "conv": jnp.zeros((m.d_conv - 1, m.conv_dim), jnp.float32),
            "ssm": jnp.zeros((m.num_heads, m.head_dim, m.d_state), jnp.float32),
        }
        chunk = (chunk_size(), mamba2_chunk(m, w, b, a, d))
        y, carry = recur_layer(mamba2_step(m, w, b, a, d), init, {"xbc": xbc, "dt": dt}, carry,
                               chunk=chunk)  # fmt: skip
        # the gated norm (gate first): rmsnorm over each group of y * silu(z), times w
        y = y.reshape(bsz, t, m.d_inner) * jax.nn.silu(z.astype(jnp.float32))
        y = rms_normalize(y.reshape(bsz, t, m.num_groups, -1), self.eps).reshape(bsz, t, -1)
        y = self.norm[...] * y.astype(x.dtype)
        return self.out_proj(y), carry


def mamba2_weights(mod: Mamba2Mixer, q: str, i: int) -> dict[str, tuple]:
    """The Hugging Face names of one layer's Mamba2 weights (prefix ``q``, e.g.
    ``model.layers.N.mamba.``)."""
    t = {
        q + "in_proj.weight": (mod.in_proj, "kernel", True, i),
        q + "conv1d.weight": (mod, "conv1d", False, i),
        q + "dt_bias": (mod, "dt_bias", False, i),
        q + "A_log": (mod, "A_log", False, i),
        q + "D": (mod, "D", False, i),
        q + "norm.weight": (mod, "norm", False, i),
        q + "out_proj.weight": (mod.out_proj, "kernel", True, i),
    }
    if mod.conv_bias is not None:
        t[q + "conv1d.bias"] = (mod, "conv_bias", False, i)
    if mod.in_proj.bias is not None:
        t[q + "in_proj.bias"] = (mod.in_proj, "bias", False, i)
        t[q + "out_proj.bias"] = (mod.out_proj, "bias", False, i)
    return t
