"""Sleep mode of an engine: give the device memory back while idle, wake without a
compile.

:class:`SleepMode` is a mixin of :class:`~jax_kvcached.engine.engine.Engine` (its
``sleep`` / ``wake`` and figures); the weights' offload and restore are
:class:`~jax_kvcached.engine.step_weights.StepWeights`', the KV side is the KV
manager's (evict to the host tier, preload from it).
"""

from __future__ import annotations

import time
from typing import Any


class SleepMode:
    """``sleep`` / ``wake`` of an engine (a mixin of :class:`Engine`)."""

    _asleep: Any  # the offloaded weights while sleeping (sleep.Offloaded), else None

    @property
    def sleeping(self) -> bool:
        return self._asleep is not None

    @property
    def sleep_level(self) -> int | None:
        return None if self._asleep is None else self._asleep.level

    @property
    def can_reload(self) -> bool:
        """Whether the weights can be read again from a checkpoint (a level-2 sleep)."""
        return self._reload is not None

    def sleep(self, level: int = 1, *, abort: bool = False) -> dict[str, Any]:
        """Gives the device memory back while idle: the requests in flight finish first
        (``abort=True``: they are aborted), idle cached prefixes go to the host tier when
        there is one, every KV block and page is released, and the weights go to host
        memory (level 1: page-locked where the device has it) or are dropped (level 2:
        :meth:`wake` reads the checkpoint again; engines made by :meth:`from_pretrained`).
        The compiled steps stay. Requests added while asleep wait for :meth:`wake`
        (:meth:`run` and :meth:`generate` wake first). The model object the engine was
        built from shares the weights: a sleep deletes them, so that object is unusable
        from then on (the engine holds the weights it wakes with; build another model
        object to run one outside it)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            if self._asleep is not None:
                raise ValueError(f"{self.name!r} is already asleep (level {self.sleep_level})")
            if level == 2 and self._reload is None:
                raise ValueError(
                    "a level-2 sleep drops the weights: only an engine with a reload (as "
                    "Engine.from_pretrained makes) can read them again; use level 1"
                )
            t0 = time.perf_counter()
            if abort:
                for rid in self.active_requests():
                    self.abort(rid)
            self.run()
            self.drain()
            # Idle prefixes of every KV cache group (to the host tier, if any).
            spilled = sum(pc.evict(pc.num_evictable_blocks) for pc in self.kv.prefix_caches)
            self.runner.token.block_until_ready()  # (frees wait for the last step)
            self.kv.poll()
            self._asleep = self.runner.offload_weights(level)
            self.pool.channel.publish(self.name, level)  # (a process group's ctl sees it)
            return {
                "level": level, "weight_bytes": self._asleep.nbytes, "evicted_blocks": spilled,
                "mapped_pages": self.cache.mapped_pages, "seconds": time.perf_counter() - t0,
            }  # fmt: skip

    def wake(self, *, preload_tokens: int = 0) -> dict[str, Any]:
        """Brings the weights back (a copy from host memory, or a reload of the
        checkpoint after a level-2 sleep); nothing compiles. ``preload_tokens``: then
        copies the host tier's most-hit prefixes back, up to that many tokens (per KV
        cache group), so the first requests hit them on the device. KV memory is mapped
        on demand (nothing to do for it here). ValueError when awake; a failed wake
        leaves the engine asleep (retry it)."""
        if isinstance(preload_tokens, bool) or preload_tokens < 0:
            raise ValueError(f"preload_tokens must be >= 0, got {preload_tokens!r}")
        with self._lock:
            if self._asleep is None:
                raise ValueError(f"{self.name!r} is awake")
            t0 = time.perf_counter()
            compiled = self.num_compiled
            model = self._reload() if self._asleep.level == 2 else None
            loaded = time.perf_counter() - t0
            copy = self.runner.restore_weights(self._asleep, model)
            level, self._asleep = self._asleep.level, None
            self.pool.channel.publish(self.name, 0)  # awake
            t1 = time.perf_counter()
            blocks = self.kv.preload(preload_tokens)  # per KV cache group
            return {
                "level": level, "reload_s": loaded, "weights_s": copy,
                "preload_s": time.perf_counter() - t1,
                "preloaded_tokens": blocks[0] * self.cache.block_size,
                "preloaded_blocks": sum(blocks),
                "compiled": self.num_compiled - compiled,
                "seconds": time.perf_counter() - t0,
            }  # fmt: skip
