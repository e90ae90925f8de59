"""The step channel between the ranks of a server across hosts, attacked as a stranger on
the network would: a pickle, a wrong secret, a malformed, oversized, tampered or replayed
message. Each is refused before anything of it is decoded, and rank 0 still admits its
real follower afterwards. (tests/test_multihost.py runs the ranks end to end.)"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading

import pytest
from conftest import dist_addr

from jax_kvcached.engine.config import ConfigError
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.serve import distributed
from jax_kvcached.serve.config import ServeConfig
from jax_kvcached.serve.step_channel import (
    MAX_FRAME,
    SECRET_ENV,
    Channel,
    ChannelError,
    load_secret,
)

SECRET = b"0123456789abcdef-the-ranks-secret"


def _config(rank: int, addr: str, **kw) -> ServeConfig:
    return ServeConfig(models=["m=tiny-llama"], nnodes=2, node_rank=rank, dist_init_addr=addr,
                       dist_timeout=20, **kw)  # fmt: skip


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())


def _pair(secret_a=SECRET, secret_b=SECRET):
    """A listening and a joining end over loopback; either may fail its handshake."""
    server = socket.create_server(("127.0.0.1", 0))
    out: dict = {}

    def accept():
        sock, _ = server.accept()
        try:
            out["leader"] = Channel.accept(sock, secret_a, 5)
        except (ChannelError, EOFError, OSError) as e:
            out["leader"] = e
            sock.close()

    t = threading.Thread(target=accept)
    t.start()
    sock = socket.create_connection(server.getsockname())
    try:
        out["follower"] = Channel.connect(sock, secret_b, 5)
    except (ChannelError, EOFError, OSError) as e:
        out["follower"] = e
    t.join()
    server.close()
    return out["leader"], out["follower"]


def test_a_peer_without_the_secret_is_refused_both_ways():
    leader, follower = _pair(SECRET, b"another-secret-of-16+bytes")
    assert isinstance(leader, ChannelError) and "does not hold the shared secret" in str(leader)
    assert isinstance(follower, (ChannelError, EOFError, OSError))
    leader, follower = _pair()  # the same secret: both ends admitted, data flows
    follower.send(["hello", 1, {"a": [1, 2]}])
    assert leader.recv() == ["hello", 1, {"a": [1, 2]}]
    leader.send(["ok"])
    assert follower.recv() == ["ok"]


def test_malformed_oversized_tampered_and_replayed_frames_are_refused():
    leader, follower = _pair()
    raw = follower.socket
    raw.sendall(struct.pack(">I", MAX_FRAME + 1))  # the length alone: nothing more read
    with pytest.raises(ChannelError, match="exceeds"):
        leader.recv()
    # a frame made by hand as the sender would: accepted as it is, refused altered
    leader, follower = _pair()
    data = b'["x",1]'
    follower.socket.sendall(follower.frame(data))
    assert leader.recv() == ["x", 1]
    frame = bytearray(follower.frame(data))
    frame[-2] ^= 1  # one bit of the body changed in transit
    follower.socket.sendall(bytes(frame))
    with pytest.raises(ChannelError, match="authentication"):
        leader.recv()
    # a replay: a frame sent again is out of sequence
    leader, follower = _pair()
    follower.send(["step", 1])
    first = leader.socket.recv(4 + 32 + 64, socket.MSG_PEEK)
    assert leader.recv() == ["step", 1]
    follower.socket.sendall(first)
    with pytest.raises(ChannelError, match="authentication"):
        leader.recv()
    # valid authentication, bytes that are not JSON
    leader, follower = _pair()
    follower.socket.sendall(follower.frame(b"\x80not json"))
    with pytest.raises(ChannelError, match="not JSON"):
        leader.recv()


def test_the_secret_is_required_strong_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="a shared secret is required"):
        load_secret(None)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret(None)
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="readable or writable by others"):
        load_secret(str(f))
    f.chmod(0o600)
    assert load_secret(str(f)) == SECRET
    if os.getuid() == 0:  # (only root can give a file away)
        os.chown(f, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to another user"):
            load_secret(str(f))
    # serve refuses to start across hosts without one, naming the flag
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError, match="dist_secret_file.*a shared secret is required"):
        _config(0, "127.0.0.1:7000")


def test_rank_0_refuses_a_pickle_and_a_stranger_then_admits_its_follower(tmp_path,
                                                                       secret_env):  # fmt: skip
    addr = dist_addr()
    host, port = "127.0.0.1", int(addr.rsplit(":", 1)[1]) + 1
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(leader=distributed.connect(_config(0, addr))))
    t.start()
    deadline = 50
    while deadline:
        try:
            probe = socket.create_connection((host, port), timeout=1)
            break
        except OSError:
            import time

            time.sleep(0.1)
            deadline -= 1
    # A pickle that would create a file if rank 0 unpickled it (the old channel did).
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = pickle.dumps(Exploit())
    probe.sendall(struct.pack("!i", len(evil)) + evil)
    probe.close()
    # A stranger that speaks the protocol but guesses the secret.
    with socket.create_connection((host, port)) as s2, pytest.raises(
            (ChannelError, EOFError, OSError)):  # fmt: skip
        Channel.connect(s2, b"a-guess-of-the-secret-16", 5)
    conn = distributed.connect(_config(1, addr))  # the real follower joins
    t.join(30)
    leader = got["leader"]
    assert not marker.exists()
    leader.send(["step", [["abort", 3]], None, None])
    assert conn.recv() == ["step", [["abort", 3]], None, None]
    leader.close()
    conn.close()


def test_a_step_message_is_checked_for_its_form():
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=3, stop=["x"],
                            logit_bias={7: -1.5}, stop_token_ids=[9])  # fmt: skip
    op = distributed.encode_op(("add", 4, [1, 2, 3], params, {"cache_salt": "s"}))
    import json

    (back,) = distributed.decode_ops(json.loads(json.dumps([op])))
    assert back == ("add", 4, [1, 2, 3], params, {"cache_salt": "s"})
    bad = [
        "not a list", [["add", 1, [1, "x"], {}, {}]], [["add", 1, [1], {"bogus": 1}, {}]],
        [["add", 1, [1], {}, {"on_token": "os.system"}]], [["rm", "-rf"]], [["abort", "1"]],
        [["add", 1, [1], {"max_tokens": -1}, {}]],
    ]  # fmt: skip
    for ops in bad:
        with pytest.raises(ChannelError):
            distributed.decode_ops(ops)
