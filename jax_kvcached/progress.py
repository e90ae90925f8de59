"""Console output for the demos."""

from __future__ import annotations

import sys
import time


class Log:
    """Prints lines and a progress bar with an ETA (redrawn on a terminal; otherwise a
    line every ``every`` steps: default a quarter of the total)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stdout.isatty()
        self._started: dict[str, float] = {}

    def __call__(self, msg: str = "") -> None:
        if not self.quiet:
            print(msg, flush=True)

    def progress(
        self, name: str, done: int, total: int, unit: str = "steps", every: int | None = None
    ) -> None:
        now = time.perf_counter()
        t0 = self._started.setdefault(name, now)
        if done >= total:
            self._started.pop(name, None)
        step = every or max(total // 4, 1)
        if self.quiet or (not self.tty and done != total and done % step):
            return
        width = 30
        fill = width * done // max(total, 1)
        end = "\n" if done >= total or not self.tty else ""
        bar = "#" * fill + "." * (width - fill)
        spent = now - t0
        if done >= total:
            when = f"{spent:.1f} s"
        elif done:
            when = f"ETA {spent / done * (total - done):.0f} s"
        else:
            when = ""
        print(
            f"{chr(13) if self.tty else ''}  {name:<11} [{bar}] {done}/{total} {unit} {when}",
            end=end,
            flush=True,
        )
