"""StepResult: what the runner returns for a dispatched step (vLLM's
``ModelRunnerOutput``), every field still on the device: nothing is waited for."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class StepResult:
    logits: jax.Array  # (logit_rows, vocab): the logits of the first sequence slots
    tokens: jax.Array  # (max_rows,): each row's sampled next token (padding past the batch)
    logprobs: Any = None  # log-probabilities (token, top ids, top values), when asked for
    scores: jax.Array | None = None  # the targets' scores, when the step has targets
    fence: Any = None  # later work ordered after this step (frees wait for it)
