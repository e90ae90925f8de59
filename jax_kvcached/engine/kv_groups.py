"""KV cache groups of a model: layers that keep alike share one block table.

Every layer declares what it keeps per sequence (``ModelConfig.layer_specs()``: a
:class:`~jax_kvcached.models.interface.KVSpec` of kind ``full``, ``sliding`` with its
window, or ``recurrent`` for a layer that carries a state instead of K/V: Gated
DeltaNet, Mamba). Layers of one spec form a group (full attention first, then windows
ascending, the recurrent layers last); each group gets its own block ids and block
tables over one KV cache (``memory.kv_group``) and a manager of its kind
(``kv_group_managers``), so a sliding group can give back the blocks that fall out of
its window while the full layers keep theirs, and a recurrent group holds one
fixed-size state slot per sequence (``engine.state_slots``) whatever its length.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_kvcached.models.interface import FULL, KVSpec

__all__ = ["kv_cache_groups"]


def kv_cache_groups(
    specs: Sequence[KVSpec], *, merge_windows: bool = False
) -> tuple[tuple[int, ...], tuple[KVSpec, ...]]:
    """``(each layer's group id, each group's spec)`` for per-layer specs.
    ``merge_windows``: every attention layer in one full-attention group (the recurrent
    layers keep theirs)."""
    specs = list(specs)
    if not all(isinstance(s, KVSpec) for s in specs):
        raise TypeError(f"each layer's spec must be a KVSpec, got {specs!r}")
    if merge_windows:
        specs = [FULL if s.kind == "sliding" else s for s in specs]
    kinds = sorted(set(specs), key=lambda s: s.order)
    index = {s: g for g, s in enumerate(kinds)}
    return tuple(index[s] for s in specs), tuple(kinds)
