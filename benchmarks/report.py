"""The figures of the benchmarks' committed JSON as markdown: docs/benchmarks.md's tables
and the figures the README and docs/ quote are written by this script, never by hand.

``python benchmarks/report.py benchmarks/results/bench_decode.json [...]`` prints, per
file, its scalar figures as a list and every list of rows as a table (numbers rounded to
3 significant digits), in the order the JSON holds them.

``python benchmarks/report.py --write`` rewrites the generated regions of README.md and
docs/*.md from ``benchmarks/results/``; ``--check`` says which pages differ (exit 1).
``tests/test_docs.py`` checks that the committed pages are what ``--write`` makes. The
regions, in a page's markdown (HTML comments: invisible when rendered):

* ``<!-- report FILE [skip=PATH,...] -->`` ... ``<!-- /report -->``: FILE as printed above;
* ``<!-- table NAME -->`` ... ``<!-- /table -->``: a table of :data:`TABLES`;
* ``<!-- fig SPEC -->`` VALUE ``<!-- /fig -->``, inline: one figure, SPEC being a name in
  :data:`FIGURES` or ``FILE:PATH [scale=X] [div=X] [fmt=SPEC]`` (PATH's keys joined by
  ``/``, a list's items by their index; the value times ``scale`` or over ``div``;
  ``fmt`` a Python format spec, default 3 significant digits).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
Loader = Callable[[str], Any]  # a results file's name -> its JSON


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


def table(rows: list[dict], keys: list[str] | None = None) -> list[str]:
    """A markdown table of rows (``keys``, or the union of their scalar keys in first-seen
    order)."""
    if keys is None:
        keys = []
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


# -- figures and tables of the pages ----------------------------------------------------


def lookup(data: Any, path: str) -> Any:
    """The value at ``path`` (keys joined by ``/``; a list's items by index)."""
    for key in filter(None, path.split("/")):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


def _span(lo: float, hi: float, fmt: str = ".0f") -> str:
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def _wakes_ms(load: Loader, run: str, field: str, model: str = "smollm2-135m") -> str:
    rows = [r for r in lookup(load("bench_sleep.json"), f"runs/{run}/wake_detail")
            if r["model"] == model]  # fmt: skip
    ms = [r[field] * 1e3 for r in rows]
    return _span(min(ms), max(ms))


def _stall_prompts(load: Loader, side: str) -> list[tuple[dict, dict]]:
    """(run, prompt) of every long prompt of ``bench_serving.py --parts stall``."""
    runs = load(f"bench_serving_stall_{side}.json")["stall"]["runs"]
    return [(r, p) for r in runs for p in r["prompts"]]


def _stall_span(load: Loader, side: str) -> str:
    ratios = [p["ratio"] for _, p in _stall_prompts(load, side)]
    return _span(min(ratios), max(ratios), ".1f")


FIGURES: dict[str, Callable[[Loader], str]] = {
    # SmolLM2's level-1 wake (its weights back, then the preload): the default 4096-token
    # preload, and without one.
    "smollm2_wake_ms": lambda load: _wakes_ms(load, "4096", "seconds"),
    "smollm2_wake_weights_ms": lambda load: _wakes_ms(load, "4096", "weights_s"),
    "smollm2_wake_no_preload_ms": lambda load: _wakes_ms(load, "0", "seconds"),
    "tiny_wake_no_preload_ms": lambda load: _span(*(lambda ms: (min(ms), max(ms)))([
        r["seconds"] * 1e3 for r in lookup(load("bench_sleep.json"), "runs/0/wake_detail")
        if r["model"] != "smollm2-135m"])),  # fmt: skip
    "mla_ratio": lambda load: f"1/{1 / load('bench_mla.json')['pool']['ratio_measured']:.0f}",
    # the streams' longest gap over their median while a long prompt prefills
    "stall_after": lambda load: _stall_span(load, "after"),
    "stall_before": lambda load: _stall_span(load, "before"),
}


def _stall_table(load: Loader) -> list[str]:
    rows = zip(_stall_prompts(load, "before"), _stall_prompts(load, "after"), strict=True)
    out = ["| run | prompt | tokens | before: longest / median gap | before: ratio | "
           "before: TTFT | after: longest / median gap | after: ratio | after: median "
           "during | after: TTFT |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for (br, b), (ar, a) in rows:
        assert (br["run"], b["tokens"]) == (ar["run"], a["tokens"]), "runs differ"
        which = "first" if a["first_after_start"] else "later"
        out.append(
            f"| {ar['run']} | {which} | {a['tokens']} | {b['longest_gap_ms']:.0f} / "
            f"{br['median_gap_ms']:.1f} ms | {b['ratio']:.1f}x | {b['ttft_s']:.1f} s | "
            f"{a['longest_gap_ms']:.0f} / {ar['median_gap_ms']:.1f} ms | "
            f"**{a['ratio']:.1f}x** | {a['median_gap_during_ms']:.0f} ms | {a['ttft_s']:.1f} s |"
        )
    return out


_SOAK = [  # (figure, label, unit, format)
    ("rss_anon_mib", "private resident memory (`RssAnon`)", " MiB", ".1f"),
    ("rss_shmem_mib", "shared resident memory (`RssShmem`: the KV pages, memfd)", " MiB", ".0f"),
    ("mapped_mib", "mapped KV", " MiB", ".0f"),
    ("open_files", "open files", "", ".0f"),
    ("threads", "threads", "", ".0f"),
]


def _soak_table(load: Loader) -> list[str]:
    d = load("bench_soak.json")
    out = [f"| figure | after warm-up | at {d['minutes']} min | change | range | per minute |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for key, label, unit, f in _SOAK:
        x = d["drift"][key]
        per = x["slope_per_min"]
        per = 0.0 if abs(per) < 5e-4 else per
        out.append(f"| {label} | {x['first']:{f}}{unit} | {x['last']:{f}}{unit} | "
                   f"{x['change']:+{f}}{unit} | {x['range']:{f}}{unit} | {per:.2g}{unit} |")
    return [ln.replace("+0 |", "0 |") for ln in out]


def _gc_table(load: Loader) -> list[str]:
    d = load("bench_gc.json")
    out = ["| variant | objects the collector tracks | gen-2 collections | longest gen-2 pause | "
           "gen-2 total | longest gen-0 / gen-1 |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for key, label in (("as_is", "as it was"), ("freeze", "`serve`'s freeze after the warm-up")):
        v, g = d[key], d[key]["generations"]
        tracked = f"{v['tracked']}" if v["tracked"] else "0 (all frozen)"
        young = f"{g['0']['max_ms']:.1f} / {g['1']['max_ms']:.1f} ms"
        out.append(f"| {label} | {tracked} | {g['2']['count']} | {g['2']['max_ms']:.0f} ms | "
                   f"{g['2']['total_ms']:.0f} ms | {young} |")
    return out


def _faults_table(load: Loader) -> list[str]:
    d = load("bench_faults.json")

    def yes(case: str) -> str:
        return "yes" if d[case]["kept"] else "**no**"

    k, b, st, sc, bc = (d[c] for c in ("kill9", "burst", "store", "slow_clients", "bad_checkpoint"))
    sig = d["sigterm"]
    runs = sig["runs"]
    kept = sum(r["kept"] for r in runs)
    exits = [r["exit_s"] for r in runs]
    rows = [
        ("kill9", "two servers of one process group stream 4 x 300 tokens each; one is killed "
         "with SIGKILL",
         f"{k['survivor_streams_identical']} / {k['streams']} streams identical; its row gone "
         f"{k['dead_row_gone_after_s']:.2f} s after the kill"),
        ("burst", f"{b['requests']} requests of 400 + 200 tokens at once, 8 admitted, a 3 MiB "
         "budget that holds about two",
         f"{b['identical_to_alone']} / {b['requests']} identical, {b['5xx']} 5xx, "
         f"{b['preemptions']:.0f} preemptions, {b['mapped_pages_after']} pages mapped after"),
        ("store", "the compilation cache with every file truncated; on a read-only tmpfs; on a "
         "full tmpfs",
         "answered " + ", ".join(str(st[v]["answered"]) for v in ("truncated", "read_only",
                                                                 "full_disk"))
         + f"; lines said: truncated {st['truncated']['said_do_not_load']}, read-only "
         f"{st['read_only']['said_cannot_write']}, full {st['full_disk']['said_cannot_write']}; "
         f"{sum(st[v]['jax_warnings_shown'] for v in ('truncated', 'read_only', 'full_disk'))}"
         " JAX warnings"),
        ("sigterm", "SIGTERM 0.05 / 0.2 / 0.5 s into a sleep, a wake and a host-tier restore "
         "(SmolLM2, a process group)",
         f"{kept} / {len(runs)}: exit 0 in {_span(min(exits), max(exits), '.1f')} s, "
         f"{sum(r['rows_left'] for r in runs)} rows left; the restore phase's prompt does come "
         f"from the host tier ({sig['restore_phase_host_hit_tokens']:.0f} tokens)"),
        ("slow_clients", "64 slowloris bodies (a byte a second) and 8 streams of 4000 tokens "
         "never read",
         f"p50 {sc['p50_ms'][0]} -> {sc['p50_ms'][1]} ms, max {sc['max_ms'][0]:.0f} -> "
         f"{sc['max_ms'][1]:.0f} ms; RSS {sc['rss_mib'][0]} -> {sc['rss_mib'][1]} MiB"),
        ("bad_checkpoint", "a GGUF with a garbled header; a truncated safetensors file",
         f"exit {bc['gguf']['exit']} in {bc['gguf']['seconds']} s and "
         f"{bc['safetensors']['exit']} in {bc['safetensors']['seconds']} s; "
         + ("each line names the file" if bc["gguf"]["names_the_file"]
            and bc["safetensors"]["names_the_file"] else "**a line does not name its file**")),
    ]  # fmt: skip
    out = ["| case | fault | expectation | kept | figures |", "| --- | --- | --- | --- | --- |"]
    out += [f"| `{c}` | {what} | {d[c]['expect']} | {yes(c)} | {figs} |" for c, what, figs in rows]
    return out


def _rows(file: str, path: str, keys: list[str] | None = None) -> Callable[[Loader], list[str]]:
    return lambda load: table(lookup(load(file), path), keys)


TABLES: dict[str, Callable[[Loader], list[str]]] = {
    "stall": _stall_table,
    "router": _rows("bench_router.json", "rows"),
    "multihost": _rows("bench_multihost.json", "rows"),
    "soak": _soak_table,
    "gc": _gc_table,
    "faults": _faults_table,
}


def figure(spec: str, load: Loader) -> str:
    """The text of one ``fig`` region."""
    name, *opts = spec.split()
    if name in FIGURES:
        return FIGURES[name](load)
    file, _, path = name.partition(":")
    value = lookup(load(file), path)
    kw = dict(o.split("=", 1) for o in opts)
    if "scale" in kw:
        value = value * float(kw["scale"])
    if "div" in kw:
        value = value / float(kw["div"])
    return format(value, kw["fmt"]) if "fmt" in kw else _fmt(value)


def _report_region(spec: str, load: Loader) -> list[str]:
    file, *opts = spec.split()
    kw = dict(o.split("=", 1) for o in opts)
    skip = tuple(filter(None, kw.get("skip", "").split(",")))
    lines = report(load(file), skip=skip)
    while lines and not lines[-1]:
        lines.pop()
    return lines


_BLOCK = re.compile(r"(<!-- (report|table) ([^\n]*?) -->\n)(.*?)(<!-- /\2 -->)", re.S)
_FIG = re.compile(r"(<!-- fig ([^\n]*?) -->)(.*?)(<!-- /fig -->)", re.S)


def results_loader(folder: pathlib.Path = RESULTS) -> Loader:
    cache: dict[str, Any] = {}

    def load(name: str) -> Any:
        if name not in cache:
            cache[name] = json.loads((folder / name).read_text())
        return cache[name]

    return load


def render(text: str, load: Loader | None = None) -> str:
    """``text`` with every generated region written anew from the JSON."""
    load = load or results_loader()

    def block(m: re.Match) -> str:
        kind, spec = m.group(2), m.group(3)
        lines = _report_region(spec, load) if kind == "report" else TABLES[spec](load)
        return m.group(1) + "\n".join(lines) + "\n" + m.group(5)

    text = _BLOCK.sub(block, text)
    return _FIG.sub(lambda m: m.group(1) + figure(m.group(2), load) + m.group(4), text)


def pages() -> list[pathlib.Path]:
    """The pages with generated regions: the README and docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*")
    p.add_argument("--skip", default="", help="paths to leave out, comma-separated")
    p.add_argument("--write", action="store_true", help="rewrite README.md and docs/*.md")
    p.add_argument("--check", action="store_true", help="exit 1 if a page is not as written")
    args = p.parse_args()
    if args.write or args.check:
        stale = []
        for page in pages():
            text = page.read_text()
            new = render(text)
            if new != text:
                stale.append(page.relative_to(ROOT).as_posix())
                if args.write:
                    page.write_text(new)
        verb = "rewrote" if args.write else "differ from the JSON"
        print(f"{verb}: {', '.join(stale)}" if stale else "every page is as the JSON says")
        sys.exit(1 if stale and args.check else 0)
    for f in args.files:
        with open(f) as fh:
            data = json.load(fh)
        print(f"### {f}\n")
        print("\n".join(report(data, skip=tuple(filter(None, args.skip.split(","))))))


if __name__ == "__main__":
    main()
