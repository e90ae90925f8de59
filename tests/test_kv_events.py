"""KV-cache events (engine/kv_events.py, kv_event_publisher.py): decoded with vLLM's
schema by a ZMQ subscriber, they name every block stored, evicted, spilled to the host
tier and cleared, once and in order; a late subscriber replays them."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is in the test extra")

from jax_kvcached.engine.config import ConfigError, EngineConfig  # noqa: E402
from jax_kvcached.engine.engine import Engine  # noqa: E402
from jax_kvcached.engine.kv_event_publisher import KVEventPublisher  # noqa: E402
from jax_kvcached.engine.kv_events import KVEventLog, external_hash  # noqa: E402
from jax_kvcached.engine.prefix_cache import extra_key_bytes, hash_block  # noqa: E402
from jax_kvcached.engine.sampling import SamplingParams  # noqa: E402
from jax_kvcached.models import BUILTIN_CONFIGS, build_model  # noqa: E402
from jax_kvcached.models.interface import FULL  # noqa: E402


# -- vLLM's schema (vllm/distributed/kv_events.py: the batch an array, each event a map
#    tagged by its class name), as a subscriber of vLLM's stream declares it ------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
LLAMA = BUILTIN_CONFIGS["tiny-llama"]
_n = iter(range(1000))


def endpoints():
    i = next(_n)
    return f"inproc://kv-events-{i}", f"inproc://kv-events-replay-{i}"


def subscribe(endpoint, topic=b""):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive_all(sub):
    """Every message waiting: (topic, seq, batch)."""
    out = []
    while sub.poll(200):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return out


def replay(endpoint, start):
    req = zmq.Context.instance().socket(zmq.DEALER)  # (several replies to one request)
    req.connect(endpoint)
    out = []
    req.send_multipart((b"", start.to_bytes(8, "big")))
    while True:
        _, seq, payload = req.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        out.append((seq, DECODE.decode(payload)))
    req.close(linger=0)
    return out


def apply(state, events):
    """A router's index of (medium, group) -> hashes; asserts each event is consistent
    with it (stored once, removed once; a clear forgets everything)."""
    for e in events:
        if isinstance(e, BlockStored):
            held = state.setdefault((e.medium, e.group_idx), set())
            assert not held & set(e.block_hashes), "a block stored twice"
            held |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held = state.setdefault((e.medium, e.group_idx), set())
            assert set(e.block_hashes) <= held, "a block removed that was not stored"
            assert len(set(e.block_hashes)) == len(e.block_hashes)
            held -= set(e.block_hashes)
        else:
            state.clear()


def truth(eng):
    """What the engine's tiers hold now, as published hashes."""
    out = {}
    for g, pc in enumerate(eng.kv.prefix_caches):
        out[("GPU", g)] = {external_hash(pc.key_of(b)) for b in pc.cached_blocks()}
    for g, hc in enumerate(eng.kv.host_caches):
        out[("CPU", g)] = {external_hash(h) for h in hc.keys()}
    return out


def test_every_block_stored_evicted_spilled_and_cleared_appears_once_in_order(pool):
    ep, rep = endpoints()
    eng = Engine(build_model(LLAMA, seed=3), pool, max_batch=2, max_cached_tokens=96,
                 host_cache_tokens=64, kv_events=ep, kv_events_replay=rep)  # fmt: skip
    sub = subscribe(ep)
    rng = np.random.default_rng(0)
    system = rng.integers(3, 200, 40).tolist()
    prompts = [system + rng.integers(3, 200, n).tolist() for n in (20, 35, 50, 9)]
    prompts += [rng.integers(3, 200, 70).tolist()]  # pressure: evictions, spills
    params = SamplingParams(max_tokens=4, temperature=0.0)
    state: dict = {}
    stored = removed = 0
    msgs = []
    for p in prompts:
        eng.generate([p], params)
        assert eng.kv_event_publisher.flush()
        got = receive_all(sub)
        msgs += got
        for _, _, batch in got:
            apply(state, batch.events)
            stored += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
            removed += sum(len(e.block_hashes) for e in batch.events
                           if isinstance(e, BlockRemoved))  # fmt: skip
        live = {k: v for k, v in state.items() if v}
        assert live == {k: v for k, v in truth(eng).items() if v}
    media = {e.medium for _, _, b in msgs for e in b.events if not isinstance(e, AllBlocksCleared)}
    assert media == {"GPU", "CPU"}  # the bound evicted to the host tier, which spilled
    assert stored > removed > 0
    for _, _, b in msgs:
        for e in b.events:
            if isinstance(e, BlockStored) and e.token_ids:
                assert e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes)
                assert e.lora_id is None and e.kv_cache_spec_kind == "full_attention"
    # The stream's numbers run from 0 without a gap; a batch holds one medium.
    assert [s for _, s, _ in msgs] == list(range(len(msgs)))
    for _, _, b in msgs:
        assert len({getattr(e, "medium", None) for e in b.events} - {None}) <= 1
    # A sleep spills idle prefixes to the host tier; a reset then clears everything.
    eng.sleep(1)
    eng.wake(preload_tokens=32)  # (copies the most-hit blocks back: stored on the GPU)
    assert eng.kv_event_publisher.flush()
    woke = receive_all(sub)
    for _, _, b in woke:
        apply(state, b.events)
    assert {k: v for k, v in state.items() if v} == {k: v for k, v in truth(eng).items() if v}
    back = [e for _, _, b in woke for e in b.events
            if isinstance(e, BlockStored) and e.medium == "GPU"]  # fmt: skip
    assert back and all(len(e.token_ids) == 16 * len(e.block_hashes) for e in back)
    eng.reset_prefix_cache()
    assert eng.kv_event_publisher.flush()
    tail = receive_all(sub)
    for _, _, b in tail:
        apply(state, b.events)
    tail = woke + tail
    assert isinstance(tail[-1][2].events[-1], AllBlocksCleared)
    assert not any(truth(eng).values()) and not any(state.values())
    # A subscriber that starts late replays the whole stream from its first number.
    msgs += tail
    again = replay(rep, 0)
    assert [s for s, _ in again] == [s for _, s, _ in msgs]
    assert [b.events for _, b in again] == [b.events for _, _, b in msgs]
    assert replay(rep, msgs[-1][1])[0][0] == msgs[-1][1]  # from a given number on
    eng.close()
    sub.close(linger=0)


