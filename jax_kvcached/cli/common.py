"""What the subcommands share: the help formatter and one-line errors."""

from __future__ import annotations

import argparse
import sys


class HelpWithDefaults(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is False:
            return text + " (default: off)"
        if action.default is None:
            return text + " (default: none)"
        return text + " (default: %(default)s)"


def fail(err: BaseException) -> int:
    """One line on stderr naming the flags (``--memory``, not the library's argument)."""
    msg = str(err).replace("memory_limit", "--memory").replace("page_size", "--page-size")
    print(f"error: {msg}", file=sys.stderr)
    return 2


def usage_error(msg: str) -> int:
    """A bad argument: one line on stderr, exit status 2."""
    print(f"error: {msg}", file=sys.stderr)
    return 2
