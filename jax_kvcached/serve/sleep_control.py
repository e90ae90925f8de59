"""SleepControl: which models of a serving loop sleep and wake, and when.

A model put to sleep (an admin's order, ``ctl sleep`` through a process group, the idle
policy) stops admitting requests and sleeps once it has drained (``Engine.sleep``:
weights and KV memory given back). Requests for a sleeping model are parked here and
wake it (their time to first token includes the wake); with ``max_awake`` models awake,
waking one first puts the least recently used idle one to sleep, and when none is idle
the requests wait for one. A failed wake fails the requests parked for it (503) and
leaves the model asleep, to be tried again by the next request.

Everything here runs on the loop thread; the loop calls :meth:`SleepControl.round` each
round and hands over commands, parked requests and failures, and gives it the few
actions it needs of the loop (:class:`LoopActions`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from jax_kvcached.engine.engine import Engine
from jax_kvcached.serve.errors import Conflict, Unavailable
from jax_kvcached.serve.sleep_mailbox import WAKE

log = logging.getLogger("jax_kvcached.serve.sleep")


class Request(Protocol):
    """What this module reads of a loop's request."""

    model: str
    cancelled: bool


@dataclasses.dataclass(frozen=True)
class LoopActions:
    """What the sleep control asks of its serving loop (all on the loop thread)."""

    running: Callable[[str], bool]  # whether the model has requests in its engine
    add: Callable[[Any], None]  # hand a request to its (awake) engine
    close: Callable[[Any, str | None, Any], None]  # end a request: (kind, value) event
    fail: Callable[[str, BaseException], None]  # take a model out of service
    abort_all: Callable[[str, Exception], None]  # end every request a model runs


@dataclasses.dataclass
class _Order:
    """A sleep asked for, carried out once its model has drained."""

    level: int
    done: Future | None = None  # an admin's (None: the idle policy's or ctl's)
    from_group: bool = False  # asked through the process group (ctl): cleared when done


