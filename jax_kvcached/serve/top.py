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


def _mib(v: float) -> str:
    return "  -" if v is None or math.isnan(v) else f"{v / MiB:7.1f}"


def render(m: dict[str, Any], prev: dict[str, Any] | None = None, dt: float = 1.0) -> str:
    """One frame: the pool line, then a row per model."""
    # Summed over the server's pools (one per device).
    pool = {k: sum(m.get(f"kvcached_pool_{k}_bytes", {}).values()) for k in
            ("budget", "mapped", "reserved")}  # fmt: skip
    used = pool["mapped"] / pool["budget"] if pool["budget"] else 0.0
    bar = "#" * round(30 * used) + "." * (30 - round(30 * used))
    lines = [
        f"pool [{bar}] {pool['mapped'] / MiB:.1f} / {pool['budget'] / MiB:.1f} MiB mapped "
        f"({100 * used:.0f}%), {pool['reserved'] / MiB:.1f} MiB reserved",
        "",
        f"{'MODEL':<16}{'MAPPED':>8}{'LIMIT':>8}{'GUAR':>8} {'HIT%':>5} {'CACHED':>7} "
        f"{'HOST':>7} {'HHIT%':>5} "
        f"{'QUEUE':>5} {'RUN':>4} {'TOK/S':>7} {'PREEMPT':>7} {'TTFT p50':>9} {'p99':>8}",
    ]
    mapped = _by_model(m, "kvcached_mapped_bytes")
    limit = _by_model(m, "kvcached_memory_limit_bytes")
    guar = _by_model(m, "kvcached_memory_guarantee_bytes")
    hit = _by_model(m, "kvcached_prefix_hit_rate")
    cached = _by_model(m, "kvcached_prefix_cached_tokens")
    host = _by_model(m, "kvcached_host_cache_bytes")
    host_cap = _by_model(m, "kvcached_host_cache_capacity_bytes")
    host_hit = _by_model(m, "kvcached_host_hit_rate")
    queue = _by_model(m, "kvcached_queue_depth")
    running = _by_model(m, "kvcached_running_requests")
    pre = _by_model(m, "kvcached_preemptions_total")
    failed = _by_model(m, "kvcached_model_failed")
    toks = _by_model(m, "kvcached_generated_tokens_total")
    before = _by_model(prev, "kvcached_generated_tokens_total") if prev else {}
    for model in sorted(mapped):
        rate = (toks[model] - before[model]) / dt if model in before else math.nan
        p50, p99 = _ttft(m, model)
        ms = lambda v: "       -" if math.isnan(v) else f"{1e3 * v:6.0f}ms"  # noqa: E731
        name = model + (" (FAILED)" if failed.get(model) else "")
        lines.append(
            f"{name:<16}{_mib(mapped[model]):>8}{_mib(limit.get(model)):>8}"
            f"{_mib(guar.get(model, 0.0)):>8} {100 * hit.get(model, 0.0):5.1f} "
            f"{cached.get(model, 0):7.0f} "
            f"{_mib(host.get(model)) if host_cap.get(model) else '      -':>7} "
            f"{100 * host_hit.get(model, 0.0):5.1f} "
            f"{queue.get(model, 0):5.0f} {running.get(model, 0):4.0f} "
            f"{'      -' if math.isnan(rate) else f'{rate:7.1f}'} {pre.get(model, 0):7.0f} "
            f"{ms(p50):>9} {ms(p99):>8}"
        )
    lines += _group_lines(m)
    return "\n".join(lines)


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
        f"{'TENANT':<16}{'PID':>8}{'MAPPED':>8}{'RESERVE':>8}{'LIMIT':>8}{'GUAR':>8} {'HIT%':>5}",
    ]
    for key in sorted(mapped, key=lambda k: (dict(k)["tenant"], dict(k)["pid"])):
        lab = dict(key)
        h = hit.get(key, math.nan)
        lines.append(
            f"{lab['tenant'][:16]:<16}{lab['pid']:>8}{_mib(mapped[key]):>8}"
            f"{_mib(col['reserved'].get(key)):>8}{_mib(col['limit'].get(key)):>8}"
            f"{_mib(col['guarantee'].get(key)):>8} "
            f"{'    -' if math.isnan(h) else f'{100 * h:5.1f}'}"
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
    sys.stdout.write("\x1b[H\x1b[2J" + f"jax-kvcached top  {url}  (Ctrl-C quits)\n\n{body}\n")
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
            _draw(url, f"disconnected: {e}; retrying every {interval:g} s")
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
