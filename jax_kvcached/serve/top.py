"""``jax-kvcached top``: a live terminal view of a server's models (like kvcached's kvtop)."""

from __future__ import annotations

import itertools
import math
import sys
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

MiB = 1 << 20


def scrape(url: str, timeout: float = 5.0, api_key: str | None = None) -> dict[str, Any]:
    """The server's /metrics as {metric: {labels tuple: value}} plus histograms.

    ``api_key`` is sent as a Bearer key (``/metrics`` is open on our server; a proxy in
    front of it may not be)."""
    req = urllib.request.Request(url.rstrip("/") + "/metrics")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = tuple(sorted(s.labels.items()))
            out.setdefault(s.name, {})[key] = s.value
    return out


def _by_model(m: dict[str, Any], name: str) -> dict[str, float]:
    return {dict(k).get("model", ""): v for k, v in m.get(name, {}).items()}


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """A quantile from cumulative histogram buckets [(upper bound, count)], interpolated."""
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return math.nan
    rank, prev_b, prev_c = q * total, 0.0, 0.0
    for b, c in buckets:
        if c >= rank:
            if math.isinf(b):
                return prev_b
            return prev_b + (b - prev_b) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_b, prev_c = b, c
    return prev_b


def _ttft(m: dict[str, Any], model: str) -> tuple[float, float]:
    rows = []
    for k, v in m.get("kvcached_ttft_seconds_bucket", {}).items():
        labels = dict(k)
        if labels.get("model") == model:
            rows.append((float(labels["le"]), v))
    rows.sort()
    return quantile(rows, 0.5), quantile(rows, 0.99)


WIDTH = 80  # every line of a frame fits a classic terminal


def size(v: float | None) -> str:
    """Bytes with a binary unit, at most 8 characters: ``512KiB``, ``3.0MiB``,
    ``1.2GiB`` (``-``: unknown)."""
    if v is None or math.isnan(v):
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if v >= scale or unit == "KiB":
            x = v / scale
            return f"{x:.1f}{unit}" if x < 100 else f"{x:.0f}{unit}"
    return "-"


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{1e3 * v:.0f}ms"


def render(m: dict[str, Any], prev: dict[str, Any] | None = None, dt: float = 1.0) -> str:
    """One frame of at most 80 columns: the pool line, a memory table and a serving
    table (a row per model in each), and the group's processes when in a group."""
    # Summed over the server's pools (one per device).
    pool = {k: sum(m.get(f"kvcached_pool_{k}_bytes", {}).values()) for k in
            ("budget", "mapped", "reserved")}  # fmt: skip
    used = pool["mapped"] / pool["budget"] if pool["budget"] else 0.0
    bar = "#" * round(20 * used) + "." * (20 - round(20 * used))
    lines = [
        f"pool [{bar}] {size(pool['mapped'])} of {size(pool['budget'])} mapped "
        f"({100 * used:.0f}%), {size(pool['reserved'])} reserved",
        "",
        f"{'MODEL':<16}{'MAPPED':>9}{'LIMIT':>9}{'GUARANT':>9}{'HIT%':>6}{'CACHED':>8}"
        f"{'HOST':>9}{'HOSTHIT%':>9}",
    ]
    mapped = _by_model(m, "kvcached_mapped_bytes")
    limit = _by_model(m, "kvcached_memory_limit_bytes")
    guar = _by_model(m, "kvcached_memory_guarantee_bytes")
    hit = _by_model(m, "kvcached_prefix_hit_rate")
    cached = _by_model(m, "kvcached_prefix_cached_tokens")
    host = _by_model(m, "kvcached_host_cache_bytes")
    host_cap = _by_model(m, "kvcached_host_cache_capacity_bytes")
    host_hit = _by_model(m, "kvcached_host_hit_rate")
    failed = _by_model(m, "kvcached_model_failed")
    asleep = _by_model(m, "kvcached_model_sleeping")
    models = sorted(mapped)

    def name(model: str) -> str:
        if failed.get(model):
            return (model[:8] + " FAILED")[:15]
        return (model[:8] + " ASLEEP" if asleep.get(model) else model)[:15]

    for model in models:
        lines.append(
            f"{name(model):<16}{size(mapped[model]):>9}{size(limit.get(model)):>9}"
            f"{size(guar.get(model, 0.0)):>9}{100 * hit.get(model, 0.0):>6.1f}"
            f"{cached.get(model, 0):>8.0f}"
            f"{size(host.get(model)) if host_cap.get(model) else '-':>9}"
            f"{100 * host_hit.get(model, 0.0):>9.1f}"
        )
    queue = _by_model(m, "kvcached_queue_depth")
    running = _by_model(m, "kvcached_running_requests")
    pre = _by_model(m, "kvcached_preemptions_total")
    toks = _by_model(m, "kvcached_generated_tokens_total")
    before = _by_model(prev, "kvcached_generated_tokens_total") if prev else {}
    lines += [
        "",
        f"{'MODEL':<16}{'QUEUE':>7}{'RUN':>5}{'TOK/S':>9}{'PREEMPT':>9}{'TTFT p50':>10}{'p99':>8}",
    ]
    for model in models:
        rate = (toks[model] - before[model]) / dt if model in before else math.nan
        p50, p99 = _ttft(m, model)
        lines.append(
            f"{name(model):<16}{queue.get(model, 0):>7.0f}{running.get(model, 0):>5.0f}"
            f"{'-' if math.isnan(rate) else f'{rate:.1f}':>9}{pre.get(model, 0):>9.0f}"
            f"{_ms(p50):>10}{_ms(p99):>8}"
        )
    lines += _kv_group_lines(m)
    lines += [f"{model[:15]:<16}LoRA adapter slots {size(v)}"
              for model, v in sorted(_by_model(m, "kvcached_lora_slot_bytes").items()) if v]
    lines += _group_lines(m)
    return "\n".join(ln[:WIDTH] for ln in lines)


