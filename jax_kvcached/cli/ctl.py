"""``jax-kvcached ctl``: list and change the tenants of a process group (kvctl)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from jax_kvcached.cli.common import HelpWithDefaults, usage_error

GROUP_HELP = "the group (default: $KVCACHED_IPC_NAME)"


def add(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    c = command("ctl", "list and change the tenants of a process group (kvctl)")
    c.add_argument("--group", default=None, metavar="NAME", help=GROUP_HELP)
    cs = c.add_subparsers(dest="action", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = cs.add_parser(name, help=help, description=help, formatter_class=HelpWithDefaults)
        # also after the action (``ctl list --group X``); SUPPRESS keeps the earlier value
        a.add_argument("--group", default=argparse.SUPPRESS, metavar="NAME", help=GROUP_HELP)
        return a

    action("list", "every tenant: pid, mapped, reserved, limit, guarantee, hit rate")
    for what in ("limit", "guarantee"):
        a = action(what, f"set a tenant's memory {what} (a running process's)")
        a.add_argument("name", help="the tenant (a served model's name)")
        a.add_argument(
            "size", help="e.g. 2GiB, 512MiB" + (", or none (the budget)" if what == "limit" else "")
        )
    a = action("sleep", "put a served model to sleep (its server gives back weights and KV)")
    a.add_argument("name", help="the tenant (a served model's name)")
    a.add_argument("--level", type=int, default=1, choices=[1, 2],
                   help="1: weights to host memory; 2: dropped (reloaded on wake)")  # fmt: skip
    a.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")
    a = action("wake", "wake a sleeping served model")
    a.add_argument("name", help="the tenant (a served model's name)")
    a.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")
    w = action("watch", "list every --interval seconds")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    w.add_argument("--count", type=int, default=None, help="frames, then exit (default: forever)")
    action("cleanup", "remove the segments of groups no live process uses (--group: that one)")


def negative_size(argv: list[str]) -> str | None:
    """``ctl limit|guarantee NAME -1GiB``: argparse would read the size as a flag (a
    two-line usage error); the one line it deserves instead."""
    if not argv or argv[0] != "ctl":
        return None
    for i, a in enumerate(argv[:-2]):
        if a in ("limit", "guarantee"):
            size = argv[i + 2]
            if size.startswith("-") and size not in ("-h", "--help", "--group"):
                return f"error: ctl {a}: the size must not be negative, got {size!r}"
    return None


def run(args: argparse.Namespace) -> int:
    from jax_kvcached.memory.shm_segment import GroupMismatch
    from jax_kvcached.serve.ctl import run_ctl

    if args.action == "watch" and not args.interval > 0:
        return usage_error("--interval must be > 0")
    try:
        return run_ctl(
            args.action, args.group, getattr(args, "name", None), getattr(args, "size", None),
            interval=getattr(args, "interval", 1.0), count=getattr(args, "count", None),
            level=getattr(args, "level", 1), timeout=getattr(args, "timeout", 60.0),
        )  # fmt: skip
    except (ValueError, KeyError, GroupMismatch) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
