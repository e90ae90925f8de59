"""ModelRunner: one compiled step of a Flax model over a paged KV cache, on a ragged batch.

A step takes up to ``max_num_batched_tokens`` new tokens (``max_prefill_tokens`` when no
sequence decodes) from up to ``max_batch`` sequences laid out on one flat token axis:
decode rows (one token) and prefill chunks alike, each sequence with its own cached length
and block table (:mod:`jax_kvcached.engine.attention`). The step program
(:mod:`jax_kvcached.engine.step_program`) writes each layer's K/V into the cache and
attends over it; a decode-sized step also samples every sequence's next token (one
dispatch per step; default on CUDA), other steps dispatch the sampler behind. Every
integer input travels as one packed array (one transfer). A decode row whose input token
is still being sampled by the previous step takes it from that step's device output
(``StepInput.src``), so the host never waits for a step before preparing the next one.
On CUDA the programs compile as command buffers (:func:`compiler_options`).

Shapes come from a fixed, bounded set (:meth:`ModelRunner.step_shapes`): token counts in
powers of two up to the budget, times block-table widths (one width for attention that
walks only the context: the host custom call and the Pallas kernel). No batch x chunk
product: the sequence slots are fixed. Each shape is compiled once, ahead of time
(:meth:`ModelRunner.compile`), and counted.

Over a cache split across a mesh (tensor parallelism) the model's parameters are placed by
its plan (:func:`jax_kvcached.models.shard_model`), the paged attention and the KV write
run per device under ``jax.shard_map`` (each device over its KV heads, in its own buffer),
and the logits come back replicated: the host side is unchanged.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_kvcached.engine import executables
from jax_kvcached.engine.attention import num_items, ragged_layout
from jax_kvcached.engine.compile_events import compile_events, thread_cache_hits
from jax_kvcached.engine.launches import Launches, count_launches
from jax_kvcached.engine.logit_inputs import Entries, entry_sizes, pack_rows
from jax_kvcached.engine.sampler_programs import sampler_programs
from jax_kvcached.engine.sampling import NUM_CANDIDATES, SamplingParams
from jax_kvcached.engine.sleep import Offloaded, offload, restore
from jax_kvcached.engine.step_program import (
    LOGPROBS,
    NUM_PARAMS,
    SAMPLE,
    StepSpec,
    logit_rows,
    make_step,
    packed_sizes,
)
from jax_kvcached.memory import ops
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.models.sharding import shard_model
from jax_kvcached.models.stack import LayerList, stacked_leaves

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "host", "xla", "pallas", "pallas-interpret")


def resolve_attention(impl: str, cache: KVCache) -> str:
    """Validates an attention choice for ``cache``; ``auto`` becomes the Pallas kernel for
    a CUDA cache and the host custom call for a host cache."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if cache.backend == "cuda" else "host"
    if impl == "host" and cache.backend != "host":
        raise ValueError("attention='host' needs a host-backend cache")
    return impl


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


# XLA's default command-buffer commands plus conditionals and loops: the step's branches
# (sampling, log-probabilities, prompt scores) and its scanned layers then run inside the
# CUDA graph. A conditional outside one copies its predicate to the host and waits for
# the device: a host sync in every step.
COMMAND_BUFFER_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"


def compiler_options(backend: str, command_buffers: bool | None = None) -> dict[str, str]:
    """The XLA options the runner compiles its programs with. On CUDA the step runs as
    command buffers (CUDA graphs: one launch replays a step's kernels) of
    :data:`COMMAND_BUFFER_COMMANDS`; ``False`` turns them off; ``None`` (default): on,
    unless ``XLA_FLAGS`` sets ``--xla_gpu_enable_command_buffer`` (that choice is kept).
    A CPU has no command buffers: no options."""
    if backend != "cuda":
        return {}
    if command_buffers is None:
        if "xla_gpu_enable_command_buffer" in os.environ.get("XLA_FLAGS", ""):
            return {}
        command_buffers = True
    return {"xla_gpu_enable_command_buffer": COMMAND_BUFFER_COMMANDS if command_buffers else ""}


