"""StepShapes: the bounded set of shapes a step can take, and the budgets behind it.

A step takes up to ``max_num_batched_tokens`` new tokens (``max_prefill_tokens`` when no
sequence decodes) from up to ``max_batch`` sequences laid out on one flat token axis.
Its shape is (token bucket, block-table width bucket): token counts in powers of two up
to the budget (and multiples of :data:`TOKEN_STEP` below it), times block-table widths
(one width for attention that walks only the context: the host custom call and the
Pallas kernel). No batch x chunk product: the sequence slots are fixed (``max_rows``, a
power of two). Each shape's packed input is a :class:`StepLayout`.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_kvcached.engine.attention import num_items
from jax_kvcached.engine.config import check_budgets
from jax_kvcached.engine.step_layout import StepLayout

TOKEN_STEP = 16  # token buckets between the powers of two come in multiples of this
_WALKS_CONTEXT = ("host", "pallas", "pallas-interpret")  # cost independent of the width


def default_token_budget(backend: str) -> int:
    """The default ``max_num_batched_tokens`` (the most new tokens of a step while any
    sequence decodes): 64 on a CPU, 2048 on a GPU (a step's cost there hardly grows
    below that)."""
    return 2048 if backend == "cuda" else 64


def default_prefill_budget(backend: str, budget: int) -> int:
    """The default ``max_prefill_tokens`` (the budget of a step with no decode rows: no
    stream waits for it, so bigger chunks prefill faster): 256 on a CPU, else the step
    budget; never below it."""
    return budget if backend == "cuda" else max(budget, 256)


def ladder(lo: int, hi: int, multiple: int = 1, ratio: float = 1.25) -> tuple[int, ...]:
    """Bucket sizes from ``lo`` to ``hi`` (both included): each step adds ``multiple`` or
    grows by at most ``ratio`` (rounded down to a multiple), whichever is larger."""
    if hi < lo:
        return (hi,)
    out = [lo]
    while out[-1] < hi:
        v = out[-1]
        out.append(min(hi, max(v + multiple, int(v * ratio) // multiple * multiple)))
    return tuple(out)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` (ascending) >= n."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


class StepShapes:
    """The shapes of one runner's steps.

    Args:
      backend: the cache's backend (``host`` or ``cuda``): the default budgets.
      attention: the resolved attention (``host``, ``xla``, ``pallas``,
        ``pallas-interpret``): the widths and the items' tile.
      max_batch / max_num_batched_tokens / max_prefill_tokens: the step's bounds (None:
        the backend's defaults; positive, see
        :class:`~jax_kvcached.engine.config.EngineConfig`).
      max_blocks: the widest block table (``max_model_len`` in blocks).
      block_size: tokens per block.
      groups: KV cache groups (block tables per sequence).
      query_per_kv: query heads per KV head (the Pallas kernel's tile).
      slot_blocks: blocks of a recurrent group's state slot (0: none).
      lora: a step carries each token's LoRA adapter slot.
    """

    def __init__(
        self,
        backend: str,
        attention: str,
        *,
        max_batch: int,
        max_num_batched_tokens: int | None,
        max_prefill_tokens: int | None,
        max_blocks: int,
        block_size: int,
        groups: int = 1,
        query_per_kv: int = 1,
        slot_blocks: int = 0,
        lora: bool = False,
    ) -> None:
        budget = max_num_batched_tokens or default_token_budget(backend)
        # A budget given caps every step unless max_prefill_tokens says otherwise.
        prefill = max_prefill_tokens or (
            budget if max_num_batched_tokens else default_prefill_budget(backend, budget)
        )
        check_budgets(max_batch, budget, prefill)  # (the defaults, against a given batch)
        self.attention = attention
        self.block_size = block_size
        self.groups = groups
        self.slot_blocks = slot_blocks
        self.lora = lora
        self.query_per_kv = query_per_kv
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.max_num_batched_tokens = budget
        self.max_prefill_tokens = prefill
        # Samplers come in powers of two (their rows: the step's sequences): few compiles.
        self.sampler_sizes = tuple(1 << i for i in range((max_batch - 1).bit_length() + 1))
        self.max_rows = self.sampler_sizes[-1]  # the step's sequence slots
        # Token counts: powers of two, multiples of 16 up to the decode-time budget, and
        # the two budgets themselves.
        self.token_sizes = tuple(sorted({1 << i for i in range(prefill.bit_length())
                                         if (1 << i) < prefill}
                                        | set(range(TOKEN_STEP, budget, TOKEN_STEP))
                                        | {budget, prefill}))  # fmt: skip
        # On a CPU, unless the caller fixed the budget, a step with decode rows takes the
        # prompt chunk its measured cost allows (engine.step_pacer), within the budget.
        self.paced = max_num_batched_tokens is None and backend != "cuda"
        self._layouts: dict[tuple[int, int], StepLayout] = {}
        top = -(-max_blocks // 8) * 8
        self.widths = (top,) if attention in _WALKS_CONTEXT else ladder(8, top, 8, 2.0)

    def tile(self, t: int) -> int:
        """Query rows per attention item in a step of ``t`` tokens (0: the host call,
        which takes the layout without items). One row per item when the step can only
        be decode rows; else the most a Pallas program holds, or t / 8 for XLA."""
        if self.attention == "host":
            return 0
        if t <= self.max_rows:
            return 1
        if self.attention in ("pallas", "pallas-interpret"):
            from jax_kvcached.engine.pallas_attention import item_tile

            return item_tile(self.query_per_kv)
        return min(64, max(8, 1 << ((t // 8).bit_length() - 1)))

    def items(self, t: int) -> tuple[int, int]:
        """(attention items, their tile) of a step of ``t`` tokens."""
        tile = self.tile(t)
        return (0, 1) if tile == 0 else (num_items(t, self.max_rows, tile), tile)

    def layout(self, shape: tuple[int, int]) -> StepLayout:
        """The packed input of a step shape ``(tokens, width)`` (made once per shape: its
        offsets are computed once, not every step)."""
        lay = self._layouts.get(shape)
        if lay is None:
            t, nb = shape
            items, tile = self.items(t)
            lay = self._layouts[shape] = StepLayout(t, self.max_rows, nb, items, tile,
                                                    self.groups, self.slot_blocks,
                                                    self.lora)  # fmt: skip
        return lay

    def all(self) -> list[tuple[int, int]]:
        """Every (tokens, block-table width) a step can take."""
        return [(t, nb) for t in self.token_sizes for nb in self.widths]

    def of(self, lengths: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """The shape of a step whose sequences have ``(start, new tokens)`` each;
        ValueError when it exceeds the bounds."""
        total = sum(n for _, n in lengths)
        width = max(-(-(start + n) // self.block_size) for start, n in lengths)
        if len(lengths) > self.max_batch:
            raise ValueError(
                f"a step of {len(lengths)} sequences exceeds the runner's max_batch "
                f"{self.max_batch}"
            )
        if total > self.max_prefill_tokens:
            raise ValueError(
                f"a step of {total} new tokens exceeds the runner's max_prefill_tokens "
                f"{self.max_prefill_tokens}"
            )
        if width > self.max_blocks:
            raise ValueError(
                f"a context of {width} blocks exceeds the runner's max_model_len "
                f"({self.max_blocks} blocks)"
            )
        return bucket(total, self.token_sizes), bucket(width, self.widths)
