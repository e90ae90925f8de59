"""ServingLoop: several engines (tenants of one Pool) served from one thread.

Each round visits every engine once, starting one further along each round: it completes
the engine's dispatched step (streaming its tokens) and dispatches the next one. So every
engine with work gets one step per round, and an engine's device work overlaps the
others' host work (scheduling, hashing, streaming). Requests come in from any thread
through :meth:`submit`; their events go out through a callback, from the loop thread.

Sleep (:meth:`ServingLoop.sleep`, :meth:`ServingLoop.wake`, ``idle_sleep_s``,
``max_awake``): :mod:`jax_kvcached.serve.sleep_control` decides, on the loop thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from jax_kvcached.engine.engine import Engine, Prompt
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sequence import Sequence as Seq
from jax_kvcached.serve.errors import Conflict, Overloaded, Unavailable, UnknownModel
from jax_kvcached.serve.model_stats import model_stats
from jax_kvcached.serve.requests import EventCallback, Finished, Request
from jax_kvcached.serve.sleep_control import LoopActions, SleepControl

__all__ = ["Conflict", "EventCallback", "Finished", "Overloaded", "Request", "ServingLoop",
           "Unavailable", "UnknownModel"]  # fmt: skip

log = logging.getLogger("jax_kvcached.serve.loop")


class ServingLoop:
    """Serves ``engines`` (name -> Engine) from one background thread.

    Args:
      max_queue: requests per model that may wait beyond its ``max_batch`` running ones;
        more are refused with :class:`Overloaded`.
      idle_wait_s: how long the loop sleeps when no engine could make progress.
      idle_sleep_s: put a model to sleep after this many seconds without requests
        (None: never).
      max_awake: keep at most this many models awake (None: all).
      sleep_level: the level the policies sleep at (1: weights to host memory; 2:
        dropped, reloaded on wake: engines with a checkpoint only).
      preload_tokens: on wake, idle prefixes the model's host tier holds are copied back
        up to this many tokens, most hit first (0: none).
    """

    def __init__(
        self,
        engines: Mapping[str, Engine],
        *,
        max_queue: int = 64,
        idle_wait_s: float = 0.002,
        idle_sleep_s: float | None = None,
        max_awake: int | None = None,
        sleep_level: int = 1,
        preload_tokens: int = 0,
    ) -> None:
        if not engines:
            raise ValueError("a ServingLoop needs at least one engine")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.engines = dict(engines)
        self.max_queue = max_queue
        self.idle_wait_s = idle_wait_s
        self._order = list(self.engines)
        self._lock = threading.Lock()  # commands, outstanding counts
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._outstanding = dict.fromkeys(self.engines, 0)
        self._active: dict[str, dict[int, Request]] = {n: {} for n in self.engines}
        self.failed: dict[str, str] = {}  # model -> why its engine stopped
        self.rounds = 0
        self.steps = dict.fromkeys(self.engines, 0)
        self.finished = dict.fromkeys(self.engines, 0)
        self.errors = dict.fromkeys(self.engines, 0)
        self.generated_tokens = dict.fromkeys(self.engines, 0)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._accepting = True  # under _lock; False once the loop has shut down
        self._abandoned = False  # stop() ended the requests past a step still running
        actions = LoopActions(
            running=lambda name: bool(self._active[name]), add=self._add, close=self._close,
            fail=self._fail_engine, abort_all=self._abort_all,
        )  # fmt: skip
        self.sleep_control = SleepControl(
            self.engines, self.failed, actions, idle_sleep_s=idle_sleep_s, max_awake=max_awake,
            level=sleep_level, preload_tokens=preload_tokens,
        )  # fmt: skip
        # (its figures, read by the metrics and the admin routes)
        self.sleep_level = sleep_level
        self.sleeps = self.sleep_control.sleeps
        self.wakes = self.sleep_control.wakes
        self.wake_failures = self.sleep_control.wake_failures
        self.last_wake = self.sleep_control.last_wake
        self.wake_listeners = self.sleep_control.wake_listeners

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> ServingLoop:
        if self._thread is not None:
            raise RuntimeError("the serving loop is already started")
        self._thread = threading.Thread(target=self._run, name="kvcached-serving", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Stops the loop; requests still active get an Unavailable error. When the loop
        thread is still inside a step after ``timeout`` seconds (a compile), the requests
        are ended from here and False is returned: the thread finishes that step later
        (it is a daemon) and finds them closed."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(0 if self._abandoned else timeout)
        if self._thread.is_alive():
            self._abandon()
            return False
        return True

    def _abandon(self) -> None:
        """Ends every queued and active request with the shutdown error, from a thread
        other than the loop's (which is stuck in a step)."""
        self._abandoned = True
        with self._lock:
            self._accepting = False
            waiting = [req for kind, req in self._commands if kind == "add"]
            # sleep / wake commands not taken yet: answered here, never by the loop
            orders = [args for kind, args in self._commands if kind in ("sleep", "wake")]
            self._commands = deque(c for c in self._commands if c[0] not in ("sleep", "wake"))
        for args in orders:
            if args[-1].set_running_or_notify_cancel():
                args[-1].set_exception(Unavailable("the server is shutting down"))
        for name in self.engines:
            for req in [*list(self._active[name].values()), *waiting]:
                if req.model == name:
                    self._close(req, "error", Unavailable("the server is shutting down"))
        self.sleep_control.shutdown()  # requests parked for a wake, sleeps under way

    def shutdown(self, timeout: float) -> None:
        """Graceful stop: refuses new requests at once, lets in-flight ones finish for up
        to ``timeout`` seconds, then stops; those still active get an Unavailable error
        and their blocks are freed."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            with self._lock:
                if not any(self._outstanding.values()):
                    break
            time.sleep(0.02)
        self.stop(timeout=0.2)  # a step still compiling does not hold the deadline

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def __enter__(self) -> ServingLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests (any thread) -------------------------------------------------------
    def engine(self, model: str) -> Engine:
        try:
            return self.engines[model]
        except KeyError:
            raise UnknownModel(model) from None

    def submit(
        self,
        model: str,
        prompt: str | Sequence[int] | Prompt,
        params: SamplingParams,
        on_event: EventCallback,
        fork_of: Request | None = None,
        cache_salt: str | None = None,
        adapter: str | None = None,
    ) -> Request:
        """Queues a request. Raises UnknownModel, ValueError (bad prompt), Overloaded or
        Unavailable; never blocks. A :class:`Prompt` of the model's engine is not
        validated again. ``fork_of``: a request of the same model and prompt submitted
        just before; this one shares its prompt's KV (one prefill for n samples) if the
        loop has not computed that prompt yet (:meth:`submit_samples` makes sure).
        ``cache_salt``: the request shares cached prefix blocks only with requests of the
        same salt (OpenAI's / vLLM's ``cache_salt``). ``adapter``: a LoRA adapter of the
        model's engine (None: the base)."""
        ids = self._prompt(model, prompt)
        req = Request(model, ids, params, on_event, fork_of=fork_of, cache_salt=cache_salt,
                      adapter=adapter)  # fmt: skip
        self._queue(model, [req])
        return req

    def submit_samples(
        self,
        model: str,
        prompt: str | Sequence[int] | Prompt,
        params: Sequence[SamplingParams],
        on_events: Sequence[EventCallback],
        cache_salt: str | None = None,
        adapter: str | None = None,
    ) -> list[Request]:
        """Queues ``len(params)`` samples of one prompt at once (``n`` / ``best_of``): the
        first computes the prompt, the others fork it. All are handed to the engine in the
        same round of the loop, so every fork finds its parent's prompt not yet computed
        (one prefill however loaded the machine is); all or none are queued. Raises as
        :meth:`submit`."""
        if not params or len(params) != len(on_events):
            raise ValueError("submit_samples: one event callback per sample, at least one")
        ids = self._prompt(model, prompt)
        kw = dict(cache_salt=cache_salt, adapter=adapter)
        first = Request(model, ids, params[0], on_events[0], **kw)
        reqs = [first] + [Request(model, ids, p, cb, fork_of=first, **kw)
                          for p, cb in zip(params[1:], on_events[1:], strict=True)]  # fmt: skip
        self._queue(model, reqs)
        return reqs

    def _prompt(self, model: str, prompt: str | Sequence[int] | Prompt) -> Any:
        """The engine's prompt, once the model may take requests."""
        ids = self.engine(model).prompt(prompt)
        if not self.running:
            raise Unavailable("the serving loop is not running")
        if model in self.failed:
            raise Unavailable(f"model {model!r} is unavailable: {self.failed[model]}")
        return ids

    def _queue(self, model: str, reqs: list[Request]) -> None:
        """Hands ``reqs`` to the loop in one command batch (all or none)."""
        engine = self.engine(model)
        with self._lock:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            limit = engine.max_batch + self.max_queue
            if self._outstanding[model] + len(reqs) > limit:
                raise Overloaded(
                    f"model {model!r} has {self._outstanding[model]} requests in flight "
                    f"(limit {limit}); retry later"
                )
            self._outstanding[model] += len(reqs)
            self._commands.extend(("add", req) for req in reqs)
        self._wake.set()

    def fail_all(self, reason: str) -> None:
        """Ends every request (running, queued) with Unavailable(``reason``) and takes
        every model out of service; any thread, also while a step is stuck."""
        err = Unavailable(reason)
        with self._lock:
            self._accepting = False
            commands = [req for kind, req in self._commands if kind == "add"]
            self._commands.clear()
        for name in self.engines:
            self.failed.setdefault(name, reason)
            for req in list(self._active[name].values()) + commands:
                if req.model == name:
                    self._close(req, "error", err)

    def cancel(self, req: Request) -> None:
        """Stops a request (e.g. its client went away); its blocks are freed."""
        with self._lock:
            req.cancelled = True
            self._commands.append(("cancel", req))
        self._wake.set()

    def sleep(
        self, model: str, level: int | None = None, *, abort: bool = False, timeout: float = 600
    ) -> dict[str, Any]:
        """Puts ``model`` to sleep once the requests it runs finish (``abort``: they end
        now with an Unavailable error); requests arriving meanwhile wait for the wake.
        Returns ``Engine.sleep``'s figures. Raises UnknownModel, ValueError (level),
        Conflict (asleep already, or its sleep is under way), Unavailable, TimeoutError."""
        level = self.sleep_level if level is None else level
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (weights to host) or 2 (dropped), got {level!r}"
            )
        engine = self.engine(model)
        if level == 2 and not engine.can_reload:
            raise ValueError(
                f"a level-2 sleep drops the weights: {model!r} has no checkpoint to read "
                "them again from (use level 1)"
            )
        return self._command("sleep", (model, level, abort), timeout)

    def wake(self, model: str, *, timeout: float = 600) -> dict[str, Any]:
        """Wakes ``model`` (a copy of its weights back, or a reload; no compile).
        Returns ``Engine.wake``'s figures. Raises UnknownModel, Conflict (awake, or no
        idle model to make room under ``max_awake``), Unavailable (the wake failed: it
        stays asleep), TimeoutError."""
        self.engine(model)
        return self._command("wake", (model,), timeout)

    def _command(self, kind: str, args: tuple[Any, ...], timeout: float) -> dict[str, Any]:
        fut: Future = Future()
        with self._lock:
            if not self._accepting or not self.running:
                raise Unavailable("the serving loop is not running")
            self._commands.append((kind, (*args, fut)))
        self._wake.set()
        return fut.result(timeout)

    def pools(self) -> list[Any]:
        """The distinct pools the engines live in (one or several)."""
        out: list[Any] = []
        for eng in self.engines.values():
            if not any(eng.pool is p for p in out):
                out.append(eng.pool)
        return out

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-model queue, memory and cache figures (a snapshot; any thread)."""
        return {
            name: model_stats(eng.stats(), eng.pool.memory_limit, {
                "outstanding": self._outstanding[name],
                "max_queue": self.max_queue,
                "steps": self.steps[name],
                "finished": self.finished[name],
                "errors": self.errors[name],
                "generated_tokens": self.generated_tokens[name],
                "failed": name in self.failed,
                "sleeps": self.sleeps[name],
                "wakes": self.wakes[name],
                "wake_failures": self.wake_failures[name],
                "waiting_for_wake": self.sleep_control.waiting(name),
            })  # fmt: skip
            for name, eng in self.engines.items()  # engines may live in different pools
        }

    # -- the loop thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not (self._round() | self.sleep_control.round()):
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # a bug in the loop itself: fail everything, loudly
            log.exception("serving loop crashed")
            for name in self.engines:
                self.failed.setdefault(name, f"serving loop crashed: {e!r}")
            raise
        finally:
            self._stop.set()
            self._shutdown()

    def _round(self) -> bool:
        """One visit to every engine; True if anything happened."""
        progressed = self._drain()
        k = self.rounds % len(self._order)
        self.rounds += 1
        for name in self._order[k:] + self._order[:k]:
            if name in self.failed:
                continue
            engine = self.engines[name]
            try:
                if engine.has_work:
                    steps, inflight = engine.steps, engine.num_inflight
                    engine.step()
                    done = engine.drain_finished()  # finished and rejected requests
                    progressed |= bool(done)
                    self._report(name, done)
                    self.steps[name] += engine.steps - steps
                    progressed |= (engine.steps, engine.num_inflight) != (steps, inflight)
            except Exception as e:
                self._fail_engine(name, e)
                progressed = True
        return progressed

    def _drain(self) -> bool:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for kind, req in commands:
            if kind in ("sleep", "wake"):
                self.sleep_control.command(kind, req)
                continue
            if kind == "add":
                self.sleep_control.touch(req.model)
                if req.cancelled:
                    self._close(req, None, None)
                elif req.model in self.failed:
                    self._close(req, "error", Unavailable(self.failed[req.model]))
                elif self.sleep_control.parks(req.model):
                    self.sleep_control.park(req)  # served after the wake
                else:
                    self._add(req)
            elif kind == "cancel" and req.request_id is not None and not req.closed:
                self.engines[req.model].abort(req.request_id)
                self._active[req.model].pop(req.request_id, None)
                self._close(req, None, None)
            elif kind == "cancel" and self.sleep_control.unpark(req):
                self._close(req, None, None)
        return bool(commands)

    def _add(self, req: Request) -> None:
        """Hands a request to its (awake) engine."""
        engine = self.engines[req.model]
        parent = req.fork_of.request_id if req.fork_of is not None else None
        on_lp = self._logprob_streamer(req) if req.params.logprobs is not None else None
        try:
            rid = engine.add_request(
                req.prompt, req.params, self._streamer(req), fork_of=parent,
                on_logprobs=on_lp, cache_salt=req.cache_salt, adapter=req.adapter,
            )  # fmt: skip
        except Exception as e:  # validated in submit(); never stop the loop for it
            self._close(req, "error", e)
            return
        req.request_id = rid
        self._active[req.model][rid] = req

    def _streamer(self, req: Request) -> Callable[[int, int, bool], None]:
        def on_token(rid: int, token: int, finished: bool) -> None:
            if not req.closed:
                self.generated_tokens[req.model] += 1
                try:
                    req.on_event("token", token)
                except Exception:  # a consumer's bug (or a closed server): cancel the
                    log.exception("request event callback failed; cancelling the request")
                    self.cancel(req)  # request, not the model

        return on_token

    def _logprob_streamer(self, req: Request) -> Callable[[int, Any], None]:
        def on_logprobs(rid: int, entry: Any) -> None:
            if not req.closed:
                try:
                    req.on_event("logprobs", entry)
                except Exception:
                    log.exception("request event callback failed; cancelling the request")
                    self.cancel(req)

        return on_logprobs

    def _report(self, name: str, done: list[Seq]) -> None:
        for s in done:
            req = self._active[name].pop(s.request_id, None)
            if req is None:
                continue
            if s.error is not None:  # rejected (it can never fit); the engine goes on
                self._close(req, "error", s.error)
                continue
            self.finished[name] += 1
            self._close(req, "done", Finished.of(s))

    def _close(self, req: Request, kind: str | None, value: Any) -> None:
        with self._lock:  # (the loop thread, or stop() past a stuck step)
            if req.closed:
                return
            req.closed = True
            self._outstanding[req.model] -= 1
        if kind == "error":
            self.errors[req.model] += 1
        if kind is not None:
            try:
                req.on_event(kind, value)
            except Exception:  # a consumer's bug must not stop the other tenants
                log.exception("request event callback failed")

    def _fail_engine(self, name: str, err: BaseException) -> None:
        log.error("engine %r failed and is taken out of service: %r", name, err)
        self.failed[name] = repr(err)
        for req in self._active[name].values():
            self._close(req, "error", Unavailable(f"model {name!r} failed: {err!r}"))
        self._active[name].clear()
        self.sleep_control.fail(name, err)

    def _abort_all(self, name: str, err: Exception) -> None:
        """Ends every request ``name``'s engine runs with ``err`` (their blocks freed)."""
        engine = self.engines[name]
        for rid, req in list(self._active[name].items()):
            engine.abort(rid)
            self._active[name].pop(rid, None)
            self._close(req, "error", err)

    def _shutdown(self) -> None:
        with self._lock:
            self._accepting = False
        self._drain()
        self.sleep_control.shutdown()
        for name, engine in self.engines.items():
            if name not in self.failed:
                try:
                    engine.drain()
                    self._report(name, engine.drain_finished())
                except Exception as e:
                    log.error("completing %r at shutdown failed: %r", name, e)
            for req in list(self._active[name].values()):
                if req.request_id is not None:
                    try:
                        engine.abort(req.request_id)
                    except Exception as e:
                        log.error("aborting a request of %r at shutdown failed: %r", name, e)
                self._close(req, "error", Unavailable("the server is shutting down"))
            self._active[name].clear()
