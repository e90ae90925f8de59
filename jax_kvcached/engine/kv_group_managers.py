"""One manager per KV-cache-group type: the rules that differ between attention kinds.

vLLM's ``single_type_kv_cache_manager.py`` is the model. Each KV cache group of a model
(``engine/kv_groups.py``) gets one manager of its type; the
:class:`~jax_kvcached.engine.kv_manager.KVManager` asks every manager the same questions
and never branches on a type:

- :meth:`KVGroupManager.first_needed_block`: the first block a query at a position sees;
- :meth:`KVGroupManager.hit_length`: the longest prefix hit (in blocks) the group can
  serve, given which of its blocks are cached (its *hit rule*);
- :meth:`KVGroupManager.blocks_needed`: blocks a sequence of so many blocks holds at once;
- :meth:`KVGroupManager.remove_skipped_blocks`: what a sequence lets go of as it advances.

What every type shares lives in the base class: a table's blocks are held, shared with a
fork and released through the group's :class:`~jax_kvcached.engine.block_pool.BlockPool`
(the one reference count per block: a block whose last holder lets go stays cached, idle,
or is freed). A new group type (an MLA latent plane, a recurrent state slot) is one new class.

Types: :class:`FullAttentionManager` (every block of the context, a hit is a contiguous
prefix), :class:`SlidingWindowManager` (only the blocks of the last ``window``
positions: blocks wholly below it leave the table, the null block 0 in their place, and
are freed unless another sequence holds them; a hit needs only the last window's blocks
before the hit point) and :class:`RecurrentStateManager` (a state slot per sequence,
whatever its length; a hit needs a state checkpoint at the hit point).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from jax_kvcached.engine.block_pool import BlockPool
from jax_kvcached.engine.kv_groups import RECURRENT


class KVGroupManager(abc.ABC):
    """The blocks of one KV cache group for the sequences of one engine.

    Args:
      group: the memory layer's group (``cache.groups[g]``).
      block_size: tokens per block.
      pool: the group's blocks and their reference counts.
    """

    kind = "abstract"
    window = 0  # tokens a query sees back (0: all)
    # A slot group: a sequence's table is a fixed state slot (not one block per block of
    # tokens) and a hit is restored from a checkpoint (see RecurrentStateManager).
    holds_slot = False

    def __init__(self, group: Any, block_size: int, pool: BlockPool) -> None:
        self.group = group
        self.index: int = group.index
        self.block_size = block_size
        self.pool = pool

    # -- the type's rules ----------------------------------------------------------------
    @abc.abstractmethod
    def first_needed_block(self, position: int) -> int:
        """The first block a query at ``position`` (or later) can see."""

    @abc.abstractmethod
    def hit_length(self, hashes: Sequence[bytes], n: int, has: Callable[[bytes], bool]) -> int:
        """The longest hit ``m <= n`` (in blocks) this group can serve for a prompt of
        block ``hashes``: ``has(h)`` tells whether it can serve block ``h`` (cached on
        the device or in its host tier)."""

    @abc.abstractmethod
    def blocks_needed(self, num_blocks: int) -> int:
        """Blocks a sequence of ``num_blocks`` blocks holds in this group at once."""

    @abc.abstractmethod
    def remove_skipped_blocks(self, table: list[int], position: int) -> None:
        """Lets go of the blocks of ``table`` no query at ``position`` or later sees."""

    # -- shared by every type ------------------------------------------------------------
    def hit_keys(self, hashes: Sequence[bytes], n: int) -> list[bytes]:
        """The prefix-cache keys a hit of ``n`` blocks takes from this group."""
        return list(hashes[self.hit_start(n) : n])

    def new_blocks(self, num_blocks: int, hit: int) -> int:
        """Blocks to allocate for a sequence of ``num_blocks`` blocks given ``hit`` of
        them from the cache."""
        return max(0, self.blocks_needed(num_blocks) - hit)

    def to_grow(self, held: int, num_blocks: int) -> int:
        """Blocks a table of ``held`` blocks adds for ``num_blocks`` blocks of tokens."""
        return num_blocks - held

    def hit_start(self, n: int) -> int:
        """The first block a hit of ``n`` blocks needs."""
        return self.first_needed_block(n * self.block_size)

    def share(self, table: Sequence[int]) -> list[int]:
        """A copy of ``table`` for a fork: its blocks gain a holder (null blocks stay)."""
        self.pool.touch(table)
        return list(table)

    def release(self, table: Sequence[int], *, keep: bool = True) -> None:
        """A sequence lets go of ``table``: blocks it held last stay cached, idle
        (unless ``keep`` is False), or are freed."""
        self.pool.free_blocks(table, keep=keep)


class FullAttentionManager(KVGroupManager):
    """Full attention: a sequence holds every block of its context; a hit is the longest
    contiguous cached prefix."""

    kind = "full"

    def first_needed_block(self, position: int) -> int:
        return 0

    def hit_length(self, hashes: Sequence[bytes], n: int, has: Callable[[bytes], bool]) -> int:
        k = 0
        while k < n and has(hashes[k]):
            k += 1
        return k

    def blocks_needed(self, num_blocks: int) -> int:
        return num_blocks

    def remove_skipped_blocks(self, table: list[int], position: int) -> None:
        return None  # every block stays visible


class SlidingWindowManager(KVGroupManager):
    """Sliding-window attention of ``window`` tokens: a sequence holds the blocks some
    future query can still see. Blocks wholly below ``position - window + 1`` leave its
    table (null block 0) and are freed, cached or not, unless another sequence holds
    them (as SGLang's SWA cache does: kept cached, a long prompt's out-of-window blocks
    would hold the memory the window is meant to give back). A hit needs the blocks of
    the last window before the hit point (vLLM's rule), searched from the longest down."""

    kind = "sliding"

    def __init__(self, *args: Any, window: int, **kwargs: Any) -> None:
        if window <= 0:
            raise ValueError(f"a sliding window must be positive, got {window}")
        super().__init__(*args, **kwargs)
        self.window = window

    def first_needed_block(self, position: int) -> int:
        return max(0, position - self.window + 1) // self.block_size

    def hit_length(self, hashes: Sequence[bytes], n: int, has: Callable[[bytes], bool]) -> int:
        while n > 0 and not all(has(h) for h in hashes[self.hit_start(n) : n]):
            n -= 1
        return n

    def blocks_needed(self, num_blocks: int) -> int:
        return min(num_blocks, -(-self.window // self.block_size) + 1)

    def remove_skipped_blocks(self, table: list[int], position: int) -> None:
        lo = min(self.first_needed_block(position), len(table))
        gone = [b for b in table[:lo] if b]
        if not gone:
            return
        table[:lo] = [0] * lo
        self.release(gone, keep=False)


class RecurrentStateManager(KVGroupManager):
    """Recurrent state (Gated DeltaNet, Mamba2 layers): a sequence holds one state slot
    of ``slot_blocks`` blocks (the same on every layer of the group) from admission to
    its end, whatever its length (``engine.recurrent``).

    Prefix caching keeps *checkpoints*: a slot's copy at a block boundary, cached under
    :meth:`keys` of the hash of the prefix's last block. A sequence takes a checkpoint
    where a step crosses its :meth:`checkpoint_at` position: the last block boundary of
    its prompt, or a multiple of ``interval`` tokens before it (so prompts that share
    only a first part still find one). A hit needs a whole checkpoint at the hit point,
    searched from the longest down; it is read in place by the sequence's first step
    (which writes the sequence's own slot), then idle again. Checkpoints are bounded,
    evicted, spilled to the host tier and counted like any group's cached blocks: at
    most ``max_cached_tokens / block_size`` idle blocks of the group, i.e. the bytes of
    that many tokens of K/V on each of the group's layers.
    """

    kind = "recurrent"
    holds_slot = True

    def __init__(self, *args: Any, slot_blocks: int, interval: int, **kwargs: Any) -> None:
        if slot_blocks < 1:
            raise ValueError(f"a state slot needs at least one block, got {slot_blocks}")
        super().__init__(*args, **kwargs)
        self.slot_blocks = slot_blocks
        # (a multiple of the block size: checkpoints sit on block boundaries)
        self.interval = max(1, interval // self.block_size) * self.block_size

    def keys(self, h: bytes) -> list[bytes]:
        """The keys of the checkpoint after the block of hash ``h``, one per block."""
        return [h + b"/state" + j.to_bytes(4, "little") for j in range(self.slot_blocks)]

    def checkpoint_at(self, num_prompt: int, start: int, end: int) -> int:
        """The checkpoint position in ``(start, end]`` (0: none): the largest block
        boundary there that is the prompt's last one (before its last token, which is
        always recomputed) or a multiple of ``interval``."""
        last = (num_prompt - 1) // self.block_size * self.block_size
        if start < last <= end:
            return last
        c = min(end, last) // self.interval * self.interval
        return c if c > start else 0

    def first_needed_block(self, position: int) -> int:
        return 0

    def hit_length(self, hashes: Sequence[bytes], n: int, has: Callable[[bytes], bool]) -> int:
        while n > 0 and not all(has(k) for k in self.keys(hashes[n - 1])):
            n -= 1
        return n

    def hit_keys(self, hashes: Sequence[bytes], n: int) -> list[bytes]:
        return self.keys(hashes[n - 1]) if n else []

    def blocks_needed(self, num_blocks: int) -> int:
        return self.slot_blocks

    def new_blocks(self, num_blocks: int, hit: int) -> int:
        return self.slot_blocks  # (a checkpoint is read, never the sequence's own slot)

    def to_grow(self, held: int, num_blocks: int) -> int:
        return self.slot_blocks - held

    def remove_skipped_blocks(self, table: list[int], position: int) -> None:
        return None  # the slot is the sequence's until it ends


def make_manager(
    window: int,
    group: Any,
    block_size: int,
    pool: BlockPool,
    *,
    slot_blocks: int = 0,
    interval: int = 0,
) -> KVGroupManager:
    """The manager of a group whose layers attend over ``window`` tokens (0: all;
    ``kv_groups.RECURRENT``: a recurrent group of ``slot_blocks``-block state slots,
    checkpointed every ``interval`` tokens)."""
    if window == RECURRENT:
        return RecurrentStateManager(group, block_size, pool, slot_blocks=slot_blocks,
                                     interval=interval)  # fmt: skip
    if window:
        return SlidingWindowManager(group, block_size, pool, window=window)
    return FullAttentionManager(group, block_size, pool)
