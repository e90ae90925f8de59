"""An engine's LoRA adapters by name: each one's slot in the runner's stacks
(:class:`~jax_kvcached.models.lora.LoRASlots`) and its prefix-cache key.

Loading an adapter reads and checks its PEFT folder against the base (an
:class:`~jax_kvcached.models.lora.AdapterError` naming the file and field), takes a free
slot and writes its weights there: array values, never new shapes, so nothing
recompiles. A request names an adapter; its tokens carry the slot, and its prefix-cache
blocks are keyed by the adapter's name and load generation, so two adapters (or an
adapter and the base, or one name reloaded with other weights) never share KV. An
adapter in use by a request cannot be unloaded.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from jax_kvcached.models.lora import Adapter, LoRASlots, check_base, read_peft


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A loaded adapter: its weights, slot and prefix-cache key."""

    adapter: Adapter
    slot: int
    id: int  # its load generation: a reloaded name is another adapter
    key: str  # the prefix-cache key part (name and load generation)


class AdapterTable:
    """The adapters of one engine (``slots`` None: the engine takes none)."""

    def __init__(self, slots: LoRASlots | None, model: Any) -> None:
        self.slots, self._model = slots, model
        self._by_name: dict[str, Loaded] = {}
        self._generation = itertools.count(1)

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras if self.slots is not None else 0

    def _need_slots(self) -> LoRASlots:
        if self.slots is None:
            raise ValueError("this engine takes no LoRA adapters (start it with max_loras "
                             ">= 1: serve --enable-lora)")  # fmt: skip
        return self.slots

    def load(self, name: str, path: str) -> Adapter:
        """Reads, checks and places adapter ``name`` from PEFT folder ``path``."""
        return self.place(self.read(name, path))

    def read(self, name: str, path: str) -> Adapter:
        """Adapter ``name`` read from PEFT folder ``path`` and checked against the base
        (not placed: :meth:`place`)."""
        slots = self._need_slots()
        if not isinstance(name, str) or not name:
            raise ValueError("an adapter needs a name")
        self._check_free(name)
        adapter = read_peft(path, self._model.config, slots.max_rank, name)
        check_base(adapter, self._model)
        return adapter

    def _check_free(self, name: str) -> list[int]:
        """The free slots (ValueError when ``name`` is loaded or none is free)."""
        slots = self._need_slots()
        if name in self._by_name:
            raise ValueError(f"an adapter named {name!r} is loaded already (unload it first)")
        free = sorted(set(range(1, slots.max_loras + 1))
                      - {x.slot for x in self._by_name.values()})  # fmt: skip
        if not free:
            raise ValueError(f"all {slots.max_loras} LoRA slots hold adapters "
                             f"({', '.join(sorted(self._by_name))}): unload one, or start "
                             "with a larger --max-loras")  # fmt: skip
        return free

    def place(self, adapter: Adapter) -> Adapter:
        """Puts a read adapter in a free slot (checked again: the table may have changed
        since it was read)."""
        slot = self._check_free(adapter.name)[0]
        self._need_slots().set(slot, adapter)
        gen = next(self._generation)
        self._by_name[adapter.name] = Loaded(adapter, slot, gen, f"{adapter.name}#{gen}")
        return adapter

    def unload(self, name: str, users: Callable[[int], Iterable[Any]]) -> None:
        """Drops adapter ``name`` (``users(slot)``: the active requests of a slot; one in
        use is a ValueError)."""
        loaded = self.get(name)
        busy = list(users(loaded.slot))
        if busy:
            raise ValueError(f"adapter {name!r} is in use by {len(busy)} request(s)")
        self._need_slots().set(loaded.slot, None)
        del self._by_name[name]

    def get(self, name: str) -> Loaded:
        """The loaded adapter ``name``; ValueError naming the loaded ones when it is not."""
        loaded = self._by_name.get(name)
        if loaded is None:
            have = ", ".join(sorted(self._by_name)) or "none"
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {have})")
        return loaded

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def stats(self) -> dict[str, Any]:
        """The slots (their device bytes, per device) and each loaded adapter: name,
        path, rank, slot and float32 bytes."""
        return {"max_loras": self.max_loras,
                "slot_bytes": self.slots.nbytes if self.slots is not None else 0,
                "adapters": [{"name": n, "path": x.adapter.path, "rank": x.adapter.rank,
                              "slot": x.slot, "bytes": x.adapter.nbytes}
                             for n, x in sorted(self._by_name.items())]}  # fmt: skip
