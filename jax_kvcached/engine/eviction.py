"""Eviction policies of the prefix cache: which idle cached block goes first.

A policy sees a cached block's life through five events (inserted, hit, idle, busy,
removed) and orders the idle ones (reference count 0) for eviction. The prefix cache
keeps the hashes and reference counts and does page-aware grouping; the policy only
decides the order. A chain's blocks become idle tail first, so a policy that breaks ties
by idle order evicts a chain from its tail and never strands a child behind its parent.

- ``lru`` (default): least recently used first.
- ``lfu``: fewest hits first, ties least recently idle first. A parent is hit whenever
  its child is, so it never ranks below it. Keeps a popular system prompt through a
  burst of one-off prompts that LRU would let push it out; the cost is that a prefix
  popular long ago stays until the unpopular ones are gone.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, block: int) -> None:
        """A block joined the cache, held by the sequence that computed it."""

    def on_hit(self, block: int) -> None:
        """A cached block was matched by a new request (it is held again)."""

    def on_idle(self, block: int) -> None:
        """Its last holder let go: the block becomes evictable."""

    def on_busy(self, block: int) -> None:
        """An idle block was taken again: no longer evictable."""

    def on_remove(self, block: int) -> None:
        """The block was evicted (it was idle)."""

    def order(self) -> Iterator[int]:
        """The idle blocks, the first to evict first (a live view: take what you need
        before evicting any)."""

    def __len__(self) -> int:
        """How many blocks are idle."""

    def __contains__(self, block: object) -> bool:
        """Whether ``block`` is idle."""


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first

    def on_insert(self, block: int) -> None:
        pass

    def on_hit(self, block: int) -> None:
        pass

    def on_idle(self, block: int) -> None:
        self._idle[block] = None

    def on_busy(self, block: int) -> None:
        self._idle.pop(block, None)

    def on_remove(self, block: int) -> None:
        del self._idle[block]

    def touch(self, block: int) -> None:
        """Marks an idle block most recently used."""
        self._idle.move_to_end(block)

    def order(self) -> Iterator[int]:
        return iter(self._idle)

    def __len__(self) -> int:
        return len(self._idle)

    def __contains__(self, block: object) -> bool:
        return block in self._idle


class LFUPolicy:
    """Fewest hits first; ties least recently idle first."""

    name = "lfu"

    def __init__(self) -> None:
        self._hits: dict[int, int] = {}  # every cached block
        self._idle: dict[int, int] = {}  # idle block -> when it became idle
        self._clock = itertools.count()

    def on_insert(self, block: int) -> None:
        self._hits[block] = 0

    def on_hit(self, block: int) -> None:
        self._hits[block] += 1

    def on_idle(self, block: int) -> None:
        self._idle[block] = next(self._clock)

    def on_busy(self, block: int) -> None:
        self._idle.pop(block, None)

    def on_remove(self, block: int) -> None:
        del self._idle[block]
        del self._hits[block]

    def hits(self, block: int) -> int:
        return self._hits[block]

    def order(self) -> Iterator[int]:
        return iter(sorted(self._idle, key=lambda b: (self._hits[b], self._idle[b])))

    def __len__(self) -> int:
        return len(self._idle)

    def __contains__(self, block: object) -> bool:
        return block in self._idle


POLICIES: dict[str, type] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by name (``lru``, ``lfu``) or the given instance."""
    if not isinstance(policy, str):
        return policy
    cls = POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"unknown eviction policy {policy!r}; have {sorted(POLICIES)}")
    return cls()
