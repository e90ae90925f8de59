"""An engine's LoRA adapters: registered by name, resident on demand in the runner's
slots (:class:`~jax_kvcached.models.lora.LoRASlots`), keyed apart in the prefix cache.

Registering an adapter reads and checks its PEFT folder against the base (an
:class:`~jax_kvcached.models.lora.AdapterError` naming the file and field) and keeps its
weights on the host (the ``max_cpu_loras`` most recently used; the others are read
again from their folder when next needed). A request's adapter takes a device slot when
its request is admitted: a free slot, else the least recently used slot whose adapter no
active request uses (that adapter is evicted: its slot is overwritten, its host copy
stays). When every slot's adapter is in use, the request waits until one is idle.
Slots hold array values, never new shapes: nothing recompiles.

An adapter's prefix-cache blocks are keyed by its name and registration generation, so
two adapters (or an adapter and the base, or one name registered again with other
weights) never share KV, while an adapter evicted and placed again finds its blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

from jax_kvcached.models.lora import Adapter, LoRASlots, check_base, read_peft


@dataclasses.dataclass(frozen=True)
class Registered:
    """A registered adapter: where it comes from, its id and its prefix-cache key."""

    name: str
    path: str
    rank: int
    nbytes: int  # its float32 weights' bytes
    id: int  # its registration generation (KV events' lora_id)
    key: str  # the prefix-cache key part (name and generation)


class AdapterTable:
    """The adapters of one engine (``slots`` None: the engine takes none).
    ``max_cpu_loras``: adapters whose weights stay on the host (None: all)."""

    def __init__(self, slots: LoRASlots | None, model: Any,
                 max_cpu_loras: int | None = None) -> None:  # fmt: skip
        self.slots, self._model = slots, model
        self.max_cpu_loras = max_cpu_loras
        self._registered: dict[str, Registered] = {}
        self._host: OrderedDict[str, Adapter] = OrderedDict()  # least recent first
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self._generation = itertools.count(1)
        self.placements = self.evictions = self.reads = 0

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras if self.slots is not None else 0

    def _need_slots(self) -> LoRASlots:
        if self.slots is None:
            raise ValueError("this engine takes no LoRA adapters (start it with max_loras "
                             ">= 1: serve --enable-lora)")  # fmt: skip
        return self.slots

    def read(self, name: str, path: str) -> Adapter:
        """Adapter ``name`` read from PEFT folder ``path`` and checked against the base
        (not registered: :meth:`register`)."""
        slots = self._need_slots()
        if not isinstance(name, str) or not name:
            raise ValueError("an adapter needs a name")
        if name in self._registered:
            raise ValueError(f"an adapter named {name!r} is loaded already (unload it first)")
        adapter = read_peft(path, self._model.config, slots.max_rank, name)
        check_base(adapter, self._model)
        return adapter

    def register(self, adapter: Adapter) -> Registered:
        """Registers a read adapter (its weights kept on the host)."""
        if adapter.name in self._registered:
            raise ValueError(f"an adapter named {adapter.name!r} is loaded already")
        gen = next(self._generation)
        reg = Registered(adapter.name, adapter.path, adapter.rank, adapter.nbytes, gen,
                         f"{adapter.name}#{gen}")  # fmt: skip
        self._registered[adapter.name] = reg
        self._keep(adapter)
        return reg

    def _keep(self, adapter: Adapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while self.max_cpu_loras is not None and len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def get(self, name: str) -> Registered:
        """The registered adapter ``name``; ValueError naming the loaded ones when not."""
        reg = self._registered.get(name)
        if reg is None:
            have = ", ".join(sorted(self._registered)) or "none"
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {have})")
        return reg

    def acquire(self, name: str, busy: Callable[[int], bool]) -> int | None:
        """The device slot of adapter ``name``, placing it there when it is not
        resident (a free slot, else the least recently used one ``busy`` says no active
        request uses); None when every slot is busy (the request waits)."""
        slots, reg = self._need_slots(), self.get(name)
        if name in self._resident:
            self._resident.move_to_end(name)
            return self._resident[name]
        taken = set(self._resident.values())
        free = [s for s in range(1, slots.max_loras + 1) if s not in taken]
        if not free:
            idle = next((n for n, s in self._resident.items() if not busy(s)), None)
            if idle is None:
                return None
            free = [self._resident.pop(idle)]
            self.evictions += 1
        adapter = self._host.get(name)
        if adapter is None:  # (past max_cpu_loras: read again)
            adapter = read_peft(reg.path, self._model.config, slots.max_rank, name)
            self.reads += 1
        self._keep(adapter)
        slots.set(free[0], adapter)
        self._resident[name] = free[0]
        self.placements += 1
        return free[0]

    def unload(self, name: str, users: Callable[[str], int]) -> None:
        """Drops adapter ``name`` (``users(name)``: its active requests; some is a
        ValueError)."""
        self.get(name)
        n = users(name)
        if n:
            raise ValueError(f"adapter {name!r} is in use by {n} request(s)")
        slot = self._resident.pop(name, None)
        if slot is not None:
            self._need_slots().set(slot, None)
        self._host.pop(name, None)
        del self._registered[name]

    def names(self) -> list[str]:
        return sorted(self._registered)

    def stats(self) -> dict[str, Any]:
        """The slots (their device bytes, per device), residency counters and each
        registered adapter: name, path, rank, its slot (None: not resident), float32
        bytes and whether its weights are on the host."""
        return {"max_loras": self.max_loras,
                "slot_bytes": self.slots.nbytes if self.slots is not None else 0,
                "host_bytes": sum(a.nbytes for a in self._host.values()),
                "placements": self.placements, "evictions": self.evictions,
                "reads": self.reads,
                "adapters": [{"name": n, "path": r.path, "rank": r.rank,
                              "slot": self._resident.get(n), "bytes": r.nbytes,
                              "on_host": n in self._host}
                             for n, r in sorted(self._registered.items())]}  # fmt: skip


class AdapterAdmission:
    """An engine's requests that name an adapter: each takes its adapter's slot when it
    is added, or waits (in order) until a slot is free or idle. ``active()``: the
    engine's active sequences (a slot is busy while one of them holds it)."""

    def __init__(self, table: AdapterTable, active: Callable[[], Iterable[Any]]) -> None:
        self.table, self._active = table, active
        self.waiting: deque[Any] = deque()

    def place(self, seq: Any) -> bool:
        """Gives ``seq`` its adapter's slot (placing the adapter); False: none is free."""
        slot = self.table.acquire(seq.lora[1], lambda k: any(
            s.adapter_slot == k for s in self._active()))  # fmt: skip
        seq.adapter_slot = slot or 0
        return slot is not None

    def submit(self, seq: Any) -> bool:
        """True: ``seq`` holds its slot and may be scheduled; False: it waits."""
        if self.place(seq):
            return True
        self.waiting.append(seq)
        return False

    def admit(self, schedule: Callable[[Any], None]) -> None:
        """Hands the waiting sequences that now get a slot to ``schedule``, in order."""
        while self.waiting and self.place(self.waiting[0]):
            schedule(self.waiting.popleft())

    def drop(self, seq: Any) -> bool:
        """Forgets a waiting ``seq`` (an abort); False if it was not waiting."""
        if any(s is seq for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s is not seq)
            return True
        return False

    def users(self, name: str) -> int:
        """Active requests of adapter ``name``."""
        return sum(1 for s in self._active() if s.lora and s.lora[1] == name)