def _kv_group_lines(m: dict[str, Any]) -> list[str]:
    """Models of several KV cache groups: each group's mapped memory (full attention, a
    window, or recurrent state)."""
    per: dict[str, list[tuple[int, str, float]]] = {}
    for key, v in m.get("kvcached_kv_cache_group_mapped_bytes", {}).items():
        lab = dict(key)
        w, kind = int(lab["window"]), lab.get("kind", "full")
        name = "state" if kind == "recurrent" else "full" if w == 0 else f"window {w}"
        per.setdefault(lab["model"], []).append((int(lab["kv_group"]), name, v))
    lines = []
    for model in sorted(per):
        groups = sorted(per[model])
        if len(groups) < 2:
            continue
        parts = [f"{name} {size(v)}" for _, name, v in groups]
        lines.append(f"{model[:15]:<16}KV groups: " + ", ".join(parts))
    return ([""] + lines) if lines else []


def _group_lines(m: dict[str, Any]) -> list[str]:
    """Every process of the server's group (if it is in one), a row per tenant."""
    mapped = m.get("kvcached_group_mapped_bytes", {})
    if not mapped:
        return []
    col = {k: m.get(f"kvcached_group_{k}_bytes", {}) for k in ("reserved", "limit", "guarantee")}
    hit = m.get("kvcached_group_hit_rate", {})
    group = dict(next(iter(mapped))).get("group", "")
    lines = [
        "",
        f"group {group}: every process",
        f"{'TENANT':<16}{'PID':>8}{'MAPPED':>9}{'RESERVE':>9}{'LIMIT':>9}{'GUARANT':>9}{'HIT%':>6}",
    ]
    for key in sorted(mapped, key=lambda k: (dict(k)["tenant"], dict(k)["pid"])):
        lab = dict(key)
        h = hit.get(key, math.nan)
        lines.append(
            f"{lab['tenant'][:15]:<16}{lab['pid']:>8}{size(mapped[key]):>9}"
            f"{size(col['reserved'].get(key)):>9}{size(col['limit'].get(key)):>9}"
            f"{size(col['guarantee'].get(key)):>9}"
            f"{'-' if math.isnan(h) else f'{100 * h:.1f}':>6}"
        )
    return lines


def run_top(
    url: str,
    interval: float = 1.0,
    once: bool = False,
    api_key: str | None = None,
    frames: int | None = None,
) -> int:
    """Draws the server's frames until Ctrl-C (``frames``: that many, then returns)."""
    try:
        return _loop(url, interval, once, api_key, frames)
    except KeyboardInterrupt:
        return 0


def _draw(url: str, body: str) -> None:
    """Clears the terminal and writes one screen."""
    head = f"jax-kvcached top  {url}"[: WIDTH - 14] + "  (Ctrl-C quits)"
    sys.stdout.write("\x1b[H\x1b[2J" + f"{head}\n\n{body}\n")
    sys.stdout.flush()


def _loop(
    url: str, interval: float, once: bool, api_key: str | None, frames: int | None = None
) -> int:
    """Redraws every ``interval`` s; a server that is away (not started yet, restarting)
    shows as "disconnected" and is retried. ``--once`` fails instead (exit 1)."""
    prev, t_prev = None, time.monotonic()
    for _ in itertools.count() if frames is None else range(frames):
        try:
            m = scrape(url, api_key=api_key)
        except OSError as e:
            if once:
                print(f"error: cannot read {url}/metrics: {e}", file=sys.stderr)
                return 1
            _draw(url, f"disconnected: {e}"[: WIDTH - 24] + f"; retrying every {interval:g} s")
            prev = None
            time.sleep(interval)
            continue
        now = time.monotonic()
        frame = render(m, prev, now - t_prev)
        if once:
            print(frame)
            return 0
        _draw(url, frame)
        prev, t_prev = m, now
        time.sleep(interval)
    return 0
