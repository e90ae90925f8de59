"""``jax-kvcached kv-demo``: two tenants share one pool through jitted FFI steps."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from jax_kvcached.cli.common import fail, usage_error


def add(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    d = command("kv-demo", "two tenants share one pool through jitted FFI steps")
    d.add_argument("--memory", default="256MiB", help="pool budget")
    d.add_argument("--batch", type=int, default=8, help="sequences per tenant")
    d.add_argument("--steps", type=int, default=96, help="tokens per sequence")
    d.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"],
                   help="physical memory")  # fmt: skip
    d.add_argument("--seed", type=int, default=0, help="the K/V data's seed")


def run(args: argparse.Namespace) -> int:
    if args.batch <= 0 or args.steps <= 1:
        return usage_error("--batch must be > 0 and --steps > 1")
    from jax_kvcached.kv_demo import run_kv_demo

    try:
        out = run_kv_demo(args.memory, args.batch, args.steps, args.backend, args.seed)
    except (ValueError, FileNotFoundError) as e:
        return fail(e)
    if not all(r["verified"] for r in out["results"]):
        print("error: data read back differs from what was written", file=sys.stderr)
        return 1
    if out["final"]["mapped_pages"] != 0:
        print("error: pages still mapped after every request finished", file=sys.stderr)
        return 1
    return 0
