"""A minute of the soak (benchmarks/bench_soak.py runs it for 30): mixed traffic
against `serve` with two models (streams, disconnects, prefix hits, sleeps and wakes),
then idle checks."""

import os
import sys

from conftest import COMPILE_CACHE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from bench_soak import soak  # noqa: E402


def test_mixed_traffic_leaves_nothing_behind():
    r = soak(["a=tiny-llama", "b=tiny-qwen2"], minutes=0.25, interval=5, warmup=8, clients=3,
             sleep_every=5, extra=["--memory", "64MiB", "--host-cache-tokens", "2048"],
             cache=COMPILE_CACHE)  # fmt: skip
    assert r["errors"] == []  # no unexpected status, error event or dropped connection
    c = r["counts"]
    assert c["streams"] and c["disconnects"] and c["prefix_requests"] and c["sleeps"], c
    # Idle again, the server holds what it held idle after the warm-up: no thread leak,
    # and no file or socket leak with the hundreds of requests, disconnects and the
    # sleeps between (a leak per request, or per sleep, would exceed the slack of 2: one
    # or two descriptors may be in passing at a sample, a connection still closing or a
    # cache file being written).
    w, e = r["idle_after_warmup"], r["idle_end"]
    assert e["threads"] == w["threads"] and e["open_files"] <= w["open_files"] + 2, (w, e)
    # Exact accounting: only cached blocks hold KV, and a reset leaves nothing mapped.
    assert r["only_cached_blocks_in_use"] and r["mapped_bytes_after_reset"] == 0
    # Private resident memory: a leak of 100 KiB a request would add over 64 MiB here;
    # allocator noise stays far below. (The 30-minute soak measures the drift itself.)
    assert r["drift"]["rss_anon_mib"]["change"] < 64, r["drift"]["rss_anon_mib"]