TOKEN_STEP = 16  # a CPU step's budget beside decode rows comes in multiples of this


def cpu_decode_budget(decodes: int) -> int:
    """On a CPU, the tokens of a step that holds ``decodes`` decode rows: 16 + 4 per row,
    rounded down to a multiple of 16. A decode step of SmolLM2-135M costs about
    25 ms + 4 ms a row and a prompt token about 2 ms, so the prompt chunk added to it keeps
    the step within about 2.5x the decode step it joins (one stream: 15 prompt tokens);
    more rows buy bigger chunks, so prompts still prefill quickly under load."""
    return max(TOKEN_STEP, (TOKEN_STEP + 4 * decodes) // TOKEN_STEP * TOKEN_STEP)


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


@dataclasses.dataclass
class StepInput:
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


_GREEDY = SamplingParams(seed=0)
_WALKS_CONTEXT = ("host", "pallas", "pallas-interpret")  # cost independent of the width


def src_rows(src: np.ndarray, rows: int) -> np.ndarray:
    """``src`` padded to the sampler's rows (-1: the row's input was not fed)."""
    out = np.full(rows, -1, np.int32)
    out[: len(src)] = src
    return out


class ModelRunner:
    """``attention``: ``auto`` (the Pallas kernel for a CUDA cache, the host custom call
    for a host cache), ``host``, ``xla``, ``pallas`` or ``pallas-interpret``.

    Steps of at most ``max_batch`` sequences and ``max_num_batched_tokens`` new tokens in
    all (default: :func:`default_token_budget`), or ``max_prefill_tokens`` when no row
    decodes (default: :func:`default_prefill_budget`), contexts up to ``max_model_len``
    tokens: these bound the shape set. ``scan_layers``: run the model's layers under
    ``jax.lax.scan`` (default on a GPU) or unrolled over per-layer weight arrays (default
    on a CPU, where XLA copies every slice of a stacked weight; the runner then holds its
    own per-layer copy of the stacked weights, the model given keeps its arrays).
    ``command_buffers``: see :func:`compiler_options`. ``fuse_sampling``: decode-sized
    steps (at most ``max_batch`` rounded up to a power of two tokens) sample inside the
    step program, one dispatch per step (default on CUDA, where a dispatch is a launch
    floor; on a CPU the sampler compiled into every such step costs more than its
    dispatch saves)."""

    def __init__(
        self,
        model: nnx.Module,
        cache: KVCache,
        attention: str = "auto",
        *,
        max_batch: int = 8,
        max_num_batched_tokens: int | None = None,
        max_prefill_tokens: int | None = None,
        max_model_len: int | None = None,
        num_candidates: int = NUM_CANDIDATES,
        scan_layers: bool | None = None,
        command_buffers: bool | None = None,
        fuse_sampling: bool | None = None,
    ) -> None:
        cfg = model.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError("the KV cache's layers / KV heads / head_dim do not match the model")
        budget = max_num_batched_tokens or default_token_budget(cache.backend)
        if max_batch <= 0 or budget <= 0:
            raise ValueError("max_batch and max_num_batched_tokens must be positive")
        if budget < max_batch:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be at least max_batch ({max_batch}): "
                "every running sequence decodes one token in each step"
            )
        # A budget given caps every step unless max_prefill_tokens says otherwise.
        prefill = max_prefill_tokens or (
            budget if max_num_batched_tokens else default_prefill_budget(cache.backend, budget)
        )
        if prefill < budget:
            raise ValueError(
                f"max_prefill_tokens ({prefill}) must be at least max_num_batched_tokens ({budget})"
            )
        self.config = cfg
        self.cache = cache
        self.attention = resolve_attention(attention, cache)
        self.num_candidates = num_candidates
        self.mesh = cache.mesh
        if self.mesh is not None:
            # A copy placed on the mesh (its arrays shared until placed): the model given
            # stays where it is. ValueError when its heads do not split.
            model = shard_model(nnx.clone(model), self.mesh)
        # Layers under jax.lax.scan on a GPU; unrolled over per-layer weight arrays on a
        # CPU, where XLA copies each slice of a stacked weight before its dot (SmolLM2:
        # 540 MB a step, +13 ms on a 26 ms decode step).
        self.scan_layers = cache.backend == "cuda" if scan_layers is None else scan_layers
        if hasattr(model, "scan_layers"):
            model = nnx.clone(model) if self.mesh is None else model  # (the mesh's a copy)
            model.scan_layers = self.scan_layers
        self.graphdef, state = nnx.split(model)
        # The weights travel as a flat list: flattening an nnx.State on every call costs
        # more host time than the rest of a small step's dispatch. Unrolled, each stacked
        # weight travels as its layers' arrays (see models.stack.LayerList).
        leaves, self._weights_def = jax.tree.flatten(state)
        self._stacked = [f and not self.scan_layers for f in stacked_leaves(state)]
        self._weights = self._expand(leaves)
        # Where the step's small outputs live: the device, or replicated over the mesh.
        self._device = (
            cache.device
            if self.mesh is None
            else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        )
        self.token = ops.new_token(self._device)
        # jit's cache keys on the thread's default device (a context): every step runs
        # under the cache's device, so warm-up in worker threads, a serving thread and a
        # caller inside jax.default_device(...) all hit the same executables.
        self._context = functools.partial(jax.default_device, cache.device)
        max_len = max_model_len or cfg.max_position_embeddings
        bs = cache.block_size
        self.max_blocks = -(-max_len // bs)
        self.max_batch = max_batch
        self.max_num_batched_tokens = budget
        self.max_prefill_tokens = prefill
        # Samplers come in powers of two (their rows: the step's sequences): few compiles.
        self.sampler_sizes = tuple(1 << i for i in range((max_batch - 1).bit_length() + 1))
        self.max_rows = self.sampler_sizes[-1]  # the step's sequence slots
        # Token counts: powers of two, multiples of 16 up to the decode-time budget (a CPU
        # step's budget grows by 16: cpu_decode_budget), and the two budgets themselves.
        self.token_sizes = tuple(sorted({1 << i for i in range(prefill.bit_length())
                                         if (1 << i) < prefill}
                                        | set(range(TOKEN_STEP, budget, TOKEN_STEP))
                                        | {budget, prefill}))  # fmt: skip
        # The budget of a step with decode rows, by their count (None: the fixed budget):
        # scaled on a CPU unless the caller fixed the budget.
        adaptive = max_num_batched_tokens is None and cache.backend != "cuda"
        self.decode_budget = cpu_decode_budget if adaptive else None
        top = -(-self.max_blocks // 8) * 8
        self.widths = (top,) if self.attention in _WALKS_CONTEXT else ladder(8, top, 8, 2.0)
        # Logit processing: token lists of these widths (prompt + output + biases).
        self.entry_sizes = entry_sizes(max_len + 64)
        spec = StepSpec(
            graphdef=self.graphdef, cache=cache, attention=self.attention,
            max_rows=self.max_rows, num_candidates=num_candidates,
            windows=np.asarray(cfg.layer_windows(), np.int32), join=self._join,
            items=self._items, per_device=self._per_device, head_spec=self._head_spec,
            logits_sharding=None if self.mesh is None else self._device,
            fuse=cache.backend == "cuda" if fuse_sampling is None else fuse_sampling,
        )  # fmt: skip
        self.step_spec = spec
        self._jitted = jax.jit(make_step(spec), static_argnums=(4, 5))
        self.compiler_options = compiler_options(cache.backend, command_buffers)
        self.dispatches = 0  # programs dispatched by run_padded (the step and any after it)
        # Every program a step runs, compiled ahead of time (see compile()): key -> a
        # jax Compiled (called with its dynamic arguments), kept in ``store`` on disk
        # when JAX's persistent compilation cache is on (a warm start loads them).
        self._programs: dict[Any, Any] = {}
        folder = executables.default_dir()
        self.store = executables.ExecutableStore(folder) if folder else None
        if self.store is not None:  # what the programs depend on beyond their arguments
            self._store_extra = executables.stable_repr((
                self.graphdef, cache.handle, cache.view.shape, str(cache.dtype),
                cache.block_size, str(cache.view.sharding), self.attention, max_batch, budget,
                prefill, self.max_blocks, num_candidates, str(self._device), cache.layer_groups,
                sorted(self.compiler_options.items()),
            ))  # fmt: skip
            # The devices a stored program is loaded on (those it was compiled for).
            self._store_devices = (
                [cache.device] if self.mesh is None else list(self.mesh.devices.flat)
            )
        # The programs of a step whose rows process their logits (penalties, biases):
        # processing, sampling and log-probabilities on the processed logits, dispatched
        # behind the step. On a mesh every device samples the same rows from the
        # replicated logits (XLA's partitioner then never sees the sampler's barriers).
        sample_rows, process_rows, logprob_rows = sampler_programs(
            self.max_rows, num_candidates, barrier=self.mesh is None
        )
        self._jitted_sample = jax.jit(self._per_device(sample_rows, (None, None), None))
        self._jitted_process = jax.jit(self._per_device(process_rows, (None,) * 6, None))
        self._jitted_logprobs = jax.jit(self._per_device(logprob_rows, (None,) * 3, None))
        copy = self._per_device(
            lambda src, dst, token: ops.copy_blocks(cache, src, dst, token), (None,) * 3, None
        )
        self._jitted_copy = jax.jit(copy)
        self._compiled: set[tuple[int, int]] = set()  # step shapes compiled
        self._samplers: set[int] = set()  # sampler row counts compiled (powers of two)
        self._extras: set[tuple] = set()  # logit processing / log-probability functions
        self.warm = False  # set by compile(): a shape compiled later is counted and logged
        compile_events()  # (listening from now on: every trace and compile is counted)
        self.compiles_after_warmup = 0
        # Committed to the cache's device, like every later step's output: the jit cache
        # keys on placement, so warm-up and serving must pass alike-placed arguments.
        self.last_tokens = jax.device_put(jnp.zeros((self.max_rows,), jnp.int32), self._device)
        self.last_logprobs: tuple | None = None  # of the newest step (run_padded)
        self.last_scores: jax.Array | None = None
        self.last_starts: list[int] = []  # each row's first token on the newest step's axis

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

            return item_tile(self.config.num_heads // self.config.num_kv_heads)
        return min(64, max(8, 1 << ((t // 8).bit_length() - 1)))

    def _items(self, t: int) -> tuple[int, int]:
        tile = self.tile(t)
        return (0, 1) if tile == 0 else (num_items(t, self.max_rows, tile), tile)

    def _expand(self, leaves: list) -> list:
        """A state's leaves as the step takes them: stacked weights split into their
        layers' arrays when unrolled, every array committed where it is (jit keys on
        commitment: weights restored after a sleep hit the same executables)."""
        out = []
        for leaf, split in zip(leaves, self._stacked, strict=True):
            if not split:
                out.append(leaf)
                continue
            sharding = leaf.sharding  # each layer's array split as the stacked one was
            if isinstance(sharding, jax.sharding.NamedSharding):
                spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
                sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
            out += [jax.device_put(leaf[i], sharding) for i in range(leaf.shape[0])]
        return [w if w.committed else jax.device_put(w, w.sharding) for w in out]

    def _join(self, weights: list) -> Any:
        """The step's flat weights back into the model's state (per-layer arrays as a
        LayerList)."""
        leaves, at = [], 0
        n = self.config.num_layers
        for split in self._stacked:
            leaves.append(LayerList(weights[at : at + n]) if split else weights[at])
            at += n if split else 1
        return jax.tree.unflatten(self._weights_def, leaves)

    @property
    def _head_spec(self):
        """The partition of a (T, heads, D) array on a mesh."""
        if self.mesh is None:
            return None
        return jax.sharding.PartitionSpec(None, self.mesh.axis_names[0], None)

    def _per_device(self, fn, in_specs, out_specs):
        """``fn`` run on each device of the mesh over its slice (specs: a PartitionSpec,
        or None for replicated); ``fn`` itself without a mesh. Outputs with spec None are
        the same on every device (the FFI ops' tokens are 0 everywhere)."""
        if self.mesh is None:
            return fn
        P = jax.sharding.PartitionSpec

        def spec(x):
            return P() if x is None else x

        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=tuple(spec(x) for x in in_specs),
            out_specs=spec(out_specs),
            check_vma=False,
        )

    # -- shapes --------------------------------------------------------------------------
    def step_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, block-table width) a step can take."""
        return [(t, nb) for t in self.token_sizes for nb in self.widths]

    def shapes_for(self, batch: list[StepInput]) -> tuple[int, int]:
        bs = self.cache.block_size
        total = sum(len(x.tokens) for x in batch)
        width = max(-(-(x.start + len(x.tokens)) // bs) for x in batch)
        if len(batch) > self.max_batch:
            raise ValueError(
                f"a step of {len(batch)} sequences exceeds the runner's max_batch {self.max_batch}"
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

    @property
    def num_compiled(self) -> int:
        """Distinct step shapes compiled so far (samplers not counted)."""
        return len(self._compiled)

    @property
    def num_samplers(self) -> int:
        """Sampler row counts compiled so far."""
        return len(self._samplers)

    @property
    def compiled_sampler_sizes(self) -> set[int]:
        """The sampler row counts compiled so far (powers of two)."""
        return set(self._samplers)

    def extra_keys(self) -> list[tuple]:
        """The logit-processing (rows, token-list width) and log-probability (rows)
        functions a step may call, compiled by :meth:`compile` with the samplers."""
        keys: list[tuple] = [("copy", 1)]
        keys += [("logprobs", r) for r in self.sampler_sizes]
        keys += [("process", r, p) for r in self.sampler_sizes for p in self.entry_sizes]
        return keys

    def launches(self, key: tuple[int, int] | int) -> Launches:
        """What one step of shape ``key`` (tokens, block-table width), or the separate
        sampler of ``key`` rows, launches on the device when run op by op
        (:func:`~jax_kvcached.engine.launches.count_launches`): the kernels a command
        buffer replays at once."""
        return count_launches(self._program(key).as_text())

    def _packed_sizes(self, t: int, nb: int) -> tuple[int, ...]:
        return packed_sizes(t, self.max_rows, nb, *self._items(t), self.cache.num_groups)

    def lower(self, key: tuple[int, int] | int):
        """The lowered step of a shape, or sampler of ``key`` rows (for inspection)."""
        if isinstance(key, int):  # the sampler of that many rows
            logits = jax.ShapeDtypeStruct((key, self.config.vocab_size), jnp.float32)
            params = jax.ShapeDtypeStruct((NUM_PARAMS, key), jnp.int32)
            return self._jitted_sample.lower(logits, params)
        t, nb = key
        packed = jax.ShapeDtypeStruct((sum(self._packed_sizes(t, nb)),), jnp.int32)
        args = (self._weights, self.cache.view, packed, self.last_tokens, t, nb, self.token)
        with self._context():
            return self._jitted.lower(*args)

    def _seen(self, key: tuple | int) -> None:
        """Records a shape about to run; one first seen after warm-up is counted."""
        if isinstance(key, int):
            table = self._samplers
        elif isinstance(key[0], str):
            table = self._extras
        else:
            table = self._compiled
        if key not in table:
            table.add(key)
            if self.warm:
                self.compiles_after_warmup += 1
                log.warning("compiling %s after warm-up", key)

    def _compile_ahead(self, key: tuple | int) -> None:
        """Makes the program of a key ready ahead of time: loaded from the executable
        store when it holds it, else compiled (``lower(...).compile()`` on arguments
        shaped and placed like a real call's; nothing runs) and stored."""
        with self._context():
            fn, args = self._warmup_call(key)
            store_key = None
            if self.store is not None:
                store_key = self.store.key(getattr(fn, "__name__", "step"), key, args,
                                           self._store_extra)  # fmt: skip
                program = self.store.load(store_key, self._store_devices)
                if program is not None:
                    self._programs[key] = program
                    return
            hits = thread_cache_hits()
            program = fn.lower(*args).compile(compiler_options=self.compiler_options or None)
            if store_key is not None and thread_cache_hits() == hits:
                # (only XLA's own compiles: an executable JAX's persistent cache loaded
                # serializes without its CPU kernels, and a reload of it fails to run)
                self.store.save(store_key, program)
            self._programs[key] = program

    def _program(self, key: tuple | int) -> Any:
        """The compiled program of a key (its dynamic arguments only); one missing is
        compiled now (after warm-up: counted and logged, see :meth:`_seen`)."""
        self._seen(key)
        program = self._programs.get(key)
        if program is None:
            self._compile_ahead(key)
            program = self._programs[key]
        return program

    def _warmup_call(self, key: tuple | int) -> tuple[Any, tuple]:
        """The jitted function a key compiles and arguments shaped and placed like a
        real call's."""
        if key == ("copy", 1):
            one = np.zeros(1, np.int32)
            return self._jitted_copy, (one, one, self.token)
        rows = key if isinstance(key, int) else key[1]
        if isinstance(key, int) or isinstance(key[0], str):
            logits = np.zeros((rows, self.config.vocab_size), np.float32)  # a step's
            logits = jax.device_put(logits, self._device)  # placed like a step's output
        if isinstance(key, int):
            return self._jitted_sample, (logits, np.zeros((NUM_PARAMS, key), np.int32))
        if key[0] == "logprobs":
            return self._jitted_logprobs, (logits, self.last_tokens, np.full(rows, -1, np.int32))
        if key[0] == "process":
            p = key[2]
            args = (np.zeros((rows, p), np.int32), np.zeros((3, rows, p), np.float32),
                    np.ones((3, rows), np.float32), self.last_tokens,
                    np.full(rows, -1, np.int32))  # fmt: skip
            return self._jitted_process, (logits, *args)
        t, nb = key
        packed = np.zeros(sum(self._packed_sizes(t, nb)), np.int32)
        args = (self._weights, self.cache.view, packed, self.last_tokens, t, nb, self.token)
        return self._jitted, args

    def _pack(self, lay: dict, tokens, positions, slots, targets, src, last, params,
              flags: int) -> np.ndarray:  # fmt: skip
        """The step's packed int32 input (see :func:`packed_sizes`)."""
        segments = [tokens, positions, slots, targets, lay["token_slot"], lay["tables"],
                    lay["kv_lens"], lay["q_start"], lay["q_lens"], src, last, lay["item_seq"],
                    lay["item_rows"], lay["item_pos"], params, [flags]]  # fmt: skip
        return np.concatenate([np.asarray(a, np.int32).ravel() for a in segments])

    def compile(
        self,
        shapes: list[tuple[int, int]] | None = None,
        progress: Callable[[int, int], None] | None = None,
        threads: int | None = None,
    ) -> float:
        """Compiles ``shapes`` (default: every shape of :meth:`step_shapes`) and their
        samplers on ``threads`` threads; returns the seconds taken. Afterwards the runner
        is warm: any other shape is a counted, logged compile
        (:attr:`compiles_after_warmup`)."""
        t0 = time.perf_counter()
        shapes = shapes or self.step_shapes()
        rows = set(self.sampler_sizes)
        todo: list = [r for r in sorted(rows) if r not in self._samplers]
        todo += [
            k
            for k in self.extra_keys()
            if (k[0] == "copy" or k[1] in rows) and k not in self._extras
        ]
        todo += [s for s in shapes if s not in self._compiled]
        threads = threads or min(8, os.cpu_count() or 1)
        done = 0
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {pool.submit(self._compile_ahead, key): key for key in todo}
            for f in concurrent.futures.as_completed(futures):
                f.result()
                self._seen(futures[f])  # (not warm yet: recorded, not counted)
                done += 1
                if progress:
                    progress(done, len(todo))
        self.warm = True
        return time.perf_counter() - t0

    # -- sleep -----------------------------------------------------------------------------
    def state_arrays(self) -> list[jax.Array]:
        """The device arrays of the weights the steps run with (empty while asleep)."""
        return list(self._weights)

    def offload_weights(self, level: int) -> Offloaded:
        """Sleep: the weights to host memory (level 1) or dropped (level 2); the device
        arrays are deleted. No step may run until :meth:`restore_weights`."""
        off = offload(self._weights, level)
        self._weights = []
        return off

    def restore_weights(self, off: Offloaded, model: Any = None) -> float:
        """Wake: the weights back on the device, from the host copies or (level 2) from
        ``model``, a freshly loaded model of the same architecture; returns the copy's
        seconds. The compiled steps are hit again (same avals and shardings)."""
        fresh = None
        if off.level == 2:
            if model is None:
                raise ValueError("a level-2 wake needs the reloaded model")
            if self.mesh is not None:
                model = shard_model(model, self.mesh)
            fresh, treedef = jax.tree.flatten(nnx.split(model)[1])
            if treedef != self._weights_def:
                raise ValueError("the reloaded checkpoint does not match the sleeping model")
            fresh = self._expand(fresh)
            shapes = [(x.shape, x.dtype) for x in fresh]
            if shapes != [(s.shape, s.dtype) for s in off.avals]:
                raise ValueError("the reloaded checkpoint does not match the sleeping model")
        self._weights, seconds = restore(off, fresh)
        return seconds

    # -- running -------------------------------------------------------------------------
    @staticmethod
    def fetch(x: jax.Array) -> np.ndarray:
        """A replicated device array on the host (over several processes, this
        process's copy: every process holds the same values)."""
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(x.addressable_data(0))

    def run(self, batch: list[StepInput]) -> jax.Array:
        """Runs one step; returns logits ``(len(batch), vocab)`` (device array)."""
        return self.run_padded(batch)[0][: len(batch)]

    def run_padded(self, batch: list[StepInput]) -> tuple[jax.Array, jax.Array]:
        """Runs one step; returns the logits of its first ``logit_rows(t)`` sequence slots
        ``(rows, vocab)`` (``t`` the step's token bucket; rows >= ``len(batch)``) and the
        sampled next tokens ``(max_rows,)`` (rows past ``len(batch)`` and rows without
        ``params`` are padding), both on the device. :attr:`last_logprobs` and
        :attr:`last_scores` hold the step's log-probabilities (None when no row asked for
        them); :attr:`last_starts` each row's first token on the step's flat axis (the
        columns of :attr:`last_scores`)."""
        if not batch:
            raise ValueError("empty batch")
        bsz = self.cache.block_size
        t, nb = shape = self.shapes_for(batch)
        rows = logit_rows(t, self.max_rows)  # >= len(batch): every sampling row fits
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        ng = self.cache.num_groups
        slots = np.full((ng, t), -1, np.int32)
        targets = np.full(t, -1, np.int32)
        tables = np.zeros((ng, self.max_rows, nb), np.int32)
        src = np.full(self.max_rows, -1, np.int32)
        last = np.zeros(self.max_rows, np.int32)
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        steps = np.zeros(rows, np.int32)
        written: list[set[int]] = [set() for _ in range(ng)]
        at = 0
        starts: list[int] = []
        for i, x in enumerate(batch):
            n = len(x.tokens)
            group_tables = (x.blocks, *x.group_tables)
            if len(group_tables) != ng:
                raise ValueError(f"a step input needs {ng} block tables (one per KV cache group)")
            if n == 0 or any(len(b) * bsz < x.start + n for b in group_tables):
                raise ValueError("a step input needs tokens and blocks covering them")
            if x.src >= self.max_rows or (x.src >= 0 and n != 1):
                raise ValueError(f"bad src row {x.src} for a step of {n} tokens")
            tokens[at : at + n] = x.tokens
            pos = np.arange(x.start, x.start + n)
            positions[at : at + n] = pos
            used = -(-(x.start + n) // bsz)
            for g, blocks in enumerate(group_tables):
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
            starts.append(at)
            at += n
        for group, blocks in zip(self.cache.groups, written, strict=True):
            group.check_writable(blocks)
        lay = ragged_layout([len(x.tokens) for x in batch],
                            [x.start + len(x.tokens) for x in batch], tables[0], t,
                            self.tile(t))  # fmt: skip
        lay["tables"] = tables
        params = np.stack(
            [temperature.view(np.int32), top_k, top_p.view(np.int32), seeds.view(np.int32), steps]
        )
        processing = pack_rows(
            [(x.entries, x.params) if x.entries is not None else None for x in batch],
            rows, self.entry_sizes,
        )  # fmt: skip
        want_logprobs = any(x.params is not None and x.params.logprobs is not None for x in batch)
        # A fused step samples (and scores) its rows itself, unless a row processes its
        # logits; otherwise (processing,) sampling and log-probabilities follow as
        # programs of their own.
        fused = self.step_spec.fused(t) and processing is None
        flags = (SAMPLE | (LOGPROBS if want_logprobs else 0)) if fused else 0
        packed = self._pack(lay, tokens, positions, slots, targets, src, last, params, flags)
        step = self._program(shape)
        with self._context():
            (logits, scores, sampled, lps), self.token = step(
                self._weights, self.cache.view, packed, self.last_tokens, self.token
            )
            self.dispatches += 1
            self.last_logprobs = lps if fused and want_logprobs else None
            if not fused:
                # Dispatched right behind the step: no host round trip in between.
                hint = src_rows(src[: len(batch)], rows)
                processed = logits
                if processing is not None:
                    process = self._program(("process", rows, processing[0].shape[1]))
                    processed = process(logits, *processing, self.last_tokens, hint)
                    self.dispatches += 1
                sampled = self._program(rows)(processed, params)  # (numpy in: one transfer)
                self.dispatches += 1
                if want_logprobs:
                    logprobs = self._program(("logprobs", rows))
                    self.last_logprobs = logprobs(logits, sampled, hint)
                    self.dispatches += 1
            self.last_tokens = sampled
        self.last_scores = scores if (targets >= 0).any() else None
        self.last_starts = starts
        return logits, self.last_tokens

    def copy_block(self, src: int, dst: int) -> None:
        """Copies block ``src`` into block ``dst`` (every layer, K and V) on the device,
        after every step dispatched so far; later steps see the copy (a fork's
        copy-on-write of its last partial block)."""
        self.cache.check_writable({dst})
        copy = self._program(("copy", 1))
        ids = np.asarray([src], np.int32), np.asarray([dst], np.int32)
        with self._context():
            self.token = copy(*ids, self.token)
