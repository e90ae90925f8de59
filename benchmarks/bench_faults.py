"""Faults injected into real ``jax-kvcached serve`` processes while they work ([6/7]).

Each case states what must be kept, injects its fault and reports what was kept
(``kept``: every expectation held) with its figures:

- ``kill9``: two servers of one process group stream; one is killed with SIGKILL. The
  survivor's streams all finish with the text of an undisturbed run of the same streams,
  and the dead process's pages leave the group's ledger.
- ``burst``: many long requests at once against a budget a few of them fill. Every one
  completes (preemption and recompute), with the text of an unpressured run (the same
  requests one at a time), and none is answered 5xx.
- ``store``: the compilation cache on a read-only folder, on a full disk, and with every
  stored file truncated. The server starts and answers, and says each problem once.
- ``sigterm``: SIGTERM while a model goes to sleep, while it wakes, and while the host tier
  restores a prefix. A clean exit (status 0) within the shutdown deadline, and no row of
  the server left in the group's ledger (nothing half-mapped).
- ``slow_clients``: clients that send their body a byte at a time (slowloris) and clients
  that never read their stream. Other requests' latency stays within a stated bound of
  an unloaded run, and the server's memory stays bounded.
- ``bad_checkpoint``: a corrupted GGUF and a truncated safetensors file. ``serve`` exits
  with an error naming the file.

Mounting a small tmpfs (the full disk, the read-only folder) needs root; without it the
read-only case uses a folder without write permission and the full-disk case is reported
as not run. Writes ``benchmarks/results/bench_faults.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import httpx
from bench_serving import Process, serve_command

from jax_kvcached.engine.config import EngineConfig
from jax_kvcached.serve.config import ServeConfig

HERE = os.path.dirname(os.path.abspath(__file__))


class Serve(Process):
    """``jax-kvcached serve`` of ``config``, serving ``model`` as ``name``; its log kept."""

    def __init__(self, config: ServeConfig, cache: str, model: str = "tiny-llama",
                 name: str = "m") -> None:  # fmt: skip
        super().__init__()
        self.name = name
        config = dataclasses.replace(config, models=[f"{name}={model}"], port=self.port,
                                     compile_cache=cache, backend="host", access_log=False)
        self.launch(serve_command(sys.executable, config))

    def complete(self, prompt: Any, max_tokens: int, timeout: float = 600) -> httpx.Response:
        body = {"model": self.name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        return kb / 1024

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def streamed_text(srv: Serve, prompt: Any, max_tokens: int, out: dict, key: Any) -> None:
    """A streamed greedy completion; ``out[key]`` is its text, or the error it met."""
    url = srv.url
    body = {"model": srv.name, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    text = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                out[key] = f"HTTP {r.status_code}"
                return
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out[key] = f"error event: {chunk['error'].get('message')}"
                        return
                    text += [c.get("text") or "" for c in chunk.get("choices", [])]
        out[key] = "".join(text)
    except httpx.HTTPError as e:
        out[key] = f"{type(e).__name__}: {e}"


def run_streams(srv: Serve, prompts: list, max_tokens: int) -> tuple[dict, list]:
    out: dict = {}
    threads = [threading.Thread(target=streamed_text, args=(srv, p, max_tokens, out, i))
               for i, p in enumerate(prompts)]  # fmt: skip
    for t in threads:
        t.start()
    return out, threads


def ledger_rows(group: str) -> list:
    """The group's rows as its shared ledger holds them ([] once the group is gone)."""
    from jax_kvcached.memory.shared_ledger import SharedLedger

    try:
        return SharedLedger.attach(group).records()
    except (KeyError, FileNotFoundError):
        return []


def metric_total(metrics: str, name: str) -> float:
    """The sum of every series of ``name`` in a Prometheus text page."""
    return sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(name))


def remove_group(group: str) -> None:
    from jax_kvcached.memory import shm_segment

    shm_segment.remove(group)


