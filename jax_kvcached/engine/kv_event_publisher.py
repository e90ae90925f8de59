"""vLLM's KV-event transport: msgpack batches on a ZMQ PUB socket, with sequence numbers
and a replay socket (``--kv-events-config``'s ``zmq`` publisher, same wire).

Each message is three frames: the topic, the batch's sequence number (8 bytes, big
endian, from 0) and the batch (``kv_events.encode_batch``). A subscriber that missed
batches (it started late, or saw a gap in the numbers) sends the first number it wants
(8 bytes, big endian) to the replay socket (ROUTER; a REQ or DEALER client) and gets
``[seq, batch]`` for every buffered batch from there, then ``[-1, b""]``.

Endpoints as vLLM takes them: one with ``*``, ``::``, ``ipc://`` or ``inproc://`` is
bound, any other connected to.

Events carry each stored block's token ids (the prompts) to whoever subscribes. Without
``curve_dir`` there is no authentication, so use ``ipc://`` or a loopback subscriber (a
warning says so otherwise), or publish hashes only (``token_ids=False``). With
``curve_dir`` both sockets are ZMQ CURVE servers (encrypted; only the subscribers whose
public certificates are in ``curve_dir/clients`` complete the handshake): see
:func:`curve_keys`. Bounds against a stranger's subscriber: at
most :data:`SEND_HWM` messages queued per subscriber (then PUB drops; a subscriber
replays), inbound messages of :data:`MAX_INBOUND` bytes, and :data:`REPLAYS_PER_S`
replays a second (more get only the end marker).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

from jax_kvcached.engine.kv_events import KVEventLog, batches, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEND_HWM = 1000  # messages queued per subscriber
MAX_INBOUND = 1024  # bytes of a message the sockets accept (a replay request is 8)
REPLAYS_PER_S = 5.0


def private_endpoint(endpoint: str) -> bool:
    """Whether only this host's users can reach ``endpoint`` (loopback, ipc, inproc)."""
    return endpoint.startswith(("ipc://", "inproc://")) or any(
        h in endpoint for h in ("://127.0.0.1:", "://localhost:", "://[::1]:"))  # fmt: skip


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:  # (EngineConfig checks it first)
        raise RuntimeError(
            "KV-cache events need pyzmq: pip install 'jax-kvcached[events]' (or pyzmq)"
        ) from None
    return zmq


def curve_keys(curve_dir: str) -> tuple[bytes, bytes, str]:
    """``(public, secret, clients)`` of a CURVE folder: ``server.key_secret`` (our
    certificate, as ``zmq.auth.create_certificates(curve_dir, "server")`` writes it) and
    ``clients/`` (one public certificate per subscriber allowed). The folder must be
    this user's and writable by no one else. ValueError naming what is wrong."""
    import zmq.auth

    from jax_kvcached.engine.executables import untrusted

    clients = os.path.join(curve_dir, "clients")
    try:
        why = untrusted(curve_dir) or untrusted(clients)
        if why is None and os.stat(curve_dir).st_mode & 0o077:
            why = "is readable by others (it holds our secret key: chmod 700)"
        public, secret = zmq.auth.load_certificate(os.path.join(curve_dir, "server.key_secret"))
        allowed = [f for f in os.listdir(clients) if f.endswith(".key")]
    except (OSError, ValueError) as e:
        raise ValueError(f"KV events: CURVE folder {curve_dir!r}: {e}") from None
    if why is not None:
        raise ValueError(f"KV events: CURVE folder {curve_dir!r} {why}")
    if secret is None:
        raise ValueError(f"KV events: {curve_dir}/server.key_secret holds no secret key")
    if not allowed:
        raise ValueError(f"KV events: {clients} holds no subscriber's certificate (.key)")
    return public, secret, clients


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes a :class:`KVEventLog`'s events from a thread of its own.

    Args:
      events: the log to publish.
      endpoint: the PUB socket's address, e.g. ``tcp://*:5557``.
      replay_endpoint: the replay socket's address (None: no replay).
      topic: the first frame of every message.
      buffer_steps: batches kept for replay.
      data_parallel_rank: sent in each batch when given (vLLM's DP rank).
      token_ids: publish each stored block's token ids (False: hashes only).
      curve_dir: CURVE encryption and subscriber authentication (:func:`curve_keys`);
        bound endpoints only.
    """

    def __init__(
        self,
        events: KVEventLog,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        token_ids: bool = True,
        curve_dir: str | None = None,
    ) -> None:
        zmq = _zmq()
        self._token_ids = token_ids
        self._replays: deque[float] = deque(maxlen=max(1, int(REPLAYS_PER_S)))
        curve = None
        if curve_dir is not None:
            if not _binds(endpoint):
                raise ValueError(f"KV events: CURVE needs a bound endpoint (tcp://*:PORT), "
                                 f"got {endpoint!r}")  # fmt: skip
            curve = curve_keys(curve_dir)
        for e in (endpoint, replay_endpoint):
            if e is not None and token_ids and curve is None and not private_endpoint(e):
                log.warning("KV events at %s carry every stored block's token ids to any "
                            "subscriber that can connect (no authentication): bind "
                            "loopback or ipc://, or publish hashes only "
                            "(--no-kv-events-token-ids); docs/security.md", e)  # fmt: skip
        self.events = events
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # CURVE: a context of our own, its ZAP handler allowing ``clients``' keys only.
        self._ctx = zmq.Context.instance() if curve is None else zmq.Context()
        self._auth = None
        if curve is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=log)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve[2])
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        self._secure(self._pub, curve)
        self._pub.set_hwm(SEND_HWM)
        self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND)
        try:
            self._pub.bind(endpoint) if _binds(endpoint) else self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._secure(self._replay, curve)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND)
                self._replay.set_hwm(SEND_HWM)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            bad = replay_endpoint if self._replay is not None else endpoint
            raise ValueError(f"KV events: cannot open {bad!r}: {e}") from None
        self.seq = 0  # the next batch's number
        self.published = 0  # events sent
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _secure(sock: Any, curve: tuple[bytes, bytes, str] | None) -> None:
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = curve[0], curve[1]
            sock.curve_server = True

    def _run(self) -> None:
        while True:
            running = self._running
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request must not stop the stream
                    log.exception("KV events: replay request failed")
            events = self.events.take(timeout=0.02)
            for batch in batches(events):
                payload = encode_batch(time.time(), batch, self._rank, self._token_ids)
                seq = self.seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self.seq, payload))
                self.seq += 1
            self.published += len(events)
            if not running and not events:
                return

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request (%d frames)",
                        len(frames))  # fmt: skip
            return
        client, _, start = frames
        now = time.monotonic()
        if len(self._replays) == self._replays.maxlen and now - self._replays[0] < 1.0:
            log.warning("KV events: a replay refused (over %g a second)", REPLAYS_PER_S)
            self._replay.send_multipart((client, b"", END_SEQ, b""))
            return
        self._replays.append(now)
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until every event logged so far is sent (False: not within
        ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while self.events.pending() or self.published < self.events.taken:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def _close_sockets(self, linger: int = 0) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=linger)
        if self._auth is not None:
            self._auth.stop()
            self._ctx.term()

    def close(self) -> None:
        """Publishes what is pending, then closes the sockets."""
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout=5)
        self._close_sockets(linger=500)  # (what is queued still goes out)
