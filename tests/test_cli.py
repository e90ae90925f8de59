import subprocess
import sys

from jax_kvcached.cli import main
from jax_kvcached.demo import run_demo


def test_demo_runs_verifies_and_returns_every_page():
    out = run_demo("64MiB", batch=3, steps=20, backend="host", quiet=True)
    assert [r["verified"] for r in out["results"]] == [True, True]
    assert out["final"]["mapped_pages"] == 0
    first, second = out["results"]
    assert first["pages_created"] > 0
    assert second["pages_created"] == 0 and second["pages_reused"] > 0  # pages moved over


def test_cli_demo_entry_point(tmp_path):
    # Run from an empty folder so the installed package is imported, not the checkout.
    r = subprocess.run(
        [sys.executable, "-m", "jax_kvcached.cli", "demo", "--steps", "20", "--batch", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout and "True" in r.stdout


def test_cli_rejects_bad_arguments(capsys):
    assert main(["demo", "--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
