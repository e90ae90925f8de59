"""``jax-kvcached top``: a live view of a running server's models."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from jax_kvcached.cli.common import usage_error


def add(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    t = command("top", "live view of a running server's models")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the server, or HOST:PORT")
    t.add_argument("--api-key", default=None,
                   help="sent as a Bearer key (default: $KVCACHED_API_KEY)")  # fmt: skip
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    t.add_argument("--once", action="store_true", help="print one frame and exit")


def run(args: argparse.Namespace) -> int:
    from jax_kvcached.serve.top import run_top

    if args.interval <= 0:
        return usage_error("--interval must be > 0")
    key = args.api_key or os.environ.get("KVCACHED_API_KEY") or None
    url = args.url if "://" in args.url else f"http://{args.url}"
    return run_top(url, args.interval, args.once, api_key=key)
