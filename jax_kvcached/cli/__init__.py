"""jax-kvcached: elastic, virtualized KV-cache memory for JAX. Commands: demo (the main
job), kv-demo, serve (an OpenAI-compatible server), top, ctl and download."""

from __future__ import annotations

import argparse
import difflib
import re
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
    commands: dict[str, argparse.ArgumentParser] = {}

    def command(name: str, help: str) -> argparse.ArgumentParser:
        commands[name] = sub.add_parser(name, help=help, description=help,
                                        formatter_class=HelpWithDefaults)  # fmt: skip
        return commands[name]

    for module in COMMANDS.values():
        module.add(command)
    p.set_defaults(command_parsers=commands)  # (for the "did you mean" of a bad flag)
    return p


def _unrecognized(args: argparse.Namespace, extra: list[str]) -> int:
    """A flag the command does not take: its usage, and the nearest flag it does."""
    child = args.command_parsers[args.command]
    child.print_usage(sys.stderr)
    given = extra[0].split("=", 1)[0]
    flags = set(re.findall(r"--[a-z0-9][a-z0-9-]*", child.format_help()))
    near = difflib.get_close_matches(given, sorted(flags), n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near and given.startswith("-") else ""
    print(f"jax-kvcached {args.command}: error: unrecognized argument {extra[0]!r}{hint}",
          file=sys.stderr)  # fmt: skip
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if (msg := ctl.negative_size(argv)) is not None:
        print(msg, file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        return _unrecognized(args, extra)
    return COMMANDS[args.command].run(args)
