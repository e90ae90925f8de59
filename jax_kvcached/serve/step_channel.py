"""The step channel between the ranks of a server across hosts: plain data, never pickle,
between peers that prove they hold the same secret before a byte of a message is read.

A connection starts with a mutual challenge: the listening end sends a random nonce, the
joining end answers with its own nonce and an HMAC-SHA256 of both under the shared
secret, the listener checks it (a peer without the secret is dropped there, nothing of
it decoded) and proves itself the same way. Both ends then derive a session key from
the secret and the two nonces. Every frame is a 4-byte length, an HMAC of (its sequence
number, its bytes) under the sender's direction key, and a JSON document; a frame over
its size bound, with a wrong tag (tampered, replayed, reordered) or not JSON is a
:class:`ChannelError`. The frames are authenticated, not encrypted: token ids cross the
wire in the clear (docs/security.md: keep the ranks on a private network).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import select
import socket
import stat
import struct
from typing import Any

MAX_FRAME = 64 << 20  # bytes of one message (a step's new prompts; far above any real one)
HELLO_FRAME = 1 << 20  # bytes of a joining rank's first message (its flags)
MIN_SECRET = 16  # bytes
SECRET_ENV = "KVCACHED_DIST_SECRET"
_MAGIC = b"KVCSTEP1"
_NONCE = 32
_TAG = 32


class ChannelError(Exception):
    """The peer is not who it must be, or sent what the protocol does not allow."""


def load_secret(path: str | None) -> bytes:
    """The shared secret: the file at ``path`` (owned by this user, not readable by
    others), else the environment variable ``KVCACHED_DIST_SECRET``. ValueError naming
    what is wrong: none given, too short, or a file others may read."""
    if path:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None
        if st.st_uid != os.getuid():
            raise ValueError(f"the secret file {path} belongs to another user")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"the secret file {path} is readable or writable by others "
                             f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")  # fmt: skip
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
        if not secret:
            raise ValueError(f"a shared secret is required: --dist-secret-file PATH or "
                             f"{SECRET_ENV} (the same on every rank)")  # fmt: skip
    if len(secret) < MIN_SECRET:
        raise ValueError(f"the shared secret must be at least {MIN_SECRET} bytes, got "
                         f"{len(secret)}")  # fmt: skip
    return secret


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        out += chunk
    return bytes(out)


class Channel:
    """One authenticated connection (see the module docstring). ``send`` / ``recv``
    carry JSON-able values; ``recv`` raises :class:`ChannelError` on anything else,
    ``EOFError`` / ``OSError`` when the peer is gone."""

    def __init__(self, sock: socket.socket, session: bytes, listening: bool) -> None:
        self._sock = sock
        mine, theirs = (b"leader", b"follower") if listening else (b"follower", b"leader")
        self._send_key = _mac(session, b"send " + mine)
        self._recv_key = _mac(session, b"send " + theirs)
        self._sent = 0
        self._received = 0

    # -- the handshake ----------------------------------------------------------------------
    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, timeout: float) -> Channel:
        """The listening end's handshake on an accepted socket (ChannelError: the peer
        does not hold the secret; nothing it sent is decoded)."""
        sock.settimeout(timeout)
        mine = os.urandom(_NONCE)
        sock.sendall(_MAGIC + mine)
        theirs = _read(sock, _NONCE)
        proof = _read(sock, _TAG)
        if not hmac.compare_digest(proof, _mac(secret, b"follower", mine, theirs)):
            raise ChannelError("the peer does not hold the shared secret")
        sock.sendall(_mac(secret, b"leader", mine, theirs))
        sock.settimeout(None)
        return cls(sock, _mac(secret, b"session", mine, theirs), listening=True)

    @classmethod
    def connect(cls, sock: socket.socket, secret: bytes, timeout: float) -> Channel:
        """The joining end's handshake (ChannelError: the listener is not one of ours)."""
        sock.settimeout(timeout)
        if _read(sock, len(_MAGIC)) != _MAGIC:
            raise ChannelError("the listener does not speak the step channel")
        theirs = _read(sock, _NONCE)
        mine = os.urandom(_NONCE)
        sock.sendall(mine + _mac(secret, b"follower", theirs, mine))
        proof = _read(sock, _TAG)
        if not hmac.compare_digest(proof, _mac(secret, b"leader", theirs, mine)):
            raise ChannelError("rank 0 does not hold the shared secret")
        sock.settimeout(None)
        return cls(sock, _mac(secret, b"session", theirs, mine), listening=False)

    # -- frames -----------------------------------------------------------------------------
    @property
    def socket(self) -> socket.socket:
        """The connection's socket (its bytes are the frames)."""
        return self._sock

    def frame(self, data: bytes) -> bytes:
        """The next frame carrying ``data`` (counted as sent)."""
        if len(data) > MAX_FRAME:
            raise ChannelError(f"a message of {len(data)} bytes exceeds {MAX_FRAME}")
        tag = _mac(self._send_key, struct.pack(">Q", self._sent), data)
        self._sent += 1
        return struct.pack(">I", len(data)) + tag + data

    def send(self, msg: Any) -> None:
        self._sock.sendall(self.frame(json.dumps(msg, separators=(",", ":")).encode()))

    def recv(self, max_bytes: int = MAX_FRAME) -> Any:
        (n,) = struct.unpack(">I", _read(self._sock, 4))
        if n > max_bytes:
            raise ChannelError(f"a message of {n} bytes exceeds the bound of {max_bytes}")
        tag, data = _read(self._sock, _TAG), _read(self._sock, n)
        want = _mac(self._recv_key, struct.pack(">Q", self._received), data)
        if not hmac.compare_digest(tag, want):
            raise ChannelError("a message failed its authentication (tampered or replayed)")
        self._received += 1
        try:
            return json.loads(data)
        except ValueError:
            raise ChannelError("a message is not JSON") from None

    def poll(self, timeout: float) -> bool:
        """Whether a frame (or the end of the stream) can be read within ``timeout``."""
        return bool(select.select([self._sock], [], [], timeout)[0])

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
