"""jit-friendly wrappers of the XLA FFI custom calls, and how to order them.

Every op takes and returns a *token* (an int32 scalar). The custom calls have side
effects on the KV buffer that XLA cannot see, so ordering is explicit:

* An op runs after everything its operands depend on: pass the previous op's token in to
  chain ops, and pass the results of earlier reads that it must not overtake as ``*after``
  operands. Thread the last token from one jitted step into the next so PJRT orders the
  steps by data dependency.
* A read of ``cache.view`` that must see an op's effect indexes the view with indices
  passed through :func:`after`. A token's value is always 0 and ``after`` adds it, so the
  read depends on the op by data flow. (``jax.lax.optimization_barrier`` on the view is
  not enough: with JAX 0.10.2 on CPU, XLA dropped it and scheduled the read first.)
* :func:`unmap_pages` takes the reads of the pages as ``*after`` operands, so the unmap
  cannot run before them. On CUDA the handler also waits for the stream.

Slots are ``block_id * block_size + offset``; slot -1 skips a (padded) token.

A cache split over a mesh (tensor parallelism) takes per-device operands: call the ops
inside ``jax.shard_map`` over the cache's mesh with each device's slice of the KV heads
(``cache.shard_kv_heads``); each device's call finds that device's buffer through the
handle and the device ordinal XLA passes the handler. ``map_pages`` / ``unmap_pages``
then act on each device separately; :meth:`KVCache.alloc` maps on every device in
lockstep, all or nothing.

``write_kv`` and ``copy_blocks`` are dataflow ops by default: XLA keeps them because their
token is used. ``map_pages`` and ``unmap_pages`` are always side-effecting calls.

Inside a jitted function the ops need the cache's *view as an argument* of that function
(``view=``; eagerly ``cache.view`` is used): a view closed over would enter the program
as a constant, a snapshot of the buffer, so it is refused at trace time. On the host
backend the view is the custom calls' first operand and the handlers find the cache by
its address: a compiled step holds no handle, so every cache of one layout runs (and the
persistent compilation cache keeps) the same program; a copy of the view is refused. On
CUDA the handlers take the cache's handle as an attribute.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcached.memory import _C, ffi_targets

ffi_targets.register()  # (done on import; named here: the ops need the targets)

if TYPE_CHECKING:
    from jax_kvcached.memory.kv_cache import KVCache

_TOKEN = jax.ShapeDtypeStruct((), jnp.int32)

# The CUDA handlers XLA may capture into a command buffer (CUDA graph), declared with
# ``kCmdBufferCompatible``: those whose every call launches the same device work (all
# per-step checks on the device). See :func:`handler_traits`.
COMMAND_BUFFER_OPS = frozenset({"write_kv_async"})


def handler_traits(platform: str) -> dict[str, dict[str, Any]]:
    """What each custom call's handler on ``platform`` (``cpu``, ``cuda``) declares to
    XLA: ``api_version`` (the FFI headers it was built with), ``traits`` and
    ``command_buffer_compatible``. Raises ValueError for a platform this build lacks."""
    table = _C.handlers.get(platform)
    if table is None:
        raise ValueError(f"this build has no {platform!r} handlers (has {sorted(_C.handlers)})")
    return {op: _C.handler_metadata(capsule) for op, capsule in table.items()}


def new_token(device: Any = None) -> jax.Array:
    """A fresh token to start a chain of ops, committed to ``device`` when given (a step
    that threads tokens then sees the same argument placement every call and never
    recompiles for it)."""
    token = jnp.zeros((), jnp.int32)
    return token if device is None else jax.device_put(token, device)


# Under jax.vmap every op runs once per batch element, in order (the handlers take
# unbatched operands and validate their shapes; a batched map / write is a sequence).
VMAP_METHOD = "sequential"


def after(indices: Any, token: jax.Array) -> jax.Array:
    """Returns integer ``indices`` (block tables, slots, layer ids...) made dependent on
    the op that produced ``token``: a gather from ``cache.view`` with them runs after it.
    """
    indices = jnp.asarray(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"after() orders integer index arrays, got {indices.dtype}; index the view "
            "with indices passed through after() instead"
        )
    return indices + token.astype(indices.dtype)


def _handle(op: str, cache: KVCache) -> np.uint64:
    """The cache's registry handle as the handlers' attribute. Registry handles are in
    [1, 2**63); anything else (a made-up or corrupted handle) is a ValueError here rather
    than a failure inside XLA's attribute encoding."""
    h = getattr(cache, "handle", None)
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 < int(h) < 1 << 63:
        raise ValueError(f"jax_kvcached.{op}: unknown or invalid KV cache handle {h!r}")
    return np.uint64(h)


