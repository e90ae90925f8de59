import subprocess
import sys

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
    # Run from an empty folder so the installed package is imported, not the checkout.
    r = subprocess.run(
        [sys.executable, "-m", "jax_kvcached.cli", "demo", "--max-tokens", "4", "--batch", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "TTFT" in r.stdout and "peak mapped" in r.stdout


def test_cli_rejects_bad_arguments(capsys):
    assert main(["demo", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["kv-demo", "--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
