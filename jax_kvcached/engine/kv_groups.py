"""KV cache groups of a model: layers that attend alike share one block table.

Every layer declares its attention (``ModelConfig.layer_windows()``: 0 for full
attention, W for a sliding window of W tokens). Layers of one kind and window form a
group (full attention first, then windows ascending); each group gets its own block ids
and block tables over one KV cache (``memory.kv_group``), so a sliding group can give back
the blocks that fall out of its window while the full layers keep theirs.
"""

from __future__ import annotations

from collections.abc import Sequence


def kv_cache_groups(windows: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(each layer's group id, each group's window)`` for per-layer windows (0: full)."""
    kinds = sorted(set(int(w) for w in windows))  # 0 (full) first
    if any(w < 0 for w in kinds):
        raise ValueError(f"a layer's window must be >= 0 (0: full attention), got {kinds}")
    index = {w: g for g, w in enumerate(kinds)}
    return tuple(index[int(w)] for w in windows), tuple(kinds)
