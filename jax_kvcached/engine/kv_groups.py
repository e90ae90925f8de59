"""KV cache groups of a model: layers that attend alike share one block table.

Every layer declares its kind (``ModelConfig.layer_windows()``: 0 for full attention, W
for a sliding window of W tokens, :data:`RECURRENT` for a layer that carries a
recurrent state instead of K/V: Gated DeltaNet, Mamba). Layers of one kind and window
form a group (full attention first, then windows ascending, the recurrent layers last);
each group gets its own block ids and block tables over one KV cache
(``memory.kv_group``), so a sliding group can give back the blocks that fall out of its
window while the full layers keep theirs, and a recurrent group holds one fixed-size
state slot per sequence (``engine.state_slots``) whatever its length.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_kvcached.models.interface import RECURRENT

__all__ = ["RECURRENT", "kv_cache_groups"]


def kv_cache_groups(
    windows: Sequence[int], *, merge_windows: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(each layer's group id, each group's window)`` for per-layer windows (0: full,
    :data:`RECURRENT`: a state layer). ``merge_windows``: every attention layer in one
    full-attention group (the recurrent layers keep theirs)."""
    ws = [int(w) for w in windows]
    if any(w < RECURRENT for w in ws):
        raise ValueError(
            f"a layer's window must be >= 0 (0: full attention), got {sorted(set(ws))}"
        )
    if merge_windows:
        ws = [w if w == RECURRENT else 0 for w in ws]
    # full (0) first, windows ascending, the recurrent group last
    kinds = sorted(set(ws), key=lambda w: (w == RECURRENT, w))
    index = {w: g for g, w in enumerate(kinds)}
    return tuple(index[w] for w in ws), tuple(kinds)
