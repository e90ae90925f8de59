"""jax-kvcached: elastic, virtualized KV-cache memory for JAX. Commands: demo (the main
job), kv-demo, serve (an OpenAI-compatible server), top, ctl and download."""

from __future__ import annotations

import argparse
import sys

from jax_kvcached.cli import ctl, demo, download, kv_demo, serve, top
from jax_kvcached.cli.common import HelpWithDefaults

# Each subcommand's module: ``add(command)`` adds its parser, ``run(args)`` runs it.
COMMANDS = {"demo": demo, "kv-demo": kv_demo, "download": download, "serve": serve, "top": top,
            "ctl": ctl}  # fmt: skip


def _version() -> str:
    from jax_kvcached import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jax-kvcached", description=__doc__, formatter_class=HelpWithDefaults
    )
    p.add_argument("--version", action="version", version=f"jax-kvcached {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpWithDefaults)

    for module in COMMANDS.values():
        module.add(command)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if (msg := ctl.negative_size(argv)) is not None:
        print(msg, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
