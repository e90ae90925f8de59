"""KV-cache events in vLLM's form: every block that joins or leaves a tier of the prefix
cache, for routers that keep an index of which replica holds which prefix.

The prefix caches (device tier, medium ``"GPU"``) and the host tiers (medium ``"CPU"``)
report to one :class:`KVEventLog`; the publisher (``kv_event_publisher.py``) sends what
accumulated as vLLM's ``KVEventBatch``. The events and their fields are vLLM's
(``vllm/distributed/kv_events.py``):

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)``: blocks of
  one chain (each the parent of the next) joined a tier.
- ``BlockRemoved(block_hashes, medium, group_idx)``: they left it.
- ``AllBlocksCleared()``: nothing is cached any more in any tier (in place of a reset's
  removals when it left no block held).

Invariants: each (group, hash, medium) is stored once before it is removed once; events
are in the order the caches changed; a batch never mixes media.

Hash mapping: a block's published hash is the prefix cache's own chained key, 32 bytes
of ``sha256(parent || int64 token ids || extra keys)`` (extra keys: the model, a
request's ``cache_salt``); a recurrent group's checkpoint keys (longer) are published as
``sha256(key)``. vLLM hashes ``sha256_cbor((parent, tokens, extra))`` instead, so a
consumer must not compare our hashes with its own: index them as opaque ids, or rehash
the ``token_ids`` each ``BlockStored`` carries (what the routers do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack

from jax_kvcached.models.interface import KVSpec

GPU, CPU = "GPU", "CPU"  # vLLM's media: the device tier and the host tier


@dataclasses.dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int | None = None
    lora_id: int | None = None  # the LoRA adapter's (its load generation; None: the base)
    lora_name: str | None = None


@dataclasses.dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str
    group_idx: int


@dataclasses.dataclass
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def external_hash(key: bytes) -> bytes:
    """The published hash of a prefix-cache key (32 bytes)."""
    return key if len(key) == 32 else hashlib.sha256(key).digest()


def _wire(e: Event, token_ids: bool = True) -> dict[str, Any]:
    """An event as msgspec encodes vLLM's tagged struct: a map, ``type`` first, fields
    at their defaults omitted (``token_ids=False``: a BlockStored's token ids empty)."""
    out: dict[str, Any] = {"type": type(e).__name__}
    for f in dataclasses.fields(e):
        v = getattr(e, f.name)
        if f.name == "token_ids" and not token_ids:
            v = []
        if f.name not in ("lora_id", "lora_name", "parent_block_hash") and v is None:
            continue  # (omit_defaults; vLLM's required fields stay, as None)
        out[f.name] = v
    return out


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int | None = None,
                 token_ids: bool = True) -> bytes:  # fmt: skip
    """vLLM's ``KVEventBatch`` in msgpack: ``[ts, [event, ...]]`` (``array_like``), the
    rank appended when there is one. ``token_ids=False``: hashes only (a subscriber
    learns which blocks are cached, not the prompts)."""
    batch: list[Any] = [ts, [_wire(e, token_ids) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)


# A group's kind in stored events, as vLLM names its KV cache specs.
_KINDS = {"full": "full_attention", "sliding": "sliding_window", "recurrent": "mamba"}


class _Listener:
    """One cache's reporter: ``stored`` / ``removed`` with its group and medium."""

    def __init__(self, log: KVEventLog, group: int, medium: str) -> None:
        self.log, self.group, self.medium = log, group, medium

    def stored(self, keys: Sequence[bytes]) -> None:
        self.log.stored(self.group, self.medium, keys)

    def removed(self, keys: Sequence[bytes]) -> None:
        self.log.removed(self.group, self.medium, keys)


class KVEventLog:
    """The events of one engine's caches, in order, until taken.

    Args:
      block_size: tokens per block.
      specs: what each KV cache group's layers keep, which names the group's kind (and
        sliding window) in stored events.
    """

    def __init__(self, block_size: int, specs: Sequence[KVSpec]) -> None:
        self.block_size = block_size
        self.specs = tuple(specs)
        self._meta: dict[tuple[int, bytes], tuple[bytes | None, tuple[int, ...]]] = {}
        self._live: dict[tuple[int, bytes], set[str]] = {}  # (group, key) -> media
        self._events: list[Event] = []
        self._cv = threading.Condition()
        self.taken = 0  # events handed out by take()
        self._holds = 0  # resets running (take() waits for them)

    def listener(self, group: int, medium: str) -> _Listener:
        """The reporter a group's cache of ``medium`` calls."""
        return _Listener(self, group, medium)

    def attach(self, prefix_caches: Sequence[Any], host_caches: Sequence[Any]) -> None:
        """Each group's prefix cache (device tier) and host tier report here."""
        for g, c in enumerate(prefix_caches):
            c.listener = self.listener(g, GPU)
        for g, c in enumerate(host_caches):
            c.listener = self.listener(g, CPU)

    def describe(self, group: int, key: bytes, parent: bytes | None, tokens: Sequence[int],
                 lora: tuple[int, str] | None = None) -> None:  # fmt: skip
        """What a block's stored events carry: its parent's key, its tokens and its LoRA
        adapter's (id, name) (before the cache stores it; kept while any tier holds it)."""
        self._meta.setdefault((group, key), (parent, tuple(int(t) for t in tokens), lora))

    def _kind(self, group: int) -> tuple[str, int | None]:
        spec = self.specs[group]
        return _KINDS[spec.kind], (spec.window or None)

    def stored(self, group: int, medium: str, keys: Sequence[bytes]) -> None:
        """Blocks ``keys`` of ``group`` joined the tier ``medium`` (in chain order)."""
        with self._cv:
            for key in keys:
                media = self._live.setdefault((group, key), set())
                if medium in media:
                    continue  # (stored once)
                media.add(medium)
                parent, tokens, lora = self._meta.get((group, key), (None, (), None))
                lora_id, lora_name = lora or (None, None)
                h = external_hash(key)
                p = external_hash(parent) if parent is not None else None
                last = self._events[-1] if self._events else None
                if (isinstance(last, BlockStored) and last.medium == medium
                        and last.group_idx == group and last.block_hashes[-1] == p
                        and last.lora_id == lora_id):
                    last.block_hashes.append(h)  # the chain goes on: one event
                    last.token_ids.extend(tokens)
                else:
                    kind, window = self._kind(group)
                    self._events.append(BlockStored(
                        [h], p, list(tokens), self.block_size, medium, group, kind, window,
                        lora_id, lora_name))
            self._cv.notify()

    def removed(self, group: int, medium: str, keys: Sequence[bytes]) -> None:
        """Blocks ``keys`` of ``group`` left the tier ``medium``."""
        with self._cv:
            for key in keys:
                media = self._live.get((group, key))
                if not media or medium not in media:
                    continue
                media.discard(medium)
                if not media:
                    del self._live[(group, key)]
                    self._meta.pop((group, key), None)
                h = external_hash(key)
                last = self._events[-1] if self._events else None
                if (isinstance(last, BlockRemoved) and last.medium == medium
                        and last.group_idx == group):
                    last.block_hashes.append(h)
                else:
                    self._events.append(BlockRemoved([h], medium, group))
            self._cv.notify()

    @contextlib.contextmanager
    def resetting(self) -> Iterator[None]:
        """Around a reset: its events are held back until it ends, and when it left
        nothing cached in any tier, its removals become one ``AllBlocksCleared``."""
        with self._cv:
            self._holds += 1
            mark = len(self._events)
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                if not self._live and all(isinstance(e, BlockRemoved)
                                          for e in self._events[mark:]):  # fmt: skip
                    del self._events[mark:]
                    self._events.append(AllBlocksCleared())
                self._cv.notify()

    def take(self, timeout: float | None = None) -> list[Event]:
        """The pending events (waiting up to ``timeout`` seconds for one)."""
        with self._cv:
            if (self._holds or not self._events) and timeout:
                self._cv.wait(timeout)
            if self._holds:
                return []
            out, self._events = self._events, []
            self.taken += len(out)
            return out

    def pending(self) -> int:
        """Events not taken yet."""
        with self._cv:
            return len(self._events)


def batches(events: Sequence[Event]) -> list[list[Event]]:
    """``events`` split where the medium changes (a batch never mixes media: consumers
    that admit only device events drop a whole batch holding a host one)."""
    out: list[list[Event]] = []
    medium = None
    for e in events:
        m = getattr(e, "medium", medium)
        if not out or m != medium:
            out.append([])
            medium = m
        out[-1].append(e)
    return out