def test_stored_hashes_are_the_prefix_chain_of_their_tokens(pool):
    ep, _ = endpoints()
    eng = Engine(build_model(LLAMA, seed=3), pool, max_batch=1, kv_events=ep,
                 kv_events_topic="kv@m")  # fmt: skip
    sub = subscribe(ep, b"kv@m")
    prompt = list(range(3, 3 + 50))
    eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert eng.kv_event_publisher.flush()
    msgs = receive_all(sub)
    assert msgs and all(t == b"kv@m" for t, _, _ in msgs)
    (e,) = [e for _, _, b in msgs for e in b.events]
    assert e.parent_block_hash is None and len(e.block_hashes) == 3  # one chain: one event
    assert e.token_ids == prompt[:48] and e.medium == "GPU" and e.group_idx == 0
    # The documented mapping: sha256(parent || int64 tokens || extra keys), chained.
    parent = None
    for i, h in enumerate(e.block_hashes):
        parent = hash_block(parent, e.token_ids[16 * i : 16 * (i + 1)],
                            extra_key_bytes(eng.name, None, None))  # fmt: skip
        assert parent == h
    eng.close()
    sub.close(linger=0)


def test_reset_with_blocks_held_removes_only_the_idle_ones(pool):
    log = KVEventLog(16, [FULL])

    class Cache:
        listener = None

    c = Cache()
    log.attach([c], [])
    log.describe(0, b"a" * 32, None, range(16))
    log.describe(0, b"b" * 32, b"a" * 32, range(16, 32))
    c.listener.stored([b"a" * 32, b"b" * 32])
    with log.resetting():
        c.listener.removed([b"b" * 32])  # "a" is still cached: no AllBlocksCleared
        assert log.take(timeout=0.01) == []  # (held back while the reset runs)
    events = log.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [b"a" * 32, b"b" * 32]
    assert events[0].token_ids == list(range(32))
    c.listener.removed([b"b" * 32])  # (removed once only)
    assert log.take() == []
    with log.resetting():
        c.listener.removed([b"a" * 32])
    assert [type(e).__name__ for e in log.take()] == ["AllBlocksCleared"]
    assert external_hash(b"x" * 40) != b"x" * 32 and len(external_hash(b"x" * 40)) == 32


def test_bad_endpoints_fail_at_start_naming_the_setting(pool):
    with pytest.raises(ConfigError, match="kv_events must be a ZMQ endpoint"):
        EngineConfig(kv_events="localhost:5557")
    with pytest.raises(ConfigError, match="kv_events_replay needs kv_events"):
        EngineConfig(kv_events_replay="tcp://*:5558")
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match=f"cannot open 'tcp://127.0.0.1:{port}'"):
            KVEventPublisher(KVEventLog(16, [FULL]), "tcp://127.0.0.1:5999",
                             f"tcp://127.0.0.1:{port}")  # fmt: skip
        with pytest.raises(ValueError, match="cannot open"):
            Engine(build_model(LLAMA, seed=3), pool, host_cache_tokens=64,
                   kv_events=f"tcp://*:{port}")  # fmt: skip
        assert pool.stats()["mapped_bytes"] == 0 and not pool.stats()["caches"]  # nothing left
    finally:
        taken.close(linger=0)


