"""SchedulerOutput: one step's decisions, and nothing else.

The scheduler decides which sequences run and which token range of each (vLLM v1's
``core/sched/output.py`` is the model); it builds no device input. The input builder
(:mod:`jax_kvcached.engine.input_builder`) turns these decisions into the packed batch.
"""

from __future__ import annotations

import dataclasses

from jax_kvcached.engine.sequence import Sequence


@dataclasses.dataclass(slots=True)
class Scheduled:
    """One sequence in a step: its tokens ``start .. start + num_tokens - 1`` are
    computed. A range that reaches past the tokens the host has is a decode row whose
    input token the step in flight samples (``seq.last_row``)."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def fed_by_device(self) -> bool:
        """Its input token is still being sampled on the device."""
        return self.end > len(self.seq.token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: the sequences that run, in row order, and the requests rejected
    while planning it (they can never fit; each with its error)."""

    scheduled: list[Scheduled]
    rejected: list[Sequence] = dataclasses.field(default_factory=list)
    num_decodes: int = 0  # the first rows that decode (one token each)

    @property
    def sequences(self) -> list[Sequence]:
        return [x.seq for x in self.scheduled]
