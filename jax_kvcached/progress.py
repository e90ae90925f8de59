"""Console output for the demos."""

from __future__ import annotations

import sys


class Log:
    """Prints lines and a progress bar (redrawn on a terminal, every quarter otherwise)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stdout.isatty()

    def __call__(self, msg: str = "") -> None:
        if not self.quiet:
            print(msg, flush=True)

    def progress(self, name: str, done: int, total: int, unit: str = "steps") -> None:
        if self.quiet or (not self.tty and done != total and done % max(total // 4, 1)):
            return
        width = 30
        fill = width * done // total
        end = "\n" if done == total or not self.tty else ""
        bar = "#" * fill + "." * (width - fill)
        print(
            f"{chr(13) if self.tty else ''}  {name:<11} [{bar}] {done}/{total} {unit}",
            end=end,
            flush=True,
        )