def test_hashes_only_bounded_inbound_and_rate_limited_replays(pool, caplog):
    """--no-kv-events-token-ids: the same events and hashes, no prompt in them. A
    stranger's oversized message is dropped and the stream goes on; replays past
    REPLAYS_PER_S a second get only the end marker; a public endpoint is warned about."""
    import logging

    from jax_kvcached.engine.kv_event_publisher import REPLAYS_PER_S, private_endpoint

    ep, rep = endpoints()
    eng = Engine(build_model(LLAMA, seed=3), pool, max_batch=1, kv_events=ep,
                 kv_events_replay=rep, kv_events_token_ids=False)  # fmt: skip
    sub = subscribe(ep)
    eng.generate([list(range(3, 53))], SamplingParams(max_tokens=2, temperature=0.0))
    assert eng.kv_event_publisher.flush()
    (e,) = [e for _, _, b in receive_all(sub) for e in b.events]
    assert len(e.block_hashes) == 3 and e.token_ids == []  # hashes, no tokens
    big = zmq.Context.instance().socket(zmq.DEALER)
    big.connect(rep)
    big.send_multipart((b"", b"x" * 4096))  # over MAX_INBOUND: the socket drops it
    big.close(linger=100)
    got = [len(replay(rep, 0)) for _ in range(int(REPLAYS_PER_S) + 1)]
    assert got[:-1] == [1] * int(REPLAYS_PER_S) and got[-1] == 0, got  # the last refused
    eng.close()
    sub.close(linger=0)
    assert private_endpoint("tcp://127.0.0.1:5557") and private_endpoint("ipc:///tmp/x")
    assert not private_endpoint("tcp://*:5557") and not private_endpoint("tcp://10.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="jax_kvcached.engine.kv_event_publisher"):
        KVEventPublisher(KVEventLog(16, [FULL]), "tcp://127.0.0.1:0").close()
        assert "carry every stored block's token ids" not in caplog.text
        KVEventPublisher(KVEventLog(16, [FULL]), "tcp://*:0").close()
    assert "carry every stored block's token ids" in caplog.text


def test_curve_admits_only_known_subscribers(pool, tmp_path):
    """--kv-events-curve-dir: a subscriber with an allowed certificate decodes the
    events; one with another key, or without CURVE, fails the handshake (the monitor says
    so) and never gets a byte. A folder others may read, or one with no client, is
    refused naming why."""
    import os

    import zmq.auth
    from conftest import free_port
    from zmq.utils.monitor import recv_monitor_message

    curve = tmp_path / "curve"
    (curve / "clients").mkdir(parents=True)
    os.chmod(curve, 0o700)
    with pytest.raises(ValueError, match="no subscriber's certificate"):
        zmq.auth.create_certificates(str(curve), "server")
        KVEventPublisher(KVEventLog(16, [FULL]), "tcp://*:0", curve_dir=str(curve))
    zmq.auth.create_certificates(str(curve / "clients"), "router")
    stranger_dir = tmp_path / "stranger"
    stranger_dir.mkdir()
    zmq.auth.create_certificates(str(stranger_dir), "stranger")
    server_pub, _ = zmq.auth.load_certificate(str(curve / "server.key"))
    port = free_port()
    eng = Engine(build_model(LLAMA, seed=3), pool, max_batch=1, kv_events=f"tcp://*:{port}",
                 kv_events_curve_dir=str(curve))  # fmt: skip
    ctx = zmq.Context()

    def subscriber(cert):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if cert is not None:
            sub.curve_publickey, sub.curve_secretkey = zmq.auth.load_certificate(cert)
            sub.curve_serverkey = server_pub
        monitor = sub.get_monitor_socket()
        sub.connect(f"tcp://127.0.0.1:{port}")
        while True:  # (the handshake's outcome, whichever it is)
            event = recv_monitor_message(monitor)["event"]
            if event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                         zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):  # fmt: skip
                return sub, event

    router, ok = subscriber(str(curve / "clients" / "router.key_secret"))
    stranger, refused = subscriber(str(stranger_dir / "stranger.key_secret"))
    plain, mismatch = subscriber(None)
    assert ok == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert refused == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert mismatch != zmq.EVENT_HANDSHAKE_SUCCEEDED
    eng.generate([list(range(3, 53))], SamplingParams(max_tokens=2, temperature=0.0))
    assert eng.kv_event_publisher.flush()
    # (one chain; under load its blocks may arrive in more than one batch: CI saw it)
    events = [e for _, _, b in receive_all(router) for e in b.events]
    assert events and all(type(e).__name__ == "BlockStored" for e in events), events
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == list(range(3, 51))  # the allowed subscriber reads them
    assert not stranger.poll(0) and not plain.poll(0)
    eng.close()
    ctx.destroy(linger=0)  # (the subscribers and their monitors)
    os.chmod(curve, 0o750)  # others may read our secret key: refused
    with pytest.raises(ValueError, match="readable by others"):
        KVEventPublisher(KVEventLog(16, [FULL]), "tcp://*:0", curve_dir=str(curve))
    with pytest.raises(ValueError, match="needs a bound endpoint"):
        KVEventPublisher(KVEventLog(16, [FULL]), "tcp://10.0.0.1:5", curve_dir=str(curve))
