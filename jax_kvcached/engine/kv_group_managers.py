"""One manager per KV-cache-group type: the rules that differ between attention kinds.

vLLM's ``single_type_kv_cache_manager.py`` is the model. Each KV cache group of a model
(``engine/kv_groups.py``) gets one manager of its type; the
:class:`~jax_kvcached.engine.kv_manager.KVManager` asks every manager the same questions
and never branches on a type:

- :meth:`KVGroupManager.first_needed_block`: the first block a query at a position sees;
- :meth:`KVGroupManager.hit_length`: the longest prefix hit (in blocks) the group can
  serve, given which of its blocks are cached (its *hit rule*);
- :meth:`KVGroupManager.blocks_needed`: blocks a sequence of so many blocks holds at once;
- :meth:`KVGroupManager.remove_skipped_blocks`: what a sequence lets go of as it advances;
- how a hit is looked up, restored and shortened (:meth:`~KVGroupManager.hit_lookup`,
  :meth:`~KVGroupManager.serves`, :meth:`~KVGroupManager.kept`,
  :meth:`~KVGroupManager.start`), and the life events of a sequence in the group
  (:meth:`~KVGroupManager.admitted`, :meth:`~KVGroupManager.planned`,
  :meth:`~KVGroupManager.computed`, :meth:`~KVGroupManager.release_sequence`).

What every type shares lives in the base class: a table's blocks are held, shared with a
fork and released through the group's :class:`~jax_kvcached.engine.block_pool.BlockPool`
(the one reference count per block: a block whose last holder lets go stays cached, idle,
or is freed). A new group type (an MLA latent plane, a recurrent state slot) is one new class.

Types: :class:`FullAttentionManager` (every block of the context, a hit is a contiguous
prefix), :class:`SlidingWindowManager` (only the blocks of the last ``window``
positions: blocks wholly below it leave the table, the null block 0 in their place, and
are freed unless another sequence holds them; a hit needs only the last window's blocks
before the hit point) and :class:`RecurrentStateManager` (a state slot per sequence,
whatever its length; a hit needs a state checkpoint at the hit point; it owns its
checkpoints, below).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from jax_kvcached.engine.block_pool import BlockPool
from jax_kvcached.engine.prefix_cache import PrefixCache
from jax_kvcached.engine.sequence import Sequence as Seq
from jax_kvcached.models.interface import KVSpec


@dataclasses.dataclass(frozen=True)
class GroupServices:
    """What a manager asks of the KV manager, bound to the manager's group."""

    # New blocks, held once, evicting idle prefixes or asking other tenants for room
    # (None: no memory without preempting).
    alloc: Callable[[int], list[int] | None]
    has: Callable[[bytes], bool]  # the group can serve this key (device or host tier)
    wrote: Callable[[int], None]  # the newest step wrote this cached block (host tier)
    events: Any = None  # a kv_events.KVEventLog to describe stored blocks to (or None)


log = logging.getLogger("jax_kvcached.engine.kv_manager")

_NO_SERVICES = GroupServices(lambda n: None, lambda h: False, lambda b: None)


