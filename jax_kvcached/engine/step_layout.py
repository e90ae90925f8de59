"""StepLayout: the named segments of a step's one packed int32 input.

A step's integer inputs travel to the device as one array (one transfer). The layout
names each segment and its shape; the input builder packs by name
(:meth:`StepLayout.pack`) and the step program slices by name (:meth:`StepLayout.unpack`),
so the two cannot disagree on an order or a size. Float sampling parameters travel as
their int32 bit patterns (the builder views them, the sampler views them back).

Segments (``t`` tokens, ``S`` sequence slots, ``nb`` block-table width, ``G`` KV cache
groups, ``I`` attention items of ``Q`` rows, ``R`` logit rows):

======================  ==============  ===================================================
name                    shape           what
======================  ==============  ===================================================
``tokens``              (t,)            the new tokens on the step's flat axis
``positions``           (t,)            their positions in their sequences
``slots``               (G, t)          each group's cache slot of each token (-1: none)
``targets``             (t,)            prompt log-probability targets (-1: not wanted)
``token_slot``          (t,)            where each token's output lies among the items'
``tables``              (G, S, nb)      each group's block table of each sequence slot
``kv_lens``             (S,)            tokens in the cache after the step, per slot
``q_start``, ``q_lens`` (S,)            each slot's first row and row count
``src``                 (S,)            row of the previous step's samples feeding it (-1)
``last``                (S,)            each slot's last row (its logits)
``item_seq``            (I,)            each attention item's sequence slot
``item_rows``           (I, Q)          the flat rows of each item's queries
``item_pos``            (I, Q)          their positions (-1: none)
``params``              (5, R)          sampling parameters of the logit rows
``flags``               (1,)            :data:`SAMPLE` / :data:`LOGPROBS`
``state_blocks``        (3, S, nS)      a recurrent group's state slots per sequence slot:
                                        read from, written to, checkpointed to (0: none)
``state_rows``          (2, S)          starts from a zero state (1/0); the step's tokens
                                        before its checkpoint (-1: none)
``lora``                (t,) or (0,)    each token's LoRA adapter slot (0: the base alone;
                                        empty in an engine without adapters)
======================  ==============  ===================================================

``nS`` is the blocks of one state slot (0 without a recurrent group:
:mod:`jax_kvcached.engine.recurrent`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

SAMPLE = 1  # flag: sample every row's next token inside the step
LOGPROBS = 2  # flag: and the sampled tokens' log-probabilities
NUM_PARAMS = 5  # sampling parameters per row (see sampler_programs.sample_rows)

SEGMENTS = ("tokens", "positions", "slots", "targets", "token_slot", "tables", "kv_lens",
            "q_start", "q_lens", "src", "last", "item_seq", "item_rows", "item_pos", "params",
            "flags", "state_blocks", "state_rows", "lora")  # fmt: skip


def logit_rows(t: int, max_rows: int) -> int:
    """The rows of a ``t``-token step's logits: ``t`` rounded up to a power of two, at
    most ``max_rows`` (a power of two). A step's sequences are never more than its
    tokens, so every row that samples fits, and the row counts are the sampler sizes."""
    return min(max_rows, 1 << (t - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The packed input of one step shape (see the module docstring)."""

    tokens: int  # t
    seqs: int  # S: the step's sequence slots (max_rows)
    width: int  # nb: block-table width
    items: int  # I (0: the host attention call, which takes no items)
    tile: int  # Q
    groups: int = 1  # G
    slot_blocks: int = 0  # nS: blocks of a recurrent state slot (0: no recurrent group)
    lora: bool = False  # each token's adapter slot travels (an engine with adapters)

    @property
    def rows(self) -> int:
        """The step's logit rows (:func:`logit_rows`)."""
        return logit_rows(self.tokens, self.seqs)

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        t, s, g = self.tokens, self.seqs, self.groups
        return {
            "tokens": (t,), "positions": (t,), "slots": (g, t), "targets": (t,),
            "token_slot": (t,), "tables": (g, s, self.width), "kv_lens": (s,), "q_start": (s,),
            "q_lens": (s,), "src": (s,), "last": (s,), "item_seq": (self.items,),
            "item_rows": (self.items, self.tile), "item_pos": (self.items, self.tile),
            "params": (NUM_PARAMS, self.rows), "flags": (1,),
            "state_blocks": (3, s, self.slot_blocks), "state_rows": (2, s),
            "lora": (t if self.lora else 0,),
        }  # fmt: skip

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """Each segment's ``(start, end)`` in the packed array."""
        out, at = {}, 0
        for name in SEGMENTS:
            n = math.prod(self.shapes[name])
            out[name] = (at, at + n)
            at += n
        return out

    @functools.cached_property
    def _names(self) -> frozenset[str]:
        return frozenset(SEGMENTS)

    @property
    def size(self) -> int:
        """The packed array's length."""
        return self.offsets[SEGMENTS[-1]][1]

    def pack(self, **segments: Any) -> np.ndarray:
        """The packed int32 array of every segment, given by name with its exact shape
        (ValueError on a missing, unknown or misshapen one)."""
        if segments.keys() != self._names:
            missing, extra = set(SEGMENTS) - set(segments), set(segments) - set(SEGMENTS)
            raise ValueError(f"step segments missing {sorted(missing)}, unknown {sorted(extra)}")
        arrays = [np.asarray(segments[n]) for n in SEGMENTS]
        for name, a in zip(SEGMENTS, arrays, strict=True):
            if a.shape != self.shapes[name]:
                raise ValueError(f"step segment {name!r} has shape {a.shape}, "
                                 f"the layout's is {self.shapes[name]}")  # fmt: skip
        try:  # (same-kind casting: floats travel as their bit patterns, a view, never a cast)
            return np.concatenate([a.ravel() for a in arrays], dtype=np.int32,
                                  casting="same_kind")  # fmt: skip
        except TypeError as e:
            raise ValueError(f"a step segment is not integers: {e}") from None

    def unpack(self, packed: Any) -> dict[str, Any]:
        """Each segment of a packed array (numpy or traced), by name, in its shape."""
        if packed.shape != (self.size,):
            raise ValueError(f"a packed step input of {packed.shape}, the layout's is {self.size}")
        return {
            name: packed[lo:hi].reshape(self.shapes[name])
            for name, (lo, hi) in self.offsets.items()
        }
