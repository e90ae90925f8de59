"""``jax-kvcached demo``: SmolLM2-135M-Instruct answers chat prompts through a pool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from jax_kvcached.cli.common import fail, usage_error


def add(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    m = command("demo", "SmolLM2-135M-Instruct answers chat prompts through a pool")
    m.add_argument(
        "--model", default="smollm2-135m",
        help="smollm2-135m (trained; downloaded on first use, 98 MB), or a random tiny "
        "preset (tiny-llama, tiny-qwen2)",
    )  # fmt: skip
    m.add_argument("--memory", default="256MiB", help="pool budget")
    m.add_argument("--batch", type=int, default=8, help="prompts")
    m.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    m.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    m.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"],
                   help="physical memory")  # fmt: skip
    m.add_argument("--seed", type=int, default=0, help="sampling and preset weights")


def run(args: argparse.Namespace) -> int:
    if args.batch <= 0 or args.max_tokens <= 0:
        return usage_error("--batch and --max-tokens must be > 0")
    from jax_kvcached.demo import run_demo

    try:
        out = run_demo(args.model, args.memory, args.max_tokens, args.batch, args.temperature,
                       args.backend, args.seed)  # fmt: skip
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # a bad model, size...
        return fail(e)
    if out["mapped_after_reset_mib"] != 0:
        print("error: pages still mapped after every request finished", file=sys.stderr)
        return 1
    return 0
