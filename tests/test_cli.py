import json
import subprocess
import sys

from conftest import free_port

from jax_kvcached.cli import main
from jax_kvcached.demo import run_demo
from jax_kvcached.kv_demo import run_kv_demo


def test_model_demo_generates_and_returns_every_page():
    out = run_demo("tiny-qwen2", "64MiB", max_tokens=6, batch=3, backend="host", quiet=True)
    assert out["requests"] == 3 and out["tokens"] == 18
    assert out["tokens_per_s"] > 0 and out["ttft_ms_p50"] > 0
    assert out["peak_mapped_mib"] > 0 and out["mapped_after_reset_mib"] == 0
    # The second (timed) run finds the first run's prompts in the prefix cache.
    assert out["prefix_cached_blocks"] > 0 and out["prefix_hit_rate"] > 0


def test_kv_demo_verifies_and_returns_every_page():
    out = run_kv_demo("64MiB", batch=3, steps=20, backend="host", quiet=True)
    assert [r["verified"] for r in out["results"]] == [True, True]
    assert out["final"]["mapped_pages"] == 0
    first, second = out["results"]
    assert first["pages_created"] > 0
    assert second["pages_created"] == 0 and second["pages_reused"] > 0  # pages moved over


def test_cli_demo_entry_point(tmp_path):
    # The default model is the trained SmolLM2-135M-Instruct. Run from an empty folder so
    # the installed package is imported, not the checkout.
    r = subprocess.run(
        [sys.executable, "-m", "jax_kvcached.cli", "demo", "--max-tokens", "10", "--batch", "1",
         "--memory", "160MiB"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "TTFT" in r.stdout and "peak mapped" in r.stdout
    assert "'What is the capital of France?' -> 'The capital of France is Paris.'" in r.stdout


def test_cli_rejects_bad_arguments(capsys):
    assert main(["demo", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["kv-demo", "--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
    for argv, msg in (
        (["demo", "--model", "tiny-llama", "--memory", "lots"], "--memory: cannot parse"),
        (["demo", "--model", "nope"], "unknown model 'nope'"),
        (["kv-demo", "--memory", "1KiB", "--backend", "host"], "--memory (1024 bytes)"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: " + msg) and err.count("\n") == 1, err




def start_serve(args: list[str], cwd) -> tuple[subprocess.Popen, str]:
    """`jax-kvcached serve ARGS` on a free loopback port, once /health answers 200."""
    import time

    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jax_kvcached.cli", "serve", *args, "--port", str(port)],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the server did not come up")
        time.sleep(0.2)


def complete_three_tokens(url: str, model: str) -> None:
    import httpx

    body = {"model": model, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_cli_serve_and_top(tmp_path, capsys):
    import signal

    import httpx

    cmd = [sys.executable, "-m", "jax_kvcached.cli"]
    proc, url = start_serve(
        ["--model", "a=tiny-llama", "--model", "b=tiny-qwen2", "--memory", "32MiB",
         "--page-size", "256KiB", "--limit", "b=4MiB", "--no-warmup", "--backend", "host",
         "--host-cache-tokens", "512"],
        tmp_path,
    )  # fmt: skip
    try:
        complete_three_tokens(url, "b")
        top = subprocess.run(
            [*cmd, "top", "--url", url, "--once"], capture_output=True, text=True, timeout=60,
            cwd=tmp_path,
        )  # fmt: skip
        assert top.returncode == 0, top.stderr
        memory = top.stdout.split("HOSTHIT%")[1].split("\n\n")[0]  # the memory table
        rows = {ln.split()[0]: ln.split() for ln in memory.splitlines() if ln.strip()}
        assert set(rows) == {"a", "b"}
        assert rows["b"][2] == "3.0MiB"  # the 4MiB limit in whole qwen KV pages (6 x 256KiB)
        assert rows["b"][6] == "0.0KiB"  # a host tier, empty so far
        assert max(len(ln) for ln in top.stdout.splitlines()) <= 80
        metrics = httpx.get(f"{url}/metrics").text
        # tiny-qwen2: 512 tokens = 32 blocks of 3 layers x 2 planes x 2 KiB
        assert 'kvcached_host_cache_capacity_bytes{model="b"} 393216.0' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    # the start-up's objects leave the collector's scans (no full-heap pause while serving)
    frozen = int(out.split("the garbage collector skips ")[1].split()[0])
    assert frozen > 10_000, out[-2000:]
    bad = subprocess.run(
        [*cmd, "top", "--url", url, "--once"], capture_output=True, text=True, timeout=60,
        cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 1 and "cannot read" in bad.stderr
    # without --once it keeps retrying, showing the server as disconnected
    from jax_kvcached.serve.top import run_top

    assert run_top(url, 0.01, frames=3) == 0
    assert capsys.readouterr().out.count("disconnected: ") == 3


def test_cli_serve_tensor_parallel(tmp_path):
    import signal

    import httpx

    proc, url = start_serve(
        ["--model", "a=tiny-llama", "--memory", "32MiB", "--page-size", "256KiB",
         "--tensor-parallel", "2", "--no-warmup", "--backend", "host",
         "--allow-unauthenticated-admin"],
        tmp_path,
    )  # fmt: skip
    try:
        complete_three_tokens(url, "a")
        (pool,) = httpx.get(f"{url}/admin/memory").json()["pools"]
        assert pool["tensor_parallel"] == 2 and len(pool["devices"]) == 2
        assert len(set(pool["mapped_pages_per_device"].values())) == 1
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvcached_pool_devices{pool="0:cpu:0"} 2.0' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


# Every case in one process (one JAX start): the tensor-parallel case runs first, so its
# two CPU devices exist when JAX starts.
_BAD_ARGS_RUNNER = """
import contextlib, io, json, sys
from jax_kvcached.cli import main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(["serve", "--no-warmup", *args])
        except SystemExit as e:  # argparse
            rc = e.code
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def test_cli_serve_rejects_bad_arguments(tmp_path):
    cases = [
        (
            ["--model", "a=tiny-qwen2", "--tensor-parallel", "2"],
            "1 KV heads, which do not split over the 2",
        ),
        (
            ["--model", "a=tiny-llama", "--model", "tiny-qwen2", "--served-model-name", "x"],
            "--served-model-name names one --model",
        ),
        (["--model", "tiny-llama", "--dtype", "int8"], "invalid choice"),
        (
            ["--model", "tiny-llama", "--generation-config", "/no/such/dir"],
            "--generation-config must be",
        ),
        (["--model", "tiny-llama", "--chat-template", "/no/such.jinja"], "--chat-template"),
        (["--model", "a=tiny-llama", "--limit", "b=1MiB"], "not a --model"),
        (["--model", "a=tiny-llama", "--limit", "a=lots"], "cannot parse"),
        (["--model", "a=no-such-model"], "unknown model 'no-such-model': Packaged"),
        (["--model", "a=tiny-llama", "--tensor-parallel", "0"], "--tensor-parallel must be"),
        (["--model", "a=tiny-llama", "--devices", "0,9"], "--devices / --tensor-parallel"),
        (["--model", "a=tiny-llama", "--tensor-parallel", "2", "--devices", "0"], "lists 1"),
        (["--model", "a=tiny-llama", "--host-cache-tokens", "-5"], "--host-cache-tokens must be"),
        (["--model", "a=tiny-llama", "--host-cache-bytes", "lots"], "--host-cache-bytes: cannot"),
        (["--model", "a=tiny-llama", "--idle-sleep", "0"], "--idle-sleep must be > 0"),
        (["--model", "a=tiny-llama", "--max-awake", "0"], "--max-awake must be >= 1"),
        (["--model", "a=tiny-llama", "--sleep-level", "3"], "invalid choice"),
        (["--model", "a=tiny-llama", "--preload-tokens", "-1"], "--preload-tokens must be"),
    ]
    args = json.dumps([a for a, _ in cases])
    r = subprocess.run([sys.executable, "-c", _BAD_ARGS_RUNNER, args], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.splitlines()[-1])
    for (a, msg), (rc, err) in zip(cases, results, strict=True):
        assert rc == 2 and msg in err, (a, err)


def test_top_and_ctl_start_without_jax(tmp_path):
    """The tools import neither JAX nor Flax (the package root is lazy)."""
    code = (
        "import sys, jax_kvcached, jax_kvcached.cli, jax_kvcached.serve.top, "
        "jax_kvcached.serve.ctl; print(sorted(m for m in ('jax', 'flax', 'jax_kvcached.memory"
        ".pool') if m in sys.modules)); print(jax_kvcached.Pool.__name__)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[]", "Pool"]  # nothing heavy until first use


def test_every_serve_flag_has_help_and_a_default(capsys):
    import re

    import pytest

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    usage, options = out[: out.index("options:")], out[out.index("options:") :]
    flags = re.findall(r"\[(--[a-z-]+)( [^\]]+)?\]", " ".join(usage.split()))
    assert len(flags) > 20
    text = " ".join(options.split())
    for flag, arg in flags:
        help_text = text[text.index(flag + " ") + len(flag) :].split(" --")[0]
        help_text = help_text.replace(arg, "", 1) if arg else help_text
        assert len(help_text.strip()) > 10, f"{flag} has no help"
        if arg:  # a value flag says its default (stated, or appended by the formatter)
            assert "default" in help_text, flag
        else:  # a switch is off unless given, whatever it switches
            assert "True" not in help_text and "False" not in help_text, flag
    # grouped by sub-config, each section once
    for title in ("models:", "keys and tenants:", "HTTP server:", "engine: prefix cache:",
                  "engine: KV-cache events:"):  # fmt: skip
        assert out.count("\n" + title + "\n") == 1, title
    assert "compiling every step shape before serving (shapes then compile on first use) " \
        "(off unless given)" in text


def test_serve_memory_errors_name_the_flag(capsys):
    import jax_kvcached as kv

    base = ["serve", "--model", "a=tiny-llama", "--backend", "host", "--no-warmup",
            "--port", "0", "--compile-cache", "off"]  # fmt: skip
    for memory, msg in (
        ("lots", "--memory: cannot parse 'lots'"),
        ("0", "--memory must be positive"),
        ("1KiB", "--memory (1024 bytes) is smaller than one page"),
        ("100TiB", "--memory (102400.0 GiB) exceeds the memory of the device"),
    ):
        assert main([*base, "--memory", memory]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: " + msg), err
    # the library allows a budget beyond the device (pages are mapped on demand)
    assert kv.device_memory_bytes("host") < 100 << 40


def test_serve_answers_from_the_start_and_logs_every_request(tmp_path):
    """/health reports the warm-up while it runs (503 starting, then 200); the defaults a
    request omits come from the operator; vLLM's small routes, CORS, the access log."""
    import signal
    import time

    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jax_kvcached.cli", "serve", "--model", "tiny-llama",
         "--max-batch", "2", "--memory", "32MiB", "--page-size", "256KiB", "--backend", "host",
         "--compile-cache", "off", "--allowed-origins", "http://example.com",
         "--default-temperature", "0", "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen, early, deadline = [], [], time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(f"{url}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            r = httpx.get(f"{url}/v1/models", timeout=5)  # not yet: a clear 503
            early.append((r.status_code, r.json()))  # (200 if it just became ready)
            time.sleep(0.2)
        refused = [b for s, b in early if s == 503]
        assert refused and all(b["error"]["code"] == "starting" for b in refused)
        assert all(s in (200, 503) for s, _ in early)
        starting = [b for s, b in seen if s == 503]
        assert starting and all(b["status"] == "starting" for b in starting)
        compiling = [b for b in starting if b["phase"] == "compiling"]
        assert compiling and all(0 < b["compiled"] <= b["total"] for b in compiling)
        assert seen[-1][0] == 200
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 6, "ignore_eos": True}
        a = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        b = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert a["seed"] != b["seed"]  # unseeded: fresh seeds, yet greedy by the default
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        tok = httpx.post(f"{url}/tokenize", json={"model": "tiny-llama", "prompt": "hi"}).json()
        assert tok == {"count": 3, "max_model_len": 1024, "tokens": [256, 104, 105]}
        text = httpx.post(f"{url}/detokenize", json={"model": "tiny-llama", "tokens": [104, 105]})
        assert text.json() == {"prompt": "hi"}
        bad = httpx.post(f"{url}/detokenize", json={"model": "tiny-llama", "tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert httpx.get(f"{url}/version").json()["version"]
        cors = httpx.get(f"{url}/v1/models", headers={"Origin": "http://example.com"})
        assert cors.headers["access-control-allow-origin"] == "http://example.com"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "loading tiny-llama from a built-in random preset" in out
    total = compiling[-1]["total"]
    assert f"tiny-llama: {total} programs ready" in out  # the bar's count, in the log
    assert out.count('"POST /v1/completions" model=tiny-llama 200 tokens=6+6') == 2, out


def test_cli_serve_quantized_reports_weight_bytes(tmp_path):
    import signal

    import httpx
    import jax
    from flax import nnx

    from jax_kvcached.models import BUILTIN_CONFIGS, build_model

    proc, url = start_serve(
        ["--model", "a=tiny-llama", "--quantization", "int4", "--memory", "32MiB",
         "--no-warmup", "--backend", "host", "--allow-unauthenticated-admin"],
        tmp_path,
    )  # fmt: skip
    try:
        complete_three_tokens(url, "a")
        model = httpx.get(f"{url}/admin/memory").json()["models"]["a"]
        preset = nnx.state(build_model(BUILTIN_CONFIGS["tiny-llama"]))
        fp32 = sum(x.size * 4 for x in jax.tree.leaves(preset))
        # int4 with mins: 5 bits a weight where fp32 has 32 (norms stay fp32).
        assert 0 < model["weight_packed_bytes"] < model["weight_bytes"] < 0.2 * fp32
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvcached_weight_bytes{{model="a"}} {float(model["weight_bytes"])}' in metrics
        assert 'kvcached_weight_packed_bytes{model="a"}' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


def test_a_mistyped_model_or_flag_is_named_before_anything_listens(capsys):
    """A near-miss name gets its suggestion, a missing path says so, both before the
    port is bound (the port is taken here: binding first would fail on it instead); a
    mistyped flag gets the command's usage and the nearest flag."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for model, said in (("a=smollm2-135", "did you mean 'smollm2-135m'?"),
                            ("a=/no/such/model.gguf", "'/no/such/model.gguf': no such file"),
                            ("tiny-lama", "did you mean 'tiny-llama'?")):  # fmt: skip
            rc = main(["serve", "--model", model, "--port", port, "--backend", "host"])
            err = capsys.readouterr().err
            assert rc == 2 and said in err and "address" not in err.lower(), err
    assert main(["serve", "--modle", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert "usage: jax-kvcached serve" in err and "did you mean --model?" in err
    assert main(["ctl", "list", "--grop", "g"]) == 2
    assert "did you mean --group?" in capsys.readouterr().err