# -- cases ---------------------------------------------------------------------------------
def case_kill9(cache: str) -> dict:
    group = f"faults-{uuid.uuid4().hex[:8]}"
    flags = ServeConfig(group=group, memory="64MiB", page_size="256KiB",
                        engine=EngineConfig(max_batch=4))
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(4)]
    a = Serve(flags, cache, name="a").ready()
    b = Serve(flags, cache, name="b").ready()
    try:
        ref, threads = run_streams(a, prompts, 300)  # undisturbed: b idle
        for t in threads:
            t.join()
        rows_before = {r.pid for r in ledger_rows(group)}
        got, threads = run_streams(a, prompts, 300)
        doomed, doomed_threads = run_streams(b, prompts, 300)
        time.sleep(1.0)  # both stream
        b.proc.kill()
        t_kill = time.monotonic()
        b.proc.wait()
        for t in threads + doomed_threads:
            t.join()
        while any(r.pid == b.proc.pid for r in ledger_rows(group)):
            if time.monotonic() - t_kill > 60:
                break
            time.sleep(0.05)
        returned_s = time.monotonic() - t_kill
        rows_after = ledger_rows(group)
    finally:
        a.close()
        b.close()
        remove_group(group)
    same = [got[i] == ref[i] for i in range(len(prompts))]
    return {
        "expect": "the survivor's streams finish with the undisturbed text; the killed "
        "process's row (and so its pages) leaves the ledger",
        "survivor_streams_identical": sum(same), "streams": len(prompts),
        "killed_streams_ended": len(doomed), "rows_before": len(rows_before),
        "rows_after": [r.name for r in rows_after],
        "dead_row_gone_after_s": round(returned_s, 2),
        "kept": all(same) and all(r.pid != b.proc.pid for r in rows_after)
        and len(rows_before) == 2,
    }  # fmt: skip


def case_burst(cache: str, n: int = 12) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 250, 400).tolist() for _ in range(n)]
    # tiny-llama's KV is 2 KiB a token: a 600-token request needs 1.2 MiB, and the budget
    # holds about two of them while eight are admitted at once.
    srv = Serve(ServeConfig(memory="3MiB", page_size="64KiB", admin_key="k",
                            engine=EngineConfig(max_batch=8, max_cached_tokens=0)),
                cache).ready()  # fmt: skip
    try:
        ref = [srv.complete(p, 200).json()["choices"][0]["text"] for p in prompts]
        statuses: dict = {}
        texts: dict = {}

        def one(i: int) -> None:
            r = srv.complete(prompts[i], 200)
            statuses[i] = r.status_code
            texts[i] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(srv.url + "/metrics").text
        memory = httpx.get(srv.url + "/admin/memory", headers={"Authorization": "Bearer k"})
        pools = memory.json()["pools"]
        mapped_after = sum(sum(p["mapped_pages_per_device"].values()) for p in pools)
    finally:
        srv.close()
    preempted = metric_total(metrics, "kvcached_preemptions_total")
    same = sum(texts[i] == ref[i] for i in range(n))
    fives = sum(s >= 500 for s in statuses.values())
    return {
        "expect": "every request completes through preemption and recompute with the text "
        "of the same request alone; none is 5xx",
        "requests": n, "ok": sum(s == 200 for s in statuses.values()), "5xx": fives,
        "identical_to_alone": same, "preemptions": preempted,
        "mapped_pages_after": mapped_after,  # nothing is cached (--max-cached-tokens 0)
        "kept": same == n and fives == 0 and preempted > 0 and mapped_after == 0,
    }  # fmt: skip


def _mount(path: str, opts: str) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path],
                          capture_output=True).returncode == 0  # fmt: skip


def _umount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True)


def _store_run(cache: str) -> dict:
    srv = Serve(ServeConfig(), cache)
    try:
        srv.ready()
        answered = srv.complete([1, 2, 3], 4).status_code
        log = srv.tail(1 << 20)
    finally:
        srv.stop()
    return {
        "answered": answered,
        "said_cannot_write": log.count("cannot be written"),
        "said_do_not_load": log.count("do not load") + log.count("dropping the stored"),
        "jax_warnings_shown": log.count("UserWarning: Error"),
    }


