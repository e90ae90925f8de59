"""The input builder: a step's decisions become its packed device input, in one place.

vLLM's ``gpu_model_runner._prepare_inputs`` is the model. :meth:`InputBuilder.prepare`
takes the scheduler's :class:`~jax_kvcached.engine.sched_output.SchedulerOutput` and
decides per row what the step does besides computing K/V: whether it samples (its range
reaches the end of its sequence), its logit-processing entries (penalties, biases) and
its prompt log-probability targets. :meth:`InputBuilder.build` lays the rows on the
step's flat token axis and packs tokens, positions, each KV cache group's tables and
slots, the ragged layout, the sampling rows and the flags by name
(:class:`~jax_kvcached.engine.step_layout.StepLayout`). Neither mutates a sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_kvcached.engine.attention import ragged_layout
from jax_kvcached.engine.logit_inputs import Entries, pack_rows, row_entries
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sched_output import SchedulerOutput
from jax_kvcached.engine.sequence import Sequence as Seq
from jax_kvcached.engine.step_layout import LOGPROBS, SAMPLE, StepLayout
from jax_kvcached.engine.step_shapes import StepShapes

_GREEDY = SamplingParams(seed=0)


@dataclasses.dataclass
class StepInput:
    """One row of a step: a sequence's new tokens and what the step does with them."""

    tokens: list[int]  # the new tokens
    start: int  # tokens of this sequence already in the cache (their positions come first)
    blocks: list[int]  # the sequence's block table; covers start + len(tokens) tokens
    # The block tables of KV cache groups 1.. (a cache of several groups), as ``blocks``.
    group_tables: tuple[list[int], ...] = ()
    # >= 0: the (single) token is the one row ``src`` of the previous step samples.
    src: int = -1
    params: SamplingParams | None = None  # this row samples its next token (None: not)
    sample_step: int = 0  # tokens the request generated before this one (its draw's key)
    # Logit processing of this row (params.processes_logits): token ids (P,) and their
    # weights (3, P): times generated, in the prompt, additive bias (see process_logits).
    entries: Entries | None = None
    # Prompt log-probabilities: the token after each new token (-1: none wanted).
    targets: list[int] | None = None
    # A recurrent group's state slot: (blocks read, blocks written, checkpoint blocks,
    # tokens before the checkpoint or -1); read from zeros when ``start`` is 0.
    state: tuple[list[int], list[int], list[int], int] | None = None
    # A structured output samples here: its mask waits for its previous token.
    constrained: bool = False
    adapter: int = 0  # the LoRA adapter slot of its tokens (0: the base model alone)


@dataclasses.dataclass
class PreparedStep:
    """A step ready to run: its shape, packed input and what runs behind it."""

    shape: tuple[int, int]
    packed: np.ndarray
    num_rows: int  # rows of the batch (sequences)
    logit_rows: int  # rows of the step's logits (>= num_rows)
    params: np.ndarray  # (NUM_PARAMS, logit_rows): the sampler's parameters
    src: np.ndarray  # (num_rows,): each row's feeding row of the previous step (-1)
    processing: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # logit processing
    want_logprobs: bool  # a sampling row asks for its tokens' log-probabilities
    fused: bool  # the step program samples (flags set)
    has_targets: bool  # a row asks for prompt log-probabilities
    starts: list[int]  # each row's first token on the step's flat axis
    # From a SchedulerOutput: the sequences that sample and their rows, and the rows
    # scored for prompt log-probabilities as (sequence, first column, start, count).
    sampling: list[tuple[Seq, int]] = dataclasses.field(default_factory=list)
    scored: list[tuple[Seq, int, int, int]] = dataclasses.field(default_factory=list)
    # Rows of structured outputs: the step runs its forward pass, and samples once
    # their masks are known (the previous step's tokens taken: ModelRunner.sample).
    deferred: bool = False
    grammar_rows: list[tuple[Seq, int]] = dataclasses.field(default_factory=list)


