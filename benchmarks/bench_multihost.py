"""One model across processes: ``serve --nnodes 2`` (jax.distributed; gloo collectives on
CPU devices, each process standing in for a host) against one process, same model, same
load.

Load: ``--requests`` completions of ``--prompt-tokens`` random token ids each, ``--max-tokens``
tokens out (ignore EOS, greedy), ``--concurrency`` at a time. Reported for each: output
tokens/s, the mapped KV bytes per device after the run (``kvcached_mapped_bytes``) and
whether the texts match the one-process run. Writes benchmarks/results/bench_multihost.json.

The model must split its KV heads over the processes: the random ``tiny-llama`` preset by
default (2 KV heads); SmolLM2-135M's 3 do not split in two.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import free_port, serve_command  # noqa: E402

from jax_kvcached.engine.config import EngineConfig  # noqa: E402
from jax_kvcached.serve.config import ServeConfig  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                   "bench_multihost.json")  # fmt: skip


# The ranks' shared secret (the step channel admits only ranks that hold it): one per run.
SECRET = secrets.token_hex(16)


@functools.cache
def secret_file() -> str:
    """That secret in a file only this user may read (``--dist-secret-file``)."""
    fd, path = tempfile.mkstemp(prefix="kvcached-dist-", suffix=".secret")  # (mode 600)
    with os.fdopen(fd, "w") as f:
        f.write(SECRET)
    atexit.register(os.unlink, path)
    return path


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out["JAX_PLATFORMS"] = "cpu"
    out.setdefault("KVCACHED_DIST_SECRET", SECRET)
    return out


def launch(config: ServeConfig, log: Any) -> subprocess.Popen:
    """A ``jax-kvcached serve`` process of ``config`` (this interpreter's package)."""
    return subprocess.Popen(serve_command(sys.executable, config), stdout=log,
                            stderr=subprocess.STDOUT, env=env(),
                            cwd=tempfile.gettempdir())  # fmt: skip


def ranks(config: ServeConfig, port: int, nnodes: int, logs: list[Any],
          addr: str | None = None) -> list[subprocess.Popen]:  # fmt: skip
    """``nnodes`` ranks of one server of ``config`` on loopback (rank 0 answers on
    ``port``; ``addr``: the coordinator's HOST:PORT, PORT+1 free too)."""
    addr = addr or f"127.0.0.1:{free_port()}"
    return [launch(dataclasses.replace(config, nnodes=nnodes, dist_init_addr=addr,
                                       node_rank=r, port=port), logs[r])
            for r in range(nnodes)]  # fmt: skip


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a rank exited ({p.returncode})")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not start")


def mapped_bytes(url: str, model: str = "m") -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf'^kvcached_mapped_bytes\{{model="{model}"\}} (\S+)', text,
                           re.M).group(1))  # fmt: skip


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
         ) -> tuple[list[str], float]:  # fmt: skip
    """(texts in prompt order, output tokens/s)."""
    texts: list[str] = [""] * len(prompts)
    todo = list(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            r = httpx.post(url + "/v1/completions", timeout=600, json={
                "model": "m", "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})  # fmt: skip
            r.raise_for_status()
            texts[i] = r.json()["choices"][0]["text"]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts, len(prompts) * max_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, args.prompt_tokens).tolist() for _ in range(args.requests)]
    common = ServeConfig(models=[f"m={args.model}"], access_log=False, page_size="64KiB",
                         memory="64MiB", dist_secret_file=secret_file(),
                         engine=EngineConfig(max_batch=8))  # fmt: skip
    rows = []
    want = None
    for nnodes in (1, 2):
        port = free_port()
        logs = [tempfile.NamedTemporaryFile("w+", suffix=".log") for _ in range(nnodes)]
        procs = (ranks(common, port, nnodes, logs) if nnodes > 1
                 else [launch(dataclasses.replace(common, port=port), logs[0])])  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, procs)
            load(url, prompts[:2], 4, 2)  # (warm: the shapes of this load compiled)
            texts, rate = load(url, prompts, args.max_tokens, args.concurrency)
            nbytes = mapped_bytes(url)
        finally:
            stop(procs)
        want = want or texts
        rows.append({"processes": nnodes, "output_tok_s": rate, "mapped_bytes_per_device": nbytes,
                     "same_text_as_one": texts == want})  # fmt: skip
        print(f"{nnodes} process(es): {rate:7.1f} output tok/s, {nbytes / 2**10:7.0f} KiB mapped "
              f"per device, same text as one: {texts == want}", flush=True)
    ratio = rows[1]["mapped_bytes_per_device"] / rows[0]["mapped_bytes_per_device"]
    print(f"two processes / one: {rows[1]['output_tok_s'] / rows[0]['output_tok_s']:.2f}x "
          f"tokens/s, {ratio:.2f}x mapped bytes per device")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