def case_store(cache: str) -> dict:
    root = os.geteuid() == 0
    work = tempfile.mkdtemp(prefix="kvcached-faults-store-")
    out: dict = {"expect": "serve starts and answers; each problem is said once (one line "
                 "from JAX's cache, one from the executable store) and JAX's per-entry "
                 "warnings are not shown"}  # fmt: skip
    # a populated cache, then every file truncated to half
    warm = os.path.join(work, "truncated")
    _store_run(warm)
    for d, _, names in os.walk(warm):
        for n in names:
            p = os.path.join(d, n)
            os.truncate(p, os.path.getsize(p) // 2)
    out["truncated"] = _store_run(warm)
    # read-only: the populated cache made read-only (a tmpfs remounted, or no write bit)
    ro = os.path.join(work, "ro")
    if root and _mount(ro, "size=64m"):
        shutil.copytree(os.path.join(work, "truncated"), ro, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
        out["read_only"] = {**_store_run(ro), "how": "tmpfs mounted read-only"}
        _umount(ro)
    else:
        os.makedirs(ro, exist_ok=True)
        os.chmod(ro, 0o555)
        out["read_only"] = {**_store_run(ro), "how": "a folder without write permission"}
    full = os.path.join(work, "full")
    if root and _mount(full, "size=512k"):
        with open(os.path.join(full, "fill"), "wb") as f:
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        out["full_disk"] = {**_store_run(os.path.join(full, "xla")), "how": "a full tmpfs"}
        _umount(full)
    else:
        out["full_disk"] = {"not_run": "mounting a small tmpfs needs root"}
    runs = [v for v in out.values() if isinstance(v, dict) and "answered" in v]
    out["kept"] = all(r["answered"] == 200 and r["jax_warnings_shown"] == 0 for r in runs) and (
        out["truncated"]["said_do_not_load"] >= 1
        and all(r["said_cannot_write"] <= 2 for r in runs)
        and out["read_only"]["said_cannot_write"] >= 1
    )
    shutil.rmtree(work, ignore_errors=True)
    return out


HOST_TIER = EngineConfig(host_cache_tokens=8192, max_cached_tokens=512)


def spill_to_host_tier(srv: Serve) -> list[int]:
    """Caches a 2000-token prompt and pushes it off the device (with HOST_TIER:
    past 512 cached tokens blocks go to the host tier); returns the prompt, whose next
    request is restored from the host tier."""
    import numpy as np

    prompt = np.random.default_rng(1).integers(100, 40000, 2000).tolist()
    srv.complete(prompt, 1)
    srv.complete([9, 9, 9] * 200, 1)
    return prompt


def _sigterm_during(cache: str, phase: str, delay: float, deadline: float) -> dict:
    group = f"faults-{uuid.uuid4().hex[:8]}"
    flags = ServeConfig(group=group, memory="1GiB", shutdown_timeout=deadline, admin_key="k",
                        engine=HOST_TIER)
    srv = Serve(flags, cache, model="smollm2-135m").ready()
    admin = {"Authorization": "Bearer k"}
    try:
        prompt = spill_to_host_tier(srv)
        if phase == "wake":
            httpx.post(srv.url + "/admin/sleep", json={"model": "m"}, headers=admin,
                       timeout=120).raise_for_status()  # fmt: skip
        state: dict = {}

        def act() -> None:
            try:
                if phase == "restore":
                    r = srv.complete(prompt, 1)
                else:
                    r = httpx.post(f"{srv.url}/admin/{phase}", json={"model": "m"},
                                   headers=admin, timeout=120)  # fmt: skip
                state["status"] = r.status_code
            except httpx.HTTPError as e:
                state["status"] = type(e).__name__
            state["done"] = time.monotonic()

        th = threading.Thread(target=act)
        th.start()
        time.sleep(delay)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(120)
        took = time.monotonic() - t0
        th.join()
        rows = [r for r in ledger_rows(group) if r.pid == srv.proc.pid]
    finally:
        srv.close()
        remove_group(group)
    return {
        "phase": phase, "delay_s": delay, "exit": rc, "exit_s": round(took, 2),
        "action_done_before_signal": state.get("done", 1e18) < t0,
        "action_status": state.get("status"), "rows_left": len(rows),
        "kept": rc == 0 and took <= deadline + 5 and not rows,
    }  # fmt: skip


def _restore_probe(cache: str) -> float:
    """The host tier's restores in the restore phase's setup, run without a signal (that
    phase's prompt does come back from the host tier)."""
    srv = Serve(ServeConfig(memory="1GiB", engine=HOST_TIER), cache, model="smollm2-135m").ready()
    try:
        srv.complete(spill_to_host_tier(srv), 1)
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    return metric_total(metrics, "kvcached_host_hit_tokens_total")


def case_sigterm(cache: str, delays: list[float], deadline: float = 10.0) -> dict:
    runs = [_sigterm_during(cache, phase, d, deadline)
            for phase in ("sleep", "wake", "restore") for d in delays]  # fmt: skip
    restored = _restore_probe(cache)
    return {
        "restore_phase_host_hit_tokens": restored,  # > 0: that phase restores from host
        "expect": f"exit status 0 within the {deadline:.0f} s deadline (+5 s for the "
        "interpreter to end), no row of the server left in the group's ledger",
        "runs": runs, "kept": all(r["kept"] for r in runs) and restored > 0,
    }  # fmt: skip


def _latencies(srv: Serve, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        r = srv.complete([3 + i % 7, 4, 5], 8)
        r.raise_for_status()
        out.append(time.perf_counter() - t)
    return out


def _slowloris(port: int, stop: threading.Event, socks: list) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    socks.append(s)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: 100000\r\n\r\n{")  # fmt: skip
    while not stop.is_set():
        try:
            s.sendall(b" ")
        except OSError:
            return
        stop.wait(1.0)


def _never_reader(port: int, socks: list) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    socks.append(s)
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4000, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()  # fmt: skip
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # never read


def case_slow_clients(cache: str, slow: int = 64, never: int = 8, n: int = 30) -> dict:
    import numpy as np

    srv = Serve(ServeConfig(memory="256MiB", engine=EngineConfig(max_batch=16)), cache).ready()
    stop, socks = threading.Event(), []
    try:
        _latencies(srv, 5)  # warm
        base = _latencies(srv, n)
        rss0 = srv.rss_mib()
        threads = [threading.Thread(target=_slowloris, args=(srv.port, stop, socks), daemon=True)
                   for _ in range(slow)]  # fmt: skip
        for t in threads:
            t.start()
        for _ in range(never):
            _never_reader(srv.port, socks)
        time.sleep(3.0)  # the never-readers' streams fill their socket buffers
        loaded = _latencies(srv, n)
        time.sleep(5.0)
        loaded += _latencies(srv, n)
        rss1 = srv.rss_mib()
        health = httpx.get(srv.url + "/health").status_code
    finally:
        stop.set()
        for s in socks:
            s.close()
        srv.close()
    p50 = (float(np.median(base)), float(np.median(loaded)))
    worst = (max(base), max(loaded))
    bound = 2.0
    return {
        "expect": f"with {slow} slowloris bodies and {never} streams never read open, other "
        f"requests' p50 latency within {bound:.0f}x the unloaded p50 (+10 ms) and the "
        "server's RSS within 200 MiB of before",
        "p50_ms": [round(x * 1e3, 1) for x in p50], "max_ms": [round(x * 1e3, 1) for x in worst],
        "rss_mib": [round(rss0), round(rss1)], "health": health,
        "kept": p50[1] <= bound * p50[0] + 0.010 and rss1 - rss0 <= 200 and health == 200,
    }  # fmt: skip


def case_bad_checkpoint(cache: str) -> dict:
    from jax_kvcached.models.pretrained import pretrained_path

    work = tempfile.mkdtemp(prefix="kvcached-faults-ckpt-")
    real = pretrained_path("smollm2-135m")
    with open(real, "rb") as f:
        data = bytearray(f.read(8 << 20))
    bad_gguf = os.path.join(work, "corrupted.gguf")
    data[40:48] = b"\xff" * 8  # the first key's length: far past the end of the file
    with open(bad_gguf, "wb") as f:
        f.write(data)
    folder = os.path.join(work, "hf")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                   "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "architectures": ["LlamaForCausalLM"]}, f)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write((200).to_bytes(8, "little") + b'{"a": {"dtype": "F32", "shape": [4')
    runs = {}
    for name, path, want in (("gguf", bad_gguf, bad_gguf),
                             ("safetensors", folder, os.path.join(folder, "model.safetensors"))):
        t = time.monotonic()
        config = ServeConfig(models=[f"m={path}"], port=0, compile_cache=cache, backend="host")
        p = subprocess.run(serve_command(sys.executable, config), capture_output=True,
                           text=True, timeout=300)  # fmt: skip
        err = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
        runs[name] = {"exit": p.returncode, "error": err[-1] if err else None,
                      "names_the_file": bool(err) and want in err[-1],
                      "seconds": round(time.monotonic() - t, 1)}  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return {
        "expect": "serve exits non-zero with one error line naming the file",
        **runs, "kept": all(r["exit"] != 0 and r["names_the_file"] for r in runs.values()),
    }  # fmt: skip


CASES = {"kill9": case_kill9, "burst": case_burst, "store": case_store,
         "sigterm": case_sigterm, "slow_clients": case_slow_clients,
         "bad_checkpoint": case_bad_checkpoint}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--sigterm-delays", default="0.05,0.2,0.5",
                    help="seconds from the action's start to SIGTERM")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_faults.json"))
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="kvcached-faults-cache-")
    result: dict = {}
    for name in args.cases.split(","):
        t = time.monotonic()
        if name == "sigterm":
            delays = [float(x) for x in args.sigterm_delays.split(",")]
            result[name] = CASES[name](cache, delays)
        else:
            result[name] = CASES[name](cache)
        result[name]["case_s"] = round(time.monotonic() - t, 1)
        print(f"{name:15s} kept={result[name]['kept']}  "
              f"{json.dumps({k: v for k, v in result[name].items() if k != 'expect'})[:300]}",
              flush=True)  # fmt: skip
    print(f"\n{'case':15s} {'kept':5s} expectation")
    for name, r in result.items():
        print(f"{name:15s} {str(r['kept']):5s} {r['expect']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if os.path.exists(args.out) and args.cases != ",".join(CASES):
        with open(args.out) as f:
            result = {**json.load(f), **result}  # a partial run updates its cases
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