class InputBuilder:
    """Builds the steps of one runner.

    Args:
      shapes: the runner's step shapes (buckets, slots, layouts).
      groups: the KV cache's groups (``cache.groups``): writes are checked against them.
      entry_sizes: the widths of the logit-processing token lists.
      fused: whether a step of ``t`` tokens samples inside its program.
      eos_ids: the model's end-of-sequence ids (banned before ``min_tokens``).
      state_group: the recurrent group's index (None: none); its table is a state slot.
    """

    def __init__(
        self,
        shapes: StepShapes,
        groups: Sequence[Any],
        entry_sizes: tuple[int, ...],
        fused: Callable[[int], bool],
        eos_ids: Sequence[int],
        state_group: int | None = None,
    ) -> None:
        self.shapes = shapes
        self.state_group = state_group
        self.groups = tuple(groups)
        self.entry_sizes = entry_sizes
        self.fused = fused
        self.eos_ids = tuple(eos_ids)

    def rows(self, out: SchedulerOutput) -> tuple[list[StepInput], list[tuple[Seq, int]], list]:
        """The rows of a scheduled step, the sequences that sample (with their rows) and
        the rows scored for prompt log-probabilities (sequence, row, start, count)."""
        inputs: list[StepInput] = []
        sampling: list[tuple[Seq, int]] = []
        scored: list[tuple[Seq, int, int, int]] = []
        for i, x in enumerate(out.scheduled):
            s, start, n = x.seq, x.start, x.num_tokens
            end, known = start + n, len(s.token_ids)
            # (the tables as they are: build() copies them into the packed input at once)
            first, more = s.tables[0], tuple(s.tables[1:])
            state = None
            if self.state_group is not None:
                dst = s.tables[self.state_group]
                ck, at = [], -1
                if s.state_ck is not None and start < s.state_ck[1] <= end:
                    ck, at = s.state_ck[0], s.state_ck[1] - start
                state = (s.state_src or dst, dst, ck, at)
            if end > known:  # a decode row on the token the in-flight step samples
                assert n == 1 and start == known and s.last_row >= 0, "one token in flight"
                row = StepInput([0], start, first, more, src=s.last_row)
            else:
                row = StepInput(s.token_ids[start:end], start, first, more)
            row.state = state
            row.adapter = s.adapter_slot
            if end == known + s.num_pending:  # it reaches the end of its sequence: it samples
                row.params, row.sample_step = s.params, s.num_output
                if s.params.processes_logits:
                    row.entries = row_entries(
                        s.params, s.prompt, s.output, s.num_output, self.eos_ids
                    )
                row.constrained = s.grammar is not None
                sampling.append((s, i))
            if s.params.prompt_logprobs and start < s.num_prompt and n > 1:
                # each position's target: the next prompt token (-1 past the prompt)
                want = s.token_ids[start + 1 : min(start + n + 1, s.num_prompt)]
                row.targets = want + [-1] * (n - len(want))
                scored.append((s, i, start, n))
            inputs.append(row)
        return inputs, sampling, scored

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """The packed step of the scheduler's decisions."""
        inputs, sampling, scored = self.rows(out)
        step = self.build(inputs)
        step.sampling = sampling
        step.grammar_rows = [(s, i) for s, i in sampling if s.grammar is not None]
        step.scored = [(s, step.starts[i], start, n) for s, i, start, n in scored]
        return step

    def build(self, batch: list[StepInput]) -> PreparedStep:
        """The packed step of ``batch`` (ValueError on rows that do not fit the runner
        or its cache; a write outside a row's allocated blocks is refused here)."""
        if not batch:
            raise ValueError("empty batch")
        shapes, bsz = self.shapes, self.shapes.block_size
        shape = shapes.of([(x.start, len(x.tokens)) for x in batch])
        lay: StepLayout = shapes.layout(shape)
        t, nb, rows, ng, max_rows = lay.tokens, lay.width, lay.rows, lay.groups, lay.seqs
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full((ng, t), -1, np.int32)
        targets = np.full(t, -1, np.int32)
        tables = np.zeros((ng, max_rows, nb), np.int32)
        src = np.full(max_rows, -1, np.int32)
        last = np.zeros(max_rows, np.int32)
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        steps = np.zeros(rows, np.int32)
        written: list[set[int]] = [set() for _ in range(ng)]
        ns = lay.slot_blocks
        state_blocks = np.zeros((3, max_rows, ns), np.int32)
        state_rows = np.zeros((2, max_rows), np.int32)
        state_rows[1] = -1
        lora = np.zeros(lay.shapes["lora"], np.int32)
        sg = self.state_group
        at = 0
        starts: list[int] = []
        for i, x in enumerate(batch):
            n = len(x.tokens)
            group_tables = (x.blocks, *x.group_tables)
            if len(group_tables) != ng:
                raise ValueError(f"a step input needs {ng} block tables (one per KV cache group)")
            if n == 0 or any(len(b) * bsz < x.start + n for g, b in enumerate(group_tables)
                             if g != sg):  # fmt: skip
                raise ValueError("a step input needs tokens and blocks covering them")
            if sg is not None:
                if x.state is None or any(len(b) != ns for b in x.state[:2]):
                    raise ValueError(f"a step input needs a state slot of {ns} blocks")
                read, dst, ck, ck_at = x.state
                state_blocks[0, i], state_blocks[1, i] = read, dst
                state_rows[0, i] = x.start == 0
                written[sg].update(dst)
                if ck_at > 0:
                    if len(ck) != ns or ck_at > n:
                        raise ValueError(f"a bad state checkpoint {ck} after {ck_at} tokens")
                    state_blocks[2, i], state_rows[1, i] = ck, ck_at
                    written[sg].update(ck)
            if x.src >= max_rows or (x.src >= 0 and n != 1):
                raise ValueError(f"bad src row {x.src} for a step of {n} tokens")
            used = -(-(x.start + n) // bsz)
            if n == 1:  # a decode row: plain ints (numpy's per-call cost dominates here)
                tokens[at], positions[at] = x.tokens[0], x.start
                b, off = divmod(x.start, bsz)
                for g, blocks in enumerate(group_tables):
                    if g == sg:
                        continue
                    tables[g, i, :used] = blocks[:used]
                    slots[g, at] = blocks[b] * bsz + off
                    written[g].add(blocks[b])
            else:
                tokens[at : at + n] = x.tokens
                pos = np.arange(x.start, x.start + n)
                positions[at : at + n] = pos
                for g, blocks in enumerate(group_tables):
                    if g == sg:
                        continue
                    tables[g, i, :used] = blocks[:used]
                    blk = np.asarray(blocks, np.int64)[pos // bsz]
                    slots[g, at : at + n] = blk * bsz + pos % bsz
                    written[g].update(blocks[pos[0] // bsz : pos[-1] // bsz + 1])
            src[i], last[i] = x.src, at + n - 1
            p = x.params or _GREEDY
            temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            seeds[i], steps[i] = p.seed or 0, x.sample_step
            if x.targets is not None:
                targets[at : at + n] = x.targets
            if x.adapter:
                if not lay.lora:
                    raise ValueError("a step input names a LoRA adapter; this runner has none")
                lora[at : at + n] = x.adapter
            starts.append(at)
            at += n
        for group, blocks in zip(self.groups, written, strict=True):
            group.check_writable(blocks)
        ragged = ragged_layout([len(x.tokens) for x in batch],
                               [x.start + len(x.tokens) for x in batch], tables[0], t,
                               shapes.tile(t))  # fmt: skip
        params = np.stack(
            [temperature.view(np.int32), top_k, top_p.view(np.int32), seeds.view(np.int32), steps]
        )
        processing = pack_rows(
            [(x.entries, x.params) if x.entries is not None else None for x in batch],
            rows, self.entry_sizes,
        )  # fmt: skip
        want_logprobs = any(x.params is not None and x.params.logprobs is not None for x in batch)
        deferred = any(x.constrained for x in batch)
        # A fused step samples (and scores) its rows itself, unless a row processes its
        # logits or masks them; otherwise (processing, masking,) sampling and
        # log-probabilities follow as programs of their own.
        fused = self.fused(t) and processing is None and not deferred
        flags = (SAMPLE | (LOGPROBS if want_logprobs else 0)) if fused else 0
        packed = lay.pack(
            tokens=tokens, positions=positions, slots=slots, targets=targets,
            token_slot=ragged["token_slot"], tables=tables, kv_lens=ragged["kv_lens"],
            q_start=ragged["q_start"], q_lens=ragged["q_lens"], src=src, last=last,
            item_seq=ragged["item_seq"], item_rows=ragged["item_rows"],
            item_pos=ragged["item_pos"], params=params, flags=np.asarray([flags], np.int32),
            state_blocks=state_blocks, state_rows=state_rows, lora=lora,
        )  # fmt: skip
        return PreparedStep(
            shape=shape, packed=packed, num_rows=len(batch), logit_rows=rows, params=params,
            src=src[: len(batch)], processing=processing, want_logprobs=want_logprobs,
            fused=fused, has_targets=bool((targets >= 0).any()), starts=starts,
            deferred=deferred,
        )  # fmt: skip
