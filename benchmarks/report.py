"""The figures of a benchmark's JSON as markdown tables (what docs/benchmarks.md shows).

``python benchmarks/report.py benchmarks/results/bench_decode.json [...]`` prints, per
file, its scalar figures as a list and every list of rows as a table (numbers rounded to
3 significant digits), in the order the JSON holds them, so each figure in the docs can
be found in its file.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    if isinstance(v, (list, tuple)) and all(not isinstance(x, (dict, list)) for x in v):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def _scalar(v: Any) -> bool:
    return not isinstance(v, (dict, list)) or (
        isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)
    )


def table(rows: list[dict]) -> list[str]:
    """A markdown table of rows (the union of their scalar keys, in first-seen order)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k, v in r.items() if k not in keys and _scalar(v)]
    out = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    out += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return out


def report(data: Any, path: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """Markdown of a JSON value: scalars as a list, lists of rows as tables, nested
    objects under their path; paths in ``skip`` (and below them) are left out."""
    out: list[str] = []
    if path in skip:
        return out
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        out += [f"`{path}`:" if path else "", *table(data), ""]
        for i, r in enumerate(data):  # nested structures inside rows
            for k, v in r.items():
                if not _scalar(v):
                    out += report(v, f"{path}[{i}].{k}", skip)
        return out
    if isinstance(data, dict):
        scalars = {k: v for k, v in data.items()
                   if _scalar(v) and (f"{path}.{k}" if path else k) not in skip}  # fmt: skip
        if scalars:
            label = f"`{path}`: " if path else ""
            out += [label + "; ".join(f"{k} {_fmt(v)}" for k, v in scalars.items()), ""]
        for k, v in data.items():
            if not _scalar(v):
                out += report(v, f"{path}.{k}" if path else k, skip)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--skip", default="", help="paths to leave out, comma-separated")
    args = p.parse_args()
    for f in args.files:
        with open(f) as fh:
            data = json.load(fh)
        print(f"### {f}\n")
        print("\n".join(report(data, skip=tuple(filter(None, args.skip.split(","))))))


if __name__ == "__main__":
    main()
