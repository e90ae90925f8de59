"""Host time per decode step, two commits side by side: ``bench_decode.py --parts
launches`` run alternately on each (``git checkout``, so the working tree must be clean;
it is put back on the branch it was on), medians per row over the runs. Writes
``results/bench_decode_launches_ab.json``.

    python benchmarks/ab_launches.py BEFORE [AFTER] [--runs 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KEY = ("batch", "fused_sampling", "command_buffers")
FIGURES = ("host_ms", "dispatch_ms", "step_ms")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def _run(commit: str, rounds: int, out: str) -> list[dict]:
    _git("checkout", "-q", commit)
    subprocess.run([sys.executable, os.path.join(HERE, "bench_decode.py"), "--parts",
                    "launches", "--rounds", str(rounds), "--out", out], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    with open(out) as f:
        return json.load(f)["launches"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("before")
    p.add_argument("after", nargs="?", default="HEAD")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if _git("status", "--porcelain", "--untracked-files=no"):
        sys.exit("ab_launches: commit or stash first (it checks commits out)")
    branch = _git("rev-parse", "--abbrev-ref", "HEAD")
    sides = {"before": _git("rev-parse", "--short", args.before),
             "after": _git("rev-parse", "--short", args.after)}  # fmt: skip
    got: dict[str, list[list[dict]]] = {"before": [], "after": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                for side, commit in sides.items():
                    got[side].append(_run(commit, args.rounds, f"{tmp}/{side}{i}.json"))
    finally:
        _git("checkout", "-q", branch)
    rows = []
    for row in got["after"][0]:
        key = tuple(row.get(k) for k in KEY)
        out = {k: row.get(k) for k in KEY}
        for fig in FIGURES:
            for side in ("before", "after"):
                vals = [r[fig] for run in got[side] for r in run
                        if tuple(r.get(k) for k in KEY) == key]  # fmt: skip
                out[f"{fig}_{side}"] = float(np.median(vals))
        out["host_after_over_before"] = out["host_ms_after"] / out["host_ms_before"]
        out["launches_greedy"] = row["launches_greedy"]
        rows.append(out)
    result = {"before_commit": sides["before"], "after_commit": sides["after"],
              "rounds_per_run": args.rounds, "runs_per_side": args.runs,
              "order": "before, after, alternating", "rows": rows}  # fmt: skip
    path = os.path.join(HERE, "results", "bench_decode_launches_ab.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"B={r['batch']:>3} fused={r['fused_sampling']!s:>5}: host "
              f"{r['host_ms_before']:.3f} -> {r['host_ms_after']:.3f} ms "
              f"({r['host_after_over_before']:.2f}x), dispatch {r['dispatch_ms_before']:.3f} "
              f"-> {r['dispatch_ms_after']:.3f} ms")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