def staging(operands: tuple) -> bool:
    """Whether an op with these operands is being traced into a program (jit, shard_map):
    a concrete array used there becomes a constant of the program. Eager ``vmap`` is not
    (its unbatched arrays stay the buffers they are). Without JAX's trace-stack query, any
    traced operand counts (never missing a snapshot)."""
    if not any(isinstance(x, jax.core.Tracer) for x in operands):
        return False
    try:
        from jax._src.core import unsafe_am_i_under_a_jit
    except ImportError:  # pragma: no cover - another JAX
        return True
    return unsafe_am_i_under_a_jit()


def _view_operand(op: str, cache: KVCache, view: Any, operands: tuple) -> Any:
    """The view an op reads or writes: ``view``, or eagerly ``cache.view``. Inside a
    traced program the view must be traced too, an argument of the jitted function."""
    if view is None:
        view = cache.view
    if not isinstance(view, jax.core.Tracer) and staging(operands):
        raise ValueError(
            f"jax_kvcached.{op}: the KV cache's view would be a constant of this jitted "
            f"function (a snapshot of {cache.name!r}'s buffer, not what the ops write): pass "
            "the cache to the function as an argument (or cache.view, given to the op as "
            "view=)"
        )
    return view


def _call(
    op: str,
    cache: KVCache,
    view: Any,
    *operands: Any,
    side_effect: bool = True,
    result: Any = None,
    **attrs: Any,
) -> jax.Array:
    """The custom call ``kvcached_<op>``: on the host backend the view leads its operands;
    on CUDA the handle is an attribute."""
    view = _view_operand(op, cache, view, operands)
    handle = _handle(op, cache)  # (checked on every backend)
    if cache.backend == "host":
        operands = (view, *operands)
    else:
        attrs["handle"] = handle
    return jax.ffi.ffi_call(
        f"kvcached_{op}", _TOKEN if result is None else result, has_side_effect=side_effect,
        vmap_method=VMAP_METHOD,
    )(*operands, **attrs)  # fmt: skip