class KVGroupManager(abc.ABC):
    """The blocks of one KV cache group for the sequences of one engine.

    Args:
      group: the memory layer's group (``cache.groups[g]``).
      block_size: tokens per block.
      pool: the group's blocks and their reference counts.
    """

    kind = "abstract"
    window = 0  # tokens a query sees back (0: all)
    forkable = True  # a fork shares its parent's prompt blocks of this group

    def __init__(
        self,
        group: Any,
        block_size: int,
        pool: BlockPool,
        prefix_cache: PrefixCache | None = None,
        services: GroupServices = _NO_SERVICES,
    ) -> None:
        self.group = group
        self.index: int = group.index
        self.block_size = block_size
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.services = services

    @property
    def caching(self) -> bool:
        """Whether the group's blocks are shared through its prefix cache."""
        return self.prefix_cache is not None and self.prefix_cache.enabled

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

    # -- a hit: looked up, restored, shortened, started ----------------------------------
    def hit_lookup(self, hashes: Sequence[bytes], n: int) -> tuple[list[bytes], int, int]:
        """``(keys, upto, skip)``: a hit of ``n`` blocks takes the first ``upto`` of
        ``keys`` from the prefix cache, the first ``skip`` of them covered without a
        block (``PrefixCache.match_each``)."""
        return list(hashes), n, self.hit_start(n)

    def restored_prompt_blocks(self, indices: list[int]) -> list[int]:
        """Which restored entries are prompt blocks (counted as host-tier hits)."""
        return indices

    def serves(self, found: list[int | None], m: int, n: int) -> bool:
        """Whether the entries ``found`` for a hit of ``n`` blocks (None: not had)
        serve a hit of ``m <= n`` blocks."""
        return None not in found[self.hit_start(m) : m]

    def kept(self, found: list[int | None], m: int, n: int) -> int:
        """How many leading entries of ``found`` a hit shortened from ``n`` to ``m``
        blocks keeps (the rest are let go)."""
        return m

    def start(self, seq: Seq, found: list[int | None]) -> list[int]:
        """The sequence's table from its hit's entries (null below what it needs)."""
        return [b or 0 for b in found]

    # -- a sequence's life in the group --------------------------------------------------
    def admitted(self, seq: Seq) -> None:
        """``seq`` was admitted (after its hit was taken)."""
        return None

    def planned(self, seq: Seq, num_tokens: int, hashes: Callable[[int], list[bytes]]) -> None:
        """``seq``'s next step computes up to ``num_tokens`` tokens (blocks are had)."""
        return None

    def computed(self, seq: Seq, full: int, hashes: Callable[[int], list[bytes]]) -> None:
        """A step of ``seq`` was dispatched; its first ``full`` blocks hold known tokens
        only: those not offered yet join the prefix cache. ``hashes(k)``: the chain's
        first ``k`` hashes."""
        g, done = self.index, seq.inserted[self.index]
        if not self.caching or done >= full:
            return
        hs, table, events = hashes(full), seq.tables[g], self.services.events
        for i in range(done, full):
            if not table[i]:  # a sliding group's block already gone below the window
                continue
            if events is not None:
                events.describe(g, hs[i], hs[i - 1] if i else None,
                                seq.token_ids[i * self.block_size:][:self.block_size], seq.lora)
            if self.prefix_cache.insert(hs[i], table[i], i):
                self.services.wrote(table[i])  # (the newest step wrote it)
        seq.inserted[g] = full

    def release_sequence(self, seq: Seq) -> None:
        """``seq`` ends or is preempted: it lets go of everything it holds here."""
        self.release(seq.tables[self.index])


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
    """A state slot per sequence; a hit needs a whole checkpoint at the hit point,
    searched from the longest down, read in place by the sequence's first step (which
    writes the sequence's own slot), then idle again. A sequence takes a checkpoint
    where a step crosses its :meth:`checkpoint_at` position: the last block boundary of
    its prompt, or a multiple of ``interval`` tokens before it (so prompts that share
    only a first part still find one).

    A sequence holds one state slot of ``slot_blocks`` blocks (the same on every layer of
    the group: Gated DeltaNet, Mamba2) from admission to its end, whatever its length
    (``engine.recurrent`` runs it in the step).

    Prefix caching keeps *checkpoints*: a slot's copy at a block boundary, cached under
    :meth:`RecurrentStateManager.keys` of the hash of the prefix's last block. A
    checkpoint's life:

    1. :meth:`~RecurrentStateManager.planned` (the KV manager's ``grow``): a step that
       crosses a checkpoint position not cached yet gets blocks for it (best effort: none
       when memory is short); the step program writes the state there.
    2. :meth:`~RecurrentStateManager.computed` (once the step is dispatched): the checkpoint
       joins the prefix cache (idle; evicted, spilled and bounded like any cached block),
       and the checkpoint a hit's first step read goes back.
    3. :meth:`~RecurrentStateManager.release_sequence`: a sequence that ends or is
       preempted lets go of both, and of its slot.

    Invariant: a sequence holds at most one unwritten checkpoint (``seq.state_ck``) and one
    checkpoint it reads (``seq.state_src``); every block of either is held in the group's
    pool until the step that uses it is fenced. Checkpoints are bounded, evicted, spilled to
    the host tier and counted like any group's cached blocks: at most ``max_cached_tokens /
    block_size`` idle blocks of the group, i.e. the bytes of that many tokens of K/V on each
    of the group's layers.
    """

    kind = "recurrent"
    forkable = False  # (a state is not shared: a child runs on its own, from a hit)

    def __init__(self, *args: Any, slot_blocks: int, interval: int, **kwargs: Any) -> None:
        if slot_blocks < 1:
            raise ValueError(f"a state slot needs at least one block, got {slot_blocks}")
        super().__init__(*args, **kwargs)
        self.slot_blocks = slot_blocks
        # (a multiple of the block size: checkpoints sit on block boundaries)
        self.interval = max(1, interval // self.block_size) * self.block_size
        self.restores = 0  # preempted sequences resumed from a checkpoint
        self.recomputes = 0  # (or recomputed from token 0)

    # -- the rules -------------------------------------------------------------------
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

    # -- a hit is a checkpoint, whole or none ----------------------------------------
    def hit_lookup(self, hashes: Sequence[bytes], n: int) -> tuple[list[bytes], int, int]:
        keys = self.hit_keys(hashes, n)
        return keys, len(keys), 0

    def restored_prompt_blocks(self, indices: list[int]) -> list[int]:
        return []  # (a checkpoint's blocks are not prompt blocks)

    def serves(self, found: list[int | None], m: int, n: int) -> bool:
        return m == 0 or (m == n and None not in found)

    def kept(self, found: list[int | None], m: int, n: int) -> int:
        return len(found) if m == n else 0

    def start(self, seq: Seq, found: list[int | None]) -> list[int]:
        seq.state_src = [b for b in found if b is not None]  # what the first step reads
        return []  # (the slot is allocated by grow)

    # -- a sequence's life -----------------------------------------------------------
    def admitted(self, seq: Seq) -> None:
        """Counts and logs how a preempted sequence resumes: from a checkpoint, or
        recomputed from token 0 (its slot was not kept)."""
        if not seq.preemptions:
            return
        restored = seq.num_computed > 0
        self.restores += restored
        self.recomputes += not restored
        log.info("request %s resumes after a preemption: %s", seq.request_id,
                 f"state restored at token {seq.num_computed}" if restored
                 else "recomputed from token 0")  # fmt: skip

    def planned(self, seq: Seq, num_tokens: int, hashes: Callable[[int], list[bytes]]) -> None:
        """The checkpoint of the step up to ``num_tokens`` (:meth:`checkpoint_at`):
        blocks for it when the step crosses a checkpoint position not cached yet."""
        if not self.caching or seq.params.prompt_logprobs:
            return
        c = self.checkpoint_at(seq.num_prompt, seq.num_computed, num_tokens)
        if seq.state_ck is not None:
            if seq.state_ck[1] == c:
                return  # (planned by an earlier try of this step)
            self.pool.free_blocks(seq.state_ck[0])
            seq.state_ck = None
        if not c:
            return
        if self.services.has(self.keys(hashes(c // self.block_size)[-1])[0]):
            return  # cached already
        blocks = self.services.alloc(self.slot_blocks)
        if blocks is not None:
            seq.state_ck = (blocks, c)

    def computed(self, seq: Seq, full: int, hashes: Callable[[int], list[bytes]]) -> None:
        """The checkpoint the step read goes back to the cache (idle; a free waits for
        the step), and the checkpoint it wrote joins the cache."""
        seq.inserted[self.index] = full
        if seq.state_src:
            self.pool.free_blocks(seq.state_src)
            seq.state_src = []
        if seq.state_ck is None or seq.state_ck[1] > seq.num_computed:
            return
        blocks, c = seq.state_ck
        seq.state_ck = None
        h = hashes(c // self.block_size)[-1]
        keys, pc = self.keys(h), self.prefix_cache
        if not all(pc.block_of(k) is None for k in keys):
            self.pool.free_blocks(blocks)  # (another sequence cached it first)
            return
        events = self.services.events
        for j, (k, b) in enumerate(zip(keys, blocks, strict=True)):
            if events is not None:  # (the state after prefix h: no tokens of its own)
                events.describe(self.index, k, keys[j - 1] if j else h, (), seq.lora)
            pc.insert(k, b, j)
            self.services.wrote(b)
        self.pool.free_blocks(blocks)  # idle: the cache keeps them

    def release_sequence(self, seq: Seq) -> None:
        """Its slot, the checkpoint it reads and the one it has not written yet."""
        super().release_sequence(seq)
        if seq.state_src:
            self.pool.free_blocks(seq.state_src)
            seq.state_src = []
        if seq.state_ck is not None:
            self.pool.free_blocks(seq.state_ck[0])
            seq.state_ck = None


MANAGERS: dict[str, type[KVGroupManager]] = {
    m.kind: m for m in (FullAttentionManager, SlidingWindowManager, RecurrentStateManager)
}


def make_manager(
    spec: KVSpec,
    group: Any,
    block_size: int,
    pool: BlockPool,
    prefix_cache: PrefixCache | None = None,
    services: GroupServices = _NO_SERVICES,
    *,
    slot_blocks: int = 0,
    interval: int = 0,
) -> KVGroupManager:
    """The manager of a group of layers of ``spec``, of its kind (:data:`MANAGERS`): a
    sliding group's keeps ``spec.window`` tokens, a recurrent group's holds
    ``slot_blocks``-block state slots, checkpointed every ``interval`` tokens."""
    options: dict[str, dict[str, int]] = {
        "sliding": {"window": spec.window},
        "recurrent": {"slot_blocks": slot_blocks, "interval": interval},
    }
    return MANAGERS[spec.kind](group, block_size, pool, prefix_cache, services,
                               **options.get(spec.kind, {}))  # fmt: skip
