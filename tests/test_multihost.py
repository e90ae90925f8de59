"""``serve`` across processes (``--nnodes 2``, jax.distributed with gloo collectives on
CPU devices, the processes standing in for hosts): the same greedy text as one process,
half the mapped KV per device, a killed follower ends the server, bad flags and an
unreachable coordinator fail at start."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_multihost import (  # noqa: E402
    env,
    launch,
    mapped_bytes,
    ranks,
    secret_file,
    stop,
    wait_ready,
)
from bench_serving import free_port, serve_command  # noqa: E402
from conftest import dist_addr  # noqa: E402

from jax_kvcached.engine.config import EngineConfig  # noqa: E402
from jax_kvcached.serve.config import ServeConfig  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 8, 1, 7] * 6, [11, 12, 13, 14] * 9, [200, 3, 9] * 15]
# 8 KiB pages: a tiny-llama block plane is 4 KiB with both KV heads, 2 KiB with one.
COMMON = ServeConfig(models=["m=tiny-llama"], warmup=False, page_size="8KiB", memory="16MiB",
                     access_log=False, dist_timeout=120, dist_secret_file=secret_file(),
                     engine=EngineConfig(max_batch=4))  # fmt: skip


def greedy(url):
    out = []
    for p in PROMPTS:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "m", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_two_ranks_serve_the_same_text_with_half_the_kv_per_device(tmp_path):
    port = free_port()
    one = launch(dataclasses.replace(COMMON, port=port), open(tmp_path / "one.log", "w"))
    try:
        wait_ready(f"http://127.0.0.1:{port}", [one])
        want = greedy(f"http://127.0.0.1:{port}")
        want_bytes = mapped_bytes(f"http://127.0.0.1:{port}")
    finally:
        stop([one])
    port = free_port()
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    procs = ranks(COMMON, port, 2, logs, dist_addr())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs)
        assert greedy(url) == want
        # Each device holds one of the two KV heads: half the bytes, give or take the
        # last page of each of the 8 planes (4 layers x K, V) a run of blocks ends in.
        got = mapped_bytes(url)
        assert want_bytes / 2 <= got <= want_bytes / 2 + 8 * 8192, (got, want_bytes)
        # A killed follower: the request in flight fails with a clear error, rank 0
        # exits (status 1) instead of waiting on a collective with a dead peer.
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "model": "m", "prompt": PROMPTS[0], "max_tokens": 400, "stream": True,
                "ignore_eos": True, "temperature": 0}) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            next(x for x in lines if x.startswith("data: {"))  # it streams
            procs[1].kill()
            rest = "\n".join(lines)
        assert "rank 1 of the server across hosts is gone" in rest, rest[-500:]
        assert procs[0].wait(60) == 1
    finally:
        stop(procs)
    log0 = (tmp_path / "rank0.log").read_text()
    assert "rank 1 of the server across hosts is gone" in log0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1234"],
         "--node-rank must be in [0, 2)"),
        (["--nnodes", "2", "--dist-init-addr", "nohost"], "--dist-init-addr must be HOST:PORT"),
        (["--nnodes", "2"], "--dist-init-addr must be HOST:PORT"),
    ],
)
def test_bad_distributed_flags_fail_at_start(args, message):
    out = subprocess.run([sys.executable, "-m", "jax_kvcached.cli", "serve", *args],
                         capture_output=True, text=True, env=env(), timeout=120)  # fmt: skip
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


def test_unreachable_coordinator_and_mismatched_flags_fail_at_start(tmp_path):
    # A rank alone: the others never come; a clear error within --dist-timeout.
    addr = dist_addr()
    for rank, message in ((1, f"rank 1: rank 0 did not answer at --dist-init-addr {addr}"),
                          (0, "rank 0: 0 of the 1 other ranks joined within --dist-timeout")):
        alone = dataclasses.replace(COMMON, nnodes=2, node_rank=rank, dist_init_addr=addr,
                                    dist_timeout=3, port=free_port())
        out = subprocess.run(serve_command(sys.executable, alone), capture_output=True,
                             text=True, env=env(), timeout=240)  # fmt: skip
        assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    # Two ranks whose model flags differ: both refuse, naming the flag.
    dist = dataclasses.replace(COMMON, nnodes=2, dist_init_addr=dist_addr())
    procs = [
        launch(dataclasses.replace(dist, node_rank=0, port=free_port()),
               open(tmp_path / "r0.log", "w")),
        launch(dataclasses.replace(dist, node_rank=1, engine=EngineConfig(max_batch=2)),
               open(tmp_path / "r1.log", "w")),
    ]  # fmt: skip
    try:
        codes = [p.wait(240) for p in procs]
    finally:
        stop(procs)
    assert codes[0] != 0 and codes[1] != 0, codes
    for r in range(2):
        text = (tmp_path / f"r{r}.log").read_text()
        assert "flags differ" in text and "engine.max_batch (2 here, 4 on rank 0)" in text, (
            text[-2000:])