class SleepControl:
    """The sleep policies of a serving loop's models (see the module).

    Args:
      engines: the loop's engines by model name.
      failed: the loop's models taken out of service (read only here).
      actions: what it asks of the loop.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        failed: Mapping[str, str],
        actions: LoopActions,
        *,
        idle_sleep_s: float | None = None,
        max_awake: int | None = None,
        level: int = 1,
        preload_tokens: int = 0,
    ) -> None:
        if idle_sleep_s is not None and not idle_sleep_s > 0:
            raise ValueError(f"idle_sleep_s must be > 0 seconds, got {idle_sleep_s!r}")
        if max_awake is not None and (isinstance(max_awake, bool) or max_awake < 1):
            raise ValueError(f"max_awake must be >= 1, got {max_awake!r}")
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {level!r}")
        if preload_tokens < 0:
            raise ValueError(f"preload_tokens must be >= 0, got {preload_tokens!r}")
        if level == 2:
            for name, engine in engines.items():
                if not engine.can_reload:
                    raise ValueError(
                        f"sleep level 2 drops the weights: model {name!r} has no checkpoint "
                        "to read them again from (use level 1)"
                    )
        self.engines = engines
        self.failed = failed
        self.actions = actions
        self.idle_sleep_s = idle_sleep_s
        self.max_awake = max_awake
        self.level = level
        self.preload_tokens = preload_tokens
        self._orders: dict[str, _Order] = {}
        self._parked: dict[str, deque[Request]] = {n: deque() for n in self.engines}
        self._last_used = dict.fromkeys(self.engines, time.monotonic())
        self.sleeps = dict.fromkeys(self.engines, 0)
        self.wakes = dict.fromkeys(self.engines, 0)
        self.wake_failures = dict.fromkeys(self.engines, 0)
        self.last_wake: dict[str, dict[str, Any]] = {}
        # Called (model, wake figures) on the loop thread after each wake (metrics).
        self.wake_listeners: list[Callable[[str, dict[str, Any]], None]] = []

    # -- requests --------------------------------------------------------------------
    def parks(self, name: str) -> bool:
        """Whether a request for ``name`` must wait (asleep, or falling asleep)."""
        return name in self._orders or self.engines[name].sleeping

    def park(self, req: Request) -> None:
        self._parked[req.model].append(req)

    def unpark(self, req: Request) -> bool:
        """Takes a parked request out (cancelled); False if it was not parked."""
        try:
            self._parked[req.model].remove(req)
        except ValueError:
            return False
        return True

    def touch(self, name: str) -> None:
        """``name`` got a request now."""
        self._last_used[name] = time.monotonic()

    def waiting(self, name: str) -> int:
        """Requests waiting for ``name`` to wake."""
        return len(self._parked[name])

    def _idle(self, name: str) -> bool:
        engine = self.engines[name]
        return not (engine.has_work or self.actions.running(name) or self._parked[name])

    # -- commands (an admin's sleep / wake) ------------------------------------------
    def command(self, kind: str, args: tuple[Any, ...]) -> None:
        """Carries out ``sleep`` (model, level, abort, future) or ``wake`` (model,
        future); the future gets the figures or the error."""
        name, fut = args[0], args[-1]
        engine = self.engines[name]
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if name in self.failed:
                raise Unavailable(f"model {name!r} is unavailable: {self.failed[name]}")
            if kind == "sleep":
                _, level, abort = args[:3]
                if engine.sleeping or name in self._orders:
                    raise Conflict(f"model {name!r} is asleep already (or falling asleep)")
                self._orders[name] = _Order(level, fut)
                if abort:
                    self.actions.abort_all(name, Unavailable(f"model {name!r} was put to sleep"))
                return  # done by round() once it has drained
            if not engine.sleeping:
                raise Conflict(f"model {name!r} is awake")
            t0 = time.perf_counter()
            if not self._make_room(name):
                raise Conflict(
                    f"{self.max_awake} models are awake and none is idle: cannot wake {name!r} now"
                )
            fut.set_result(self._wake(name, time.perf_counter() - t0))
        except Exception as e:
            fut.set_exception(e)

    # -- sleeping and waking ---------------------------------------------------------
    def _sleep(self, name: str, level: int) -> dict[str, Any]:
        out = self.engines[name].sleep(level)
        self.sleeps[name] += 1
        log.info("model %r asleep (level %d, %.3f s)", name, level, out["seconds"])
        return out

    def _wake(self, name: str, room_s: float = 0.0) -> dict[str, Any]:
        """Wakes a model; on failure it stays asleep and the error is raised. ``room_s``:
        the seconds spent putting another model to sleep first (reported with it)."""
        try:
            out = self.engines[name].wake(preload_tokens=self.preload_tokens)
        except Exception:
            self.wake_failures[name] += 1
            raise
        out["room_s"] = room_s
        self.wakes[name] += 1
        self.last_wake[name] = out
        self._last_used[name] = time.monotonic()
        for listener in self.wake_listeners:
            try:
                listener(name, out)
            except Exception:
                log.exception("a wake listener failed")
        return out

    def _make_room(self, name: str) -> bool:
        """Under ``max_awake``, puts the least recently used idle awake model to sleep if
        waking ``name`` needs room; False: none is idle (try again later)."""
        if self.max_awake is None:
            return True
        failed = self.failed
        awake = [n for n, e in self.engines.items() if not e.sleeping and n not in failed]
        if len(awake) < self.max_awake:
            return True
        idle = [n for n in awake if n != name and n not in self._orders and self._idle(n)]
        if not idle:
            return False
        victim = min(idle, key=lambda n: self._last_used[n])
        try:
            self._sleep(victim, self.level)
        except Exception as e:
            self.actions.fail(victim, e)
        return True

    def _group_request(self, name: str) -> bool:
        """Carries out a sleep or wake another process asked of ``name`` (``ctl sleep`` /
        ``ctl wake``, through the process group's ledger), and clears it once done or
        refused (a sleep: once its model has drained); True if it woke it."""
        engine = self.engines[name]
        request = engine.pool.channel.request(name)  # (see serve/sleep_mailbox.py)
        if not request or (request in (1, 2) and name in self._orders):
            return False  # none, or a sleep under way
        woke = False
        if request in (1, 2) and not engine.sleeping:
            if request == 2 and not engine.can_reload:
                log.warning("ctl asked a level-2 sleep of %r, which has no checkpoint", name)
            else:
                self._orders[name] = _Order(request, from_group=True)
                return False  # cleared when it sleeps
        elif request == WAKE and engine.sleeping:
            t0 = time.perf_counter()
            if self._make_room(name):
                try:
                    self._wake(name, time.perf_counter() - t0)
                    woke = True
                except Exception as e:
                    log.error("waking %r failed (it stays asleep): %r", name, e)
            else:
                log.warning("ctl asked to wake %r: %d models are awake, none idle", name,
                            self.max_awake)  # fmt: skip
        engine.pool.channel.clear(name)
        return woke

    def round(self) -> bool:
        """Carries out sleep orders of drained models, wakes sleeping models that have
        requests waiting, and puts idle ones to sleep (``idle_sleep_s``). True if any
        model changed state."""
        changed = False
        now = time.monotonic()
        for name, engine in self.engines.items():
            if name in self.failed:
                continue
            if not self._idle(name) and not engine.sleeping:
                self._last_used[name] = now
            changed |= self._group_request(name)
            order = self._orders.get(name)
            if order is not None:
                changed |= self._carry_out(name, order)
            elif engine.sleeping and self._parked[name]:
                changed |= self._wake_for_requests(name)
            elif (
                self.idle_sleep_s is not None
                and not engine.sleeping
                and self._idle(name)
                and now - self._last_used[name] >= self.idle_sleep_s
            ):
                try:
                    self._sleep(name, self.level)
                except Exception as e:
                    self.actions.fail(name, e)
                changed = True
        return changed

    def _carry_out(self, name: str, order: _Order) -> bool:
        """A sleep order, once its model has drained; True if it slept (or failed)."""
        if self.engines[name].has_work or self.actions.running(name):
            return False
        self._orders.pop(name, None)
        waiter = order.done if order.done is not None and not order.done.done() else None
        try:
            out = self._sleep(name, order.level)
        except Exception as e:
            if waiter is not None:
                waiter.set_exception(e)
            self._clear_group_request(name, order)
            self.actions.fail(name, e)
            return True
        if waiter is not None:
            waiter.set_result(out)
        self._clear_group_request(name, order)
        return True

    def _clear_group_request(self, name: str, order: _Order) -> None:
        if order.from_group:
            self.engines[name].pool.channel.clear(name)

    def _wake_for_requests(self, name: str) -> bool:
        """Wakes a sleeping model for its parked requests and hands them over; when every
        awake model is busy they wait (False)."""
        t0 = time.perf_counter()
        if not self._make_room(name):
            return False
        parked, self._parked[name] = self._parked[name], deque()
        try:
            self._wake(name, time.perf_counter() - t0)
        except Exception as e:
            log.error("waking %r failed (it stays asleep): %r", name, e)
            for req in parked:
                self.actions.close(req, "error", Unavailable(f"waking model {name!r} failed: {e}"))
            return True
        for req in parked:
            if req.cancelled:
                self.actions.close(req, None, None)
            else:
                self.actions.add(req)
        return True

    # -- failures and shutdown -------------------------------------------------------
    def fail(self, name: str, err: BaseException) -> None:
        """``name``'s engine failed: its parked requests and its pending order too."""
        for req in self._parked[name]:
            self.actions.close(req, "error", Unavailable(f"model {name!r} failed: {err!r}"))
        self._parked[name].clear()
        order = self._orders.pop(name, None)
        if order is not None and order.done is not None and not order.done.done():
            order.done.set_exception(Unavailable(f"model {name!r} failed: {err!r}"))

    def shutdown(self) -> None:
        """Ends every pending order and parked request with the shutdown error (also
        from another thread, when the loop thread is stuck in a step: requests end at
        most once)."""
        orders, self._orders = self._orders, {}
        for order in orders.values():
            if order.done is not None and not order.done.done():
                order.done.set_exception(Unavailable("the server is shutting down"))
        for parked in self._parked.values():
            while parked:
                req = parked.popleft()
                self.actions.close(req, "error", Unavailable("the server is shutting down"))
