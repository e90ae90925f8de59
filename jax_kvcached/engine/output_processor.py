"""The output processor: a completed step's tokens become request outputs.

Per sampling row of a dispatched step (:class:`PendingStep`) it accepts the token (the
host's token list grows; a block that held it can join the prefix cache), attaches its
log-probabilities, feeds stop strings, decides whether the request stops (a stop token,
EOS unless ignored, a stop string, ``max_tokens``, the context) and streams it; prompt
log-probabilities are stored by position. It mutates only the sequences of the step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from jax_kvcached.engine.sequence import Sequence as Seq


def alternatives(ids: Any, logprobs: Any, k: int) -> list[tuple[int, float]]:
    """The first ``k`` (id, log-probability) pairs of a row of top-k ids and values."""
    return [(int(i), float(v)) for i, v in zip(ids[:k], logprobs[:k], strict=True)]


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose sampled tokens may still be computing."""

    sequences: list[Seq]  # the sequences that sample a token, in order
    tokens: Any  # device array of the step's sampled tokens, or None
    rows: list[int] = dataclasses.field(default_factory=list)  # their rows in ``tokens``
    logprobs: Any = None  # device arrays of the sampled tokens' log-probabilities
    # Prompt log-probabilities: device array (1 + 2K, tokens) and (sequence, first column
    # on the step's token axis, start, n).
    scores: Any = None
    scored: list[tuple[Seq, int, int, int]] = dataclasses.field(default_factory=list)
    decodes: int = 0  # decode rows (one token each)
    prompt_tokens: int = 0  # the step's other tokens (prompt chunks)
    position: int = 0  # the furthest prompt position they reach
    started: float = 0.0  # perf_counter() when it was scheduled
    ready: float | None = None  # perf_counter() when its tokens reached the host
    # A step with structured rows samples once its masks are known (the engine calls it
    # when every older step has completed); None: sampled already.
    sample_later: Callable[[], None] | None = None


class OutputProcessor:
    """Turns completed steps into tokens, log-probabilities and finished requests.

    Args:
      fetch: a device array on the host (waits for it).
      eos_ids: the model's end-of-sequence ids.
      max_model_len: the context bound (a request that reaches it stops).
      accepted: called with a sequence whose pending token arrived (the KV manager may
        cache the block it completes).
      finish: ends a sequence with a reason (the scheduler releases its blocks).
      check_device: raises a device-side error of the step (a host sync point).
    """

    def __init__(
        self,
        fetch: Callable[[Any], Any],
        eos_ids: Sequence[int],
        max_model_len: int,
        accepted: Callable[[Seq], None],
        finish: Callable[[Seq, str], None],
        check_device: Callable[[], None],
    ) -> None:
        self._fetch = fetch
        self._eos = frozenset(eos_ids)
        self._max_model_len = max_model_len
        self._accepted = accepted
        self._finish = finish
        self._check_device = check_device

    def process(self, step: PendingStep) -> list[Seq]:
        """Takes a step's results; returns the sequences it finished."""
        if step.scores is not None:
            self._take_scores(step)
        if step.tokens is None:
            return []
        host = self._fetch(step.tokens)
        lps = None
        if step.logprobs is not None:
            lps = [self._fetch(a) for a in step.logprobs]
        self._check_device()
        now = step.ready = time.perf_counter()
        done = []
        for s, row in zip(step.sequences, step.rows, strict=True):
            s.num_pending -= 1
            if s.finish_reason is not None:  # aborted or finished while in flight
                continue
            tok = int(host[row])
            s.token_ids.append(tok)
            if s.logprobs is not None and lps is not None:
                top = alternatives(lps[1][row], lps[2][row], s.params.logprobs)
                s.logprobs.append((float(lps[0][row]), top))
                if s.on_logprobs is not None:
                    s.on_logprobs(s.request_id, s.logprobs[-1])
            if s.first_token_time is None:
                s.first_token_time = now
            if s.blocks:  # a block that held this pending token can be cached now
                self._accepted(s)
            if s.detok is not None:
                s.detok.feed(tok)
            if s.grammar is not None and not s.grammar.accept(tok):
                s.error = RuntimeError(f"the structured output refused token {tok} that its "
                                       f"mask allowed: {s.grammar.error}")  # fmt: skip
            reason = "error" if s.error is not None else self._stop_reason(s, tok)
            if reason:
                self._finish(s, reason)
                done.append(s)
            if s.on_token is not None:
                s.on_token(s.request_id, tok, reason is not None)
        return done

    def _stop_reason(self, s: Seq, tok: int) -> str | None:
        """Why a sequence stops at its newest token ``tok`` (None: it goes on)."""
        if tok in s.params.stop_token_ids or (tok in self._eos and not s.params.ignore_eos):
            return "stop"
        if s.detok is not None and s.detok.stopped:
            return "stop"
        if s.grammar is not None and s.grammar.finished:  # the structure is complete
            return "stop"
        if len(s.token_ids) - s.num_prompt >= s.params.max_tokens:
            return "length"
        if len(s.token_ids) >= self._max_model_len:
            return "length"
        return None

    def _take_scores(self, step: PendingStep) -> None:
        """Stores the prompt log-probabilities a step computed (by position: a
        recomputation after preemption writes the same entries)."""
        scores = self._fetch(step.scores)
        top = (scores.shape[0] - 1) // 2
        for s, first, start, n in step.scored:
            k = s.params.logprobs or 0
            for j in range(n):
                pos = start + 1 + j  # the token this position's logits predict
                if pos < s.num_prompt:
                    col = scores[:, first + j]
                    alts = alternatives(col[1 : 1 + top], col[1 + top :], k)
                    s.prompt_logprobs[pos] = (float(col[0]), alts)
