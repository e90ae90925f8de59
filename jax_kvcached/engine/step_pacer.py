"""StepPacer: the prompt chunk beside decode rows, sized from measured step times.

A stream's inter-token gap is the time of the steps that carry its decode row. A step
that also prefills a chunk of a new prompt is longer, by the chunk's work: its tokens'
matmuls plus their attention over the prompt's context so far, which grows as the prompt
advances. On a CPU that work is large against a decode step (SmolLM2-135M on 2 cores: a
decode step ~12 ms; a prompt token ~4 ms at position 0 and ~20 ms at position 5500,
where reading the prompt's cached K/V alone takes ~15 ms a step), so a fixed token
budget that is cheap at the start of a prompt stalls the streams 10x near its end.

The pacer closes that loop: it keeps the time of a decode-only step (per count of decode
rows) and, after each step that carried both decode rows and prompt tokens, sizes the
next chunk so that such a step takes about ``ratio`` times a decode-only one, from the
cost per prompt token the step just showed. Invariants:

* a step with ``d`` decode rows gets ``d + 1 <= budget(d) <= cap`` tokens: every waiting
  prompt advances at least one token a step, and no step exceeds the token budget;
* the budget is a step-shape bucket (``sizes``) whenever one lies in that range, so the
  step pads nothing;
* the chunk grows by at most one bucket a step, and not into a bucket that cost more
  than ``ratio`` at the same or an earlier position of a prompt (a try would be a
  stall); before any measurement it is ``start``, and until the first decode-only step
  (nothing to hold the steps to, e.g. a burst of prompts) it grows a bucket a step.

Times are intervals between the completions of consecutive steps (what a stream sees),
or from a step's dispatch when the engine was idle before it. The schedule depends on
them, so it is not reproducible run to run; ranks of one model across hosts follow
rank 0's chunk (:meth:`follow`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

DEFAULT_RATIO = 2.5  # a step with a prompt chunk: at most this many decode steps' time
_ALPHA = 0.25  # weight of the newest decode-only step in its running mean


class StepPacer:
    """Sizes the prompt chunk of steps that carry decode rows (module docstring).

    Args:
      ratio: a step with decode rows and a prompt chunk takes about this many times a
        decode-only step (> 1).
      cap: the most tokens of such a step (``max_num_batched_tokens``).
      sizes: the step's token buckets, ascending.
      start: the chunk before any step was measured.
    """

    def __init__(self, ratio: float, cap: int, sizes: Sequence[int], start: int = 2) -> None:
        if not ratio > 1:
            raise ValueError(f"the stall ratio must be above 1, got {ratio}")
        self.ratio = ratio
        self.cap = cap
        self.sizes = sorted(s for s in sizes if s <= cap)
        self.chunk = float(start)  # prompt tokens the next step with decode rows may take
        self._decode_s: dict[int, float] = {}  # decode rows -> mean decode-only step time
        # (decode rows, step tokens) -> (its last time over a decode-only step, the prompt
        # position it reached)
        self._tried: dict[tuple[int, int], tuple[float, int]] = {}
        self._led = False

    def budget(self, decodes: int) -> int:
        """The tokens of a step with ``decodes`` decode rows (the scheduler's
        ``decode_budget``)."""
        lo = min(decodes + 1, self.cap)
        want = min(self.cap, max(lo, decodes + int(self.chunk)))
        i = bisect.bisect_right(self.sizes, want) - 1  # the largest bucket <= want
        return self.sizes[i] if i >= 0 and self.sizes[i] >= lo else want

    def decode_time(self, decodes: int) -> float | None:
        """The mean decode-only step time with ``decodes`` rows (the nearest count
        measured; None before any)."""
        if not self._decode_s:
            return None
        if decodes in self._decode_s:
            return self._decode_s[decodes]
        return self._decode_s[min(self._decode_s, key=lambda d: abs(d - decodes))]

    def observe(
        self, decodes: int, prompt_tokens: int, seconds: float, position: int = 0
    ) -> None:
        """Takes one completed step: ``decodes`` decode rows, ``prompt_tokens`` other
        tokens reaching at most ``position`` in their prompts, ``seconds`` long."""
        if self._led or decodes <= 0 or seconds <= 0:
            return
        if prompt_tokens == 0:
            old = self._decode_s.get(decodes)
            self._decode_s[decodes] = seconds if old is None else old + _ALPHA * (seconds - old)
            return
        total = decodes + prompt_tokens
        above = bisect.bisect_right(self.sizes, total)
        # Up one bucket at most: the cost per token grows with the chunk (a few rows ride
        # on the decode rows' weight reads; more are compute), so a bigger one is tried
        # before it is trusted.
        up = self.sizes[above] if above < len(self.sizes) else self.cap
        base = self.decode_time(decodes)
        if base is None:  # no decode-only step yet (a burst of prompts): nothing to hold
            self.chunk = float(up - decodes)  # the steps to, so grow a bucket a step
            return
        per_token = max(seconds - base, 1e-3 * base) / prompt_tokens
        fit = (self.ratio - 1) * base / per_token
        self._tried[(decodes, total)] = (seconds / base, position)
        chunk = min(fit, float(up - decodes))
        # A bucket that cost more than the ratio at this point of a prompt or earlier is
        # not tried again for it (each try would be a stall); a fresh prompt may.
        seen = self._tried.get((decodes, up))
        if decodes + int(chunk) >= up and seen and seen[0] > self.ratio and position >= seen[1]:
            chunk = float(up - decodes - 1)
        self.chunk = max(1.0, chunk)

    def follow(self, chunk: float) -> None:
        """Takes another pacer's chunk (rank 0's, on a follower) and stops measuring: the
        ranks of one model must schedule alike."""
        self._led = True
        self.chunk = float(chunk)
