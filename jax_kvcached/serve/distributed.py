"""One model across processes (hosts) on JAX's multi-controller runtime, as sglang-jax
runs it: ``serve --nnodes N --node-rank R --dist-init-addr HOST:PORT``.

Every rank initializes ``jax.distributed`` (coordinator at ``HOST:PORT``; gloo
collectives on CPU devices), builds the same pool over every process's devices (one TP
pool per device, each process mapping its own) and the same engine. Rank 0 serves HTTP
and decides; the others follow:

- The step channel (rank 0 listens on ``HOST:PORT+1``; :mod:`step_channel`): JSON frames
  between ranks that proved they hold the shared secret (``--dist-secret-file`` or
  ``KVCACHED_DIST_SECRET``, required with ``--nnodes`` > 1); a stranger is dropped
  before anything it sent is decoded. Each follower says hello with its flags; rank 0
  refuses one whose flags differ, naming them. Every message is checked for its form.
- Rank 0's engine is wrapped (:class:`MirroredEngine`): what changes an engine's state
  between steps (a request added with its seed drawn, an abort, a prefix-cache reset)
  is recorded, and each step sends the records since the last one, then runs the step.
  A follower applies them to its engine and runs the same step: the same scheduler
  decisions (request ids, tokens per sequence, blocks, preemptions) from the same
  inputs, checked each step by a digest of the schedule; the device program's
  collectives join the ranks' shards. Followers' outputs are dropped.
- A rank that dies: the others see its connection close. Rank 0 then fails every
  request (503, ``server_error``) and exits with status 1, a follower exits with 1; a
  step stuck in a collective with a dead peer is not waited for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jax_kvcached.engine.config import ConfigError
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.serve.config import ServeConfig
from jax_kvcached.serve.step_channel import HELLO_FRAME, Channel, ChannelError

log = logging.getLogger("jax_kvcached.serve")

# Flags that may differ between ranks (they do not change the model, its pool or a step).
_LOCAL = {"node_rank", "host", "port", "api_key", "api_key_file", "admin_key",
          "admin_key_file", "tenant_keys_file", "dist_secret_file",
          "allow_unauthenticated_admin", "access_log", "log_level", "allowed_origins",
          "allowed_hosts", "max_connections",
          "shutdown_timeout", "compile_cache", "max_queue", "dist_timeout"}  # fmt: skip


def _address(c: ServeConfig) -> tuple[str, int]:
    host, _, port = c.dist_init_addr.rpartition(":")
    return host.strip("[]"), int(port)


def initialize(c: ServeConfig) -> None:
    """``jax.distributed`` for ``--nnodes`` > 1: before anything starts JAX's backends.
    RuntimeError naming the address when the ranks do not meet in ``--dist-timeout``."""
    import jax

    if c.node_rank == 0:
        _coordinator_port_free(c)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        # The coordinator listens on the address given only (JAX's default is every
        # interface): it has no authentication (docs/security.md).
        jax.distributed.initialize(
            c.dist_init_addr, num_processes=c.nnodes, process_id=c.node_rank,
            initialization_timeout=max(1, int(c.dist_timeout)),
            coordinator_bind_address=c.dist_init_addr if c.node_rank == 0 else None,
        )  # fmt: skip
    except Exception as e:  # (XlaRuntimeError: DEADLINE_EXCEEDED, address in use, ...)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"rank {c.node_rank}: the {c.nnodes} ranks did not meet at --dist-init-addr "
            f"{c.dist_init_addr} within {c.dist_timeout:g} s ({first})"
        ) from None


def _coordinator_port_free(c: ServeConfig) -> None:
    """Rank 0: jax.distributed aborts the process when its coordinator's port is taken;
    a clear error first."""
    host, port = _address(c)
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise RuntimeError(f"rank 0: cannot listen on --dist-init-addr {c.dist_init_addr} "
                           f"for jax.distributed's coordinator: {e.strerror}") from None


def flags(c: ServeConfig) -> dict[str, Any]:
    """The flags every rank must share, as JSON writes them."""
    out = {k: v for k, v in dataclasses.asdict(c).items() if k not in _LOCAL}
    out["engine"] = dataclasses.asdict(c.engine)
    return json.loads(json.dumps(out, default=str))


# -- messages: plain data, each checked for its form -----------------------------------------
_KW = {"cache_salt": (str, type(None)), "adapter": (str, type(None)),
       "fork_of": (int, type(None))}  # fmt: skip
_TUPLES = ("stop_token_ids", "stop", "logit_bias")  # SamplingParams' tuple fields


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def encode_op(op: tuple) -> list:
    if op[0] == "add":
        _, rid, ids, params, kw = op
        return ["add", rid, ids, dataclasses.asdict(params), kw]
    return list(op)


def decode_ops(ops: Any) -> list[tuple]:
    """The engine changes of a step message (ChannelError naming what is malformed)."""
    if not isinstance(ops, list):
        raise ChannelError("a step's changes are not a list")
    out: list[tuple] = []
    for op in ops:
        if not isinstance(op, list) or not op:
            raise ChannelError(f"a malformed change: {str(op)[:80]}")
        if op[0] == "add" and len(op) == 5:
            _, rid, ids, params, kw = op
            if not (_is_int(rid) and isinstance(ids, list) and all(map(_is_int, ids))
                    and isinstance(params, dict) and isinstance(kw, dict)):  # fmt: skip
                raise ChannelError("a malformed request")
            if not set(kw) <= set(_KW) or not all(isinstance(v, _KW[k]) for k, v in kw.items()):
                raise ChannelError(f"a request with unknown options: {sorted(kw)}")
            try:
                fixed = {k: (tuple(tuple(x) if isinstance(x, list) else x for x in v)
                             if k in _TUPLES and isinstance(v, list) else v)
                         for k, v in params.items()}  # fmt: skip
                out.append(("add", rid, ids, SamplingParams(**fixed), kw))
            except (TypeError, ValueError) as e:
                raise ChannelError(f"a request's sampling parameters: {e}") from None
        elif op[0] == "abort" and len(op) == 2 and _is_int(op[1]):
            out.append(("abort", op[1]))
        elif op == ["reset"]:
            out.append(("reset",))
        else:
            raise ChannelError(f"an unknown change: {str(op)[:80]}")
    return out


def _listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _differences(mine: dict, theirs: dict) -> list[str]:
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{d}" for d in _differences(a, b)]
        elif a != b:
            out.append(f"{key} ({b!r} here, {a!r} on rank 0)")
    return out


class StepLeader:
    """Rank 0's end of the step channel: every follower connected, authenticated and
    checked."""

    def __init__(self, c: ServeConfig, secret: bytes) -> None:
        host, port = _address(c)
        self.nnodes = c.nnodes
        try:
            self._listener = _listener(host, port + 1)
        except OSError as e:
            raise RuntimeError(f"rank 0: cannot listen on {host}:{port + 1} (the step "
                               f"channel, --dist-init-addr's PORT+1): {e}") from None  # fmt: skip
        self._conns: dict[int, Channel] = {}
        accepted: list[Channel] = []
        done = threading.Event()
        handshake_s = min(10.0, c.dist_timeout)

        def accept() -> None:
            while len(accepted) < c.nnodes - 1:
                try:
                    sock, peer = self._listener.accept()
                except OSError:  # (the listener closed: the deadline passed)
                    break
                try:  # (a stranger that stalls holds the line at most handshake_s)
                    accepted.append(Channel.accept(sock, secret, handshake_s))
                except (ChannelError, EOFError, OSError) as e:
                    log.warning("rank 0: refused a connection to the step channel from %s "
                                "(%s)", peer[0], e)  # fmt: skip
                    sock.close()
            done.set()

        threading.Thread(target=accept, daemon=True).start()
        if not done.wait(c.dist_timeout):
            self._listener.close()
            raise RuntimeError(f"rank 0: {len(accepted)} of the {c.nnodes - 1} other ranks "
                               f"joined within --dist-timeout {c.dist_timeout:g} s")  # fmt: skip
        mine = flags(c)
        bad = []
        for conn in accepted:
            if not conn.poll(c.dist_timeout):
                self.close()
                raise RuntimeError("rank 0: a rank joined the step channel but never said "
                                   "which it is")  # fmt: skip
            try:
                hello = conn.recv(HELLO_FRAME)
                if not (isinstance(hello, list) and len(hello) == 3 and hello[0] == "hello"
                        and _is_int(hello[1]) and isinstance(hello[2], dict)):  # fmt: skip
                    raise ChannelError("its first message is not a hello")
            except (ChannelError, EOFError, OSError) as e:
                conn.close()
                bad.append(f"a rank's hello was refused ({e})")
                continue
            _, rank, theirs = hello
            if rank in self._conns or not 0 < rank < c.nnodes:
                why = (f"rank {rank} joined twice (two processes with --node-rank {rank})"
                       if rank in self._conns else f"rank {rank} is not in [1, {c.nnodes})")
                conn.send(["error", why])
                bad.append(why)
                continue
            diff = _differences(mine, theirs)
            if diff:
                why = f"rank {rank}'s flags differ from rank 0's: " + "; ".join(diff)
                conn.send(["error", why])
                bad.append(why)
            self._conns[rank] = conn
        if bad:
            self.close()
            raise ConfigError("nnodes", ": " + " | ".join(bad))
        for conn in self._conns.values():
            conn.send(["ok"])
        self._lock = threading.Lock()
        self.lost: str | None = None  # why a follower went away (None: none did)
        self._lost = threading.Event()

    def lost_reason(self, wait: float) -> str | None:
        """Why a follower is gone, waiting up to ``wait`` seconds to learn it (None: as
        far as is known, none is)."""
        self._lost.wait(wait)
        return self.lost

    def send(self, msg: list) -> None:
        """To every follower (OSError when one is gone)."""
        with self._lock:
            for conn in self._conns.values():
                conn.send(msg)

    def watch(self, lost: Callable[[int, str], None]) -> None:
        """Calls ``lost(rank, why)`` (from a thread of its own) when a follower goes
        away or reports an error."""

        def wait(rank: int, conn: Channel) -> None:
            try:
                msg = conn.recv(HELLO_FRAME)
                ok = isinstance(msg, list) and len(msg) == 2 and msg[0] == "error"
                why = str(msg[1])[:2000] if ok else "it sent an unexpected message"
            except (EOFError, OSError):
                why = "its connection closed (the process died or was killed)"
            except ChannelError as e:
                why = f"its channel failed: {e}"
            if self._conns:  # (not a shutdown)
                self.lost = f"rank {rank} of the server across hosts is gone ({why})"
                self._lost.set()
                lost(rank, why)

        for rank, conn in self._conns.items():
            threading.Thread(target=wait, args=(rank, conn), daemon=True,
                             name=f"kvcached-rank-{rank}").start()  # fmt: skip

    def close(self) -> None:
        """Tells the followers to stop (best effort) and closes the channel."""
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            try:
                conn.send(["stop"])
                conn.close()
            except OSError:
                pass
        self._listener.close()


class MirroredEngine:
    """Rank 0's engine as the serving loop sees it: what changes its state is recorded
    and reaches the followers with the next step (see the module docstring)."""

    def __init__(self, engine: Any, leader: StepLeader) -> None:
        self._engine = engine
        self._leader = leader
        self._ops: list[tuple] = []
        self._lock = threading.RLock()

    # Structured outputs: not across hosts yet (each rank would need the request's
    # matcher, and the step channel carries no grammar); the routes answer 400.
    grammars = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, prompt: Any, params: SamplingParams | None = None,
                    on_token: Any = None, **kw: Any) -> int:  # fmt: skip
        if params is not None and params.structured is not None:
            raise ValueError("structured outputs are not served across hosts yet")
        ids = list(self._engine.prompt(prompt).token_ids)
        params = (params or SamplingParams()).seeded()  # one seed for every rank
        with self._lock:
            rid = self._engine.add_request(ids, params, on_token, **kw)
            kw.pop("on_logprobs", None)
            self._ops.append(encode_op(("add", rid, ids, params, kw)))
        return rid

    def abort(self, request_id: int) -> bool:
        with self._lock:
            self._ops.append(["abort", request_id])
            return self._engine.abort(request_id)

    def reset_prefix_cache(self) -> int:
        with self._lock:
            self._ops.append(["reset"])
            return self._engine.reset_prefix_cache()

    def step(self) -> list:
        with self._lock:
            ops, self._ops = self._ops, []
            pacer = self._engine.pacer  # its chunk decides this step: the followers take it
            chunk = None if pacer is None else pacer.chunk
            return self._guarded(lambda: (
                self._leader.send(["step", ops, self._engine.schedule_digest, chunk]),
                self._engine.step())[1])  # fmt: skip

    def drain(self) -> list:
        with self._lock:
            ops, self._ops = self._ops, []
            return self._guarded(lambda: (self._leader.send(["drain", ops]),
                                          self._engine.drain())[1])  # fmt: skip

    def _guarded(self, run: Callable[[], list]) -> list:
        """``run()``; a failure caused by a follower gone names it."""
        try:
            return run()
        except Exception as e:
            why = self._leader.lost_reason(wait=5.0)
            if why is not None:
                raise RuntimeError(why + "; the server stops") from e
            raise

    def sleep(self, *args: Any, **kw: Any) -> Any:
        raise ValueError("sleep is not supported when serving across hosts (--nnodes > 1)")

    wake = sleep


def _apply(engine: Any, ops: list[tuple]) -> None:
    for op in ops:
        if op[0] == "add":
            _, rid, ids, params, kw = op
            got = engine.add_request(ids, params, None, **kw)
            if got != rid:
                raise RuntimeError(f"request ids diverged: {got} here, {rid} on rank 0")
        elif op[0] == "abort":
            engine.abort(op[1])
        elif op[0] == "reset":
            engine.reset_prefix_cache()


def connect(c: ServeConfig) -> StepLeader | Channel:
    """The step channel, before jax.distributed starts (which aborts the process on a
    missing rank): rank 0 waits for every follower, authenticated, and checks their
    flags; a follower joins rank 0. RuntimeError / ConfigError, naming what, when that
    fails (a missing or weak secret included)."""
    secret = c.dist_secret()
    if c.node_rank == 0:
        return StepLeader(c, secret)
    host, port = _address(c)
    deadline = time.monotonic() + c.dist_timeout
    while True:
        try:
            sock = socket.create_connection((host, port + 1), timeout=5.0)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {c.node_rank}: rank 0 did not answer at --dist-init-addr "
                    f"{c.dist_init_addr} (its step channel, port {port + 1}) within "
                    f"{c.dist_timeout:g} s ({e.strerror or e}; is rank 0 started?)"
                ) from None
            time.sleep(0.2)
    try:
        conn = Channel.connect(sock, secret, timeout=max(1.0, deadline - time.monotonic()))
        conn.send(["hello", c.node_rank, flags(c)])
        reply = conn.recv(HELLO_FRAME)
    except (ChannelError, EOFError, OSError) as e:
        sock.close()
        raise RuntimeError(f"rank {c.node_rank}: the step channel to rank 0 failed ({e}; "
                           "is the shared secret the same on every rank?)") from None  # fmt: skip
    if isinstance(reply, list) and reply[:1] == ["error"] and len(reply) == 2:
        raise ConfigError("nnodes", ": " + str(reply[1]))
    if reply != ["ok"]:
        raise RuntimeError(f"rank {c.node_rank}: rank 0 answered {str(reply)[:80]}")
    return conn


def follow(c: ServeConfig, conn: Channel, engine: Any) -> None:
    """A follower's life after :func:`connect`: runs every step rank 0 sends until told
    to stop. RuntimeError when rank 0 goes away or the ranks' schedules diverge."""
    log.info("rank %d follows rank 0's steps", c.node_rank)
    inbox: queue.Queue = queue.Queue()

    def read() -> None:  # (a step stuck in a collective with a dead rank 0 is not read)
        try:
            while True:
                msg = conn.recv()
                if not isinstance(msg, list) or not msg:
                    raise ChannelError("a message that is not a command")
                inbox.put(msg)
                if msg[0] == "stop":
                    return
        except ChannelError as e:
            log.error("rank %d: rank 0's message was refused (%s); exiting", c.node_rank, e)
            inbox.put(("gone",))
            exit_soon(5.0)
        except (EOFError, OSError):
            log.error("rank %d: rank 0 went away (its connection closed); exiting",
                      c.node_rank)  # fmt: skip
            inbox.put(("gone",))
            exit_soon(5.0)

    threading.Thread(target=read, daemon=True, name="kvcached-steps").start()
    try:
        while True:
            msg = inbox.get()
            if msg[0] == "stop":
                log.info("rank %d: rank 0 stopped; exiting", c.node_rank)
                return
            if msg[0] == "gone":
                raise RuntimeError(f"rank {c.node_rank}: rank 0 went away (its connection "
                                   "closed)")  # fmt: skip
            if msg[0] == "drain" and len(msg) == 2:
                _apply(engine, decode_ops(msg[1]))
                engine.drain()
            elif msg[0] == "step" and len(msg) == 4:
                _, ops, digest, chunk = msg
                ops = decode_ops(ops)
                if chunk is not None and (not isinstance(chunk, (int, float))
                                          or isinstance(chunk, bool) or not chunk >= 0):
                    raise ChannelError("a step's chunk is not a number of tokens")
                if digest != engine.schedule_digest:
                    raise RuntimeError(f"rank {c.node_rank}'s schedule diverged from rank 0's "
                                       f"at step {engine.steps}")  # fmt: skip
                _apply(engine, ops)
                if chunk is not None:
                    engine.pacer.follow(chunk)
                engine.step()
            else:
                raise ChannelError(f"an unknown command {str(msg[0])[:40]!r}")
            engine.drain_finished()
    except BaseException as e:
        try:
            conn.send(["error", f"rank {c.node_rank} failed: {e}"])
        except OSError:
            pass
        raise


def exit_soon(seconds: float = 2.0, status: int = 1) -> None:
    """Ends the process after ``seconds`` (error answers go out first), whatever a
    thread stuck in a collective with a dead peer is doing."""

    def bye() -> None:
        time.sleep(seconds)
        logging.shutdown()
        os._exit(status)

    threading.Thread(target=bye, daemon=True).start()