def _ids(x: Any, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got {x.dtype}")
    return x.astype(jnp.int32)


def _heads_error(op: str, cache: KVCache, heads: int) -> str:
    """Why an operand with all the KV heads of a split cache is refused ("" otherwise:
    the shape checks name any other mismatch)."""
    if cache.shard_kv_heads != cache.num_kv_heads and heads == cache.num_kv_heads:
        return (
            f"{op}: {cache.name!r} is split over {cache.tensor_parallel} devices; call the op "
            f"inside jax.shard_map with each device's {cache.shard_kv_heads} KV heads"
        )
    return ""


def _check_kv(cache: KVCache, key: jax.Array, value: jax.Array, slots: Any) -> jax.Array:
    slots = _ids(slots, "slots")
    want = (slots.shape[0], cache.shard_kv_heads, cache.head_dim)
    for name, x in (("key", key), ("value", value)):
        if x.ndim in (3, 4) and (why := _heads_error("write_kv", cache, x.shape[-2])):
            raise ValueError(why)
        if tuple(x.shape[-3:]) != want or x.ndim not in (3, 4):
            raise ValueError(
                f"write_kv: {name} has shape {tuple(x.shape)}, expected {want} or (layers, *{want})"
            )
        if x.dtype != cache.dtype:
            raise TypeError(f"write_kv: {name} dtype {x.dtype} != cache dtype {cache.dtype}")
    if key.shape != value.shape:
        raise ValueError(f"write_kv: key {key.shape} and value {value.shape} differ")
    return slots


def write_kv(
    cache: KVCache,
    layer: Any,
    key: jax.Array,
    value: jax.Array,
    slots: Any,
    token: jax.Array,
    *after: jax.Array,
    side_effect: bool = False,
    view: Any = None,
) -> jax.Array:
    """Scatters new K/V into ``slots``: one layer's, ``(n, num_kv_heads, head_dim)`` each,
    or ``m`` consecutive layers' from ``layer`` on, ``(m, n, num_kv_heads, head_dim)``
    each (one custom call for all layers: cheaper than ``m`` calls).

    Every slot must be -1 or lie in a mapped page outside the null block 0; otherwise the
    call fails with an FFI error (nothing is written). A latent cache (``cache.latent``,
    one plane) stores ``key`` only: pass the latent as both ``key`` and ``value``.

    The returned token must reach the jitted function's outputs (directly, or through
    later ops / :func:`after`): XLA drops a call whose token is unused. Pass
    ``side_effect=True`` to keep the call regardless; on XLA CPU that costs about 170 us
    per execution (benchmarks/bench_vmm.py measures it).
    """
    slots = _check_kv(cache, key, value, slots)
    layer = jnp.asarray(layer, dtype=jnp.int32)
    if layer.ndim != 0:
        raise ValueError("write_kv: layer must be a scalar")
    return _call(
        "write_kv", cache, view, layer, key, value, slots, token, *after, side_effect=side_effect
    )


def write_kv_async(
    cache: KVCache,
    layer: Any,
    key: jax.Array,
    value: jax.Array,
    slots: Any,
    token: jax.Array,
    *after: jax.Array,
    view: Any = None,
) -> jax.Array:
    """:func:`write_kv` for a step loop that never waits for the device: on CUDA the
    layer and the slots are checked by the kernel (against the cache's layers and device
    page map) instead of being copied to the host. A bad slot's row (or a bad layer's
    whole write) is skipped and recorded; :func:`raise_device_errors` raises it at the
    caller's next host sync. ``layer``: a Python int (checked here) or an int32 scalar
    array, traced or not (the loop index of layers under ``jax.lax.scan``). Callers
    validate slots on the host first (the runner does). On the host backend the handler
    validates at once, as :func:`write_kv`."""
    num_layers = key.shape[0] if key.ndim == 4 else 1
    layer = _layer_operand("write_kv_async", cache, layer, num_layers)
    slots = _check_kv(cache, key, value, slots)
    return _call("write_kv_async", cache, view, layer, key, value, slots, token, *after,
                 side_effect=False)  # fmt: skip


def _layer_operand(op: str, cache: KVCache, layer: Any, num_layers: int = 1) -> jax.Array:
    """``layer`` as the int32 scalar operand of a custom call: a Python int is checked
    against the cache's layers here; an array (possibly traced) is checked by the
    handler."""
    if isinstance(layer, numbers.Integral) and not isinstance(layer, bool):
        if not 0 <= layer <= cache.num_layers - num_layers:
            extra = f" (+{num_layers} layers)" if num_layers > 1 else ""
            raise ValueError(f"{op}: layer {layer}{extra} out of range [0, {cache.num_layers})")
    return _int32_scalar(op, "layer", layer)


def _int32_scalar(op: str, name: str, x: Any) -> jax.Array:
    """A Python int or an int32 scalar array (possibly traced) as an int32 operand;
    anything else (a bool, a float, another dtype or shape) is a TypeError."""
    if isinstance(x, bool):
        raise TypeError(f"{op}: {name} must be an int or an int32 scalar array, got bool")
    if isinstance(x, numbers.Integral):
        return jnp.int32(x)
    if not hasattr(x, "dtype") or getattr(x, "shape", None) != ():
        raise TypeError(
            f"{op}: {name} must be an int or an int32 scalar array, got {type(x).__name__} "
            f"of shape {getattr(x, 'shape', None)}"
        )
    if x.dtype != jnp.int32:
        raise TypeError(f"{op}: {name} must be int32, got {x.dtype}")
    return x


_DEVICE_ERRORS = {
    1: "is out of range",
    2: "is in the null block 0, which is never written",
    3: "is in a block that straddles two pages",
    4: "is in an unmapped page",
    5: "is out of the cache's layers",  # (the "slot" recorded is the layer)
}


def raise_device_errors(cache: KVCache) -> None:
    """Raises (once) what :func:`write_kv_async` kernels recorded: the first bad slot
    and why; its row was not written. Synchronous: call at a host sync point."""
    code, slot = cache.take_device_error()
    if code:
        why = _DEVICE_ERRORS.get(code, f"failed (code {code})")
        what, skipped = ("layer", "the write") if code == 5 else ("slot", "the row")
        raise RuntimeError(
            f"write_kv_async on {cache.name!r}: {what} {slot} {why}; {skipped} was skipped "
            "(checked on the device)"
        )


def copy_blocks(
    cache: KVCache,
    src: Any,
    dst: Any,
    token: jax.Array,
    *after: jax.Array,
    side_effect: bool = False,
    group: int = 0,
    view: Any = None,
) -> jax.Array:
    """Copies whole blocks ``src[i] -> dst[i]`` of KV cache group ``group`` in every
    plane of its layers (block ids are per group; an all-full-attention cache has one).

    Destinations must be distinct, mapped in the group, not block 0 and not among the
    sources. The token rule of :func:`write_kv` applies.
    """
    src, dst = _ids(src, "src"), _ids(dst, "dst")
    if src.shape != dst.shape:
        raise ValueError(f"copy_blocks: src {src.shape} and dst {dst.shape} differ in length")
    if isinstance(group, bool) or not isinstance(group, numbers.Integral):
        raise TypeError(f"copy_blocks: group must be an int, got {group!r}")
    if not 0 <= group < cache.num_groups:
        raise ValueError(f"copy_blocks: group {group} out of range [0, {cache.num_groups})")
    return _call("copy_blocks", cache, view, src, dst, token, *after, side_effect=side_effect,
                 group=np.int64(group))  # fmt: skip


def map_pages(
    cache: KVCache, page_ids: Any, token: jax.Array, *after: jax.Array, view: Any = None
) -> jax.Array:
    """Maps KV pages (each in all layer planes) from the pool, inside a computation.

    For callers that manage pages themselves: pages mapped here are not known to the
    cache's block allocator (:meth:`KVCache.alloc` maps its own pages).
    """
    return _call("map_pages", cache, view, _ids(page_ids, "page_ids"), token, *after)


def unmap_pages(
    cache: KVCache, page_ids: Any, token: jax.Array, *after: jax.Array, view: Any = None
) -> jax.Array:
    """Unmaps KV pages once ``token`` and every array in ``after`` are computed.

    Pass the results of reads of those pages as ``after`` so the unmap cannot overtake
    them. The pages read zeros afterwards.
    """
    return _call("unmap_pages", cache, view, _ids(page_ids, "page_ids"), token, *after)


def paged_attention(
    cache: KVCache,
    layer: Any,
    q: jax.Array,
    block_tables: Any,
    kv_lens: Any,
    q_start: Any,
    q_lens: Any,
    token: jax.Array,
    window: Any = 0,
    sinks: Any = None,
    view: Any = None,
) -> jax.Array:
    """Ragged causal attention over the paged cache: a host-platform custom call,
    multi-threaded, that reads K/V in place (no gathered copy). All float32.

    ``q`` ``(T, Hkv, G, D)`` holds the query rows of up to ``S`` sequences on one flat token
    axis: sequence ``s`` owns rows ``q_start[s] .. q_start[s] + q_lens[s] - 1``, the queries
    at positions ``kv_lens[s] - q_lens[s] ..  kv_lens[s] - 1``; each sees its sequence's
    cached tokens at positions up to its own, through ``block_tables`` ``(S, nb)``. The
    step's own K/V must already be written (``token`` orders the call after that write).
    ``window`` > 0 (an int or an int32 scalar, traced or not; 0: none): a query at
    position p sees only keys above ``p - window`` (sliding-window attention); blocks
    wholly below every row's window are neither read nor checked (a window's freed
    blocks may be the null block). Rows of no sequence come back 0. Returns
    ``(T, Hkv, G, D)``. A latent cache is its own values: the result is the softmax-weighted
    sum of the latents (all ``D`` values; MLA keeps the first ``kv_lora_rank``).
    ``sinks`` ``(Hkv * G,)`` float32: a learned logit per query head added to the softmax's
    denominator (attention sinks, GPT-OSS); None: none.

    Ranges that leave the token axis or overlap, ``q_lens > kv_lens``, and blocks under
    ``kv_lens`` that are not mapped blocks of this cache fail with an FFI error. Host
    backend only (CPU).
    """
    t, kvh, g, d = q.shape
    if why := _heads_error("paged_attention", cache, kvh):
        raise ValueError(why)
    if (kvh, d) != (cache.shard_kv_heads, cache.head_dim) or q.dtype != jnp.float32:
        raise ValueError(
            f"paged_attention: q must be float32 (T, {cache.shard_kv_heads}, G, "
            f"{cache.head_dim}), got {q.dtype} {tuple(q.shape)}"
        )
    layer = _layer_operand("paged_attention", cache, layer)
    if isinstance(window, bool) or (isinstance(window, numbers.Integral) and window < 0):
        raise ValueError(f"paged_attention: window must be >= 0 (0: none), got {window!r}")
    window = _int32_scalar("paged_attention", "window", window)
    if sinks is None:
        sinks = jnp.zeros((0,), jnp.float32)
    else:
        sinks = jnp.asarray(sinks)
        if sinks.size != kvh * g or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"paged_attention: sinks must hold one float per query head "
                             f"({kvh * g}), got {sinks.dtype} {tuple(sinks.shape)}")  # fmt: skip
        sinks = sinks.reshape(-1).astype(jnp.float32)
    if cache.backend != "host":
        raise ValueError(f"paged_attention: {cache.name!r} is a {cache.backend} cache; this "
                         "custom call runs on the host backend (CPU)")  # fmt: skip
    i32 = jnp.int32
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return _call(
        "paged_attention", cache, view, layer, window, q, jnp.asarray(block_tables, i32),
        jnp.asarray(kv_lens, i32), jnp.asarray(q_start, i32), jnp.asarray(q_lens, i32), sinks,
        token, side_effect=False, result=out, scale=np.float32(1 / np.sqrt(d)),
    )  # fmt: skip
