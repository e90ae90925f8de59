"""Command line: ``jax-kvcached demo`` (the main job) and ``jax-kvcached kv-demo``."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jax-kvcached", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("demo", help="the tiny built-in model generates through a pool")
    m.add_argument("--model", default="tiny-llama", help="built-in model (tiny-llama, tiny-qwen2)")
    m.add_argument("--memory", default="256MiB", help="pool budget (default 256MiB)")
    m.add_argument("--batch", type=int, default=8, help="prompts")
    m.add_argument("--max-tokens", type=int, default=48)
    m.add_argument("--temperature", type=float, default=0.0)
    m.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"])
    m.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("kv-demo", help="two tenants share one pool through jitted FFI steps")
    d.add_argument("--memory", default="256MiB", help="pool budget (default 256MiB)")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--steps", type=int, default=96, help="tokens per sequence")
    d.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"])
    d.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        if args.batch <= 0 or args.max_tokens <= 0:
            print("error: --batch and --max-tokens must be > 0", file=sys.stderr)
            return 2
        from jax_kvcached.demo import run_demo

        out = run_demo(
            args.model,
            args.memory,
            args.max_tokens,
            args.batch,
            args.temperature,
            args.backend,
            args.seed,
        )
        if out["mapped_after_reset_mib"] != 0:
            print("error: pages still mapped after every request finished", file=sys.stderr)
            return 1
    elif args.command == "kv-demo":
        if args.batch <= 0 or args.steps <= 1:
            print("error: --batch must be > 0 and --steps > 1", file=sys.stderr)
            return 2
        from jax_kvcached.kv_demo import run_kv_demo

        out = run_kv_demo(args.memory, args.batch, args.steps, args.backend, args.seed)
        if not all(r["verified"] for r in out["results"]):
            print("error: data read back differs from what was written", file=sys.stderr)
            return 1
        if out["final"]["mapped_pages"] != 0:
            print("error: pages still mapped after every request finished", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
