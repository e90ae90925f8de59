"""vLLM's KV-event transport: msgpack batches on a ZMQ PUB socket, with sequence numbers
and a replay socket (``--kv-events-config``'s ``zmq`` publisher, same wire).

Each message is three frames: the topic, the batch's sequence number (8 bytes, big
endian, from 0) and the batch (``kv_events.encode_batch``). A subscriber that missed
batches (it started late, or saw a gap in the numbers) sends the first number it wants
(8 bytes, big endian) to the replay socket (ROUTER; a REQ or DEALER client) and gets
``[seq, batch]`` for every buffered batch from there, then ``[-1, b""]``.

Endpoints as vLLM takes them: one with ``*``, ``::``, ``ipc://`` or ``inproc://`` is
bound, any other connected to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from jax_kvcached.engine.kv_events import KVEventLog, batches, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:  # (EngineConfig checks it first)
        raise RuntimeError(
            "KV-cache events need pyzmq: pip install 'jax-kvcached[events]' (or pyzmq)"
        ) from None
    return zmq


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
    ) -> None:
        zmq = _zmq()
        self.events = events
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        self._pub.set_hwm(100_000)
        try:
            self._pub.bind(endpoint) if _binds(endpoint) else self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
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
                payload = encode_batch(time.time(), batch, self._rank)
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

    def close(self) -> None:
        """Publishes what is pending, then closes the sockets."""
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout=5)
        self._close_sockets(linger=500)  # (what is queued still goes out)
