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
from jax_kvcached.engine.compile_events import compile_events, thread_cache_hits
from jax_kvcached.engine.device_choices import compiler_options, resolve_attention
from jax_kvcached.engine.input_builder import InputBuilder, PreparedStep, StepInput
from jax_kvcached.engine.launches import Launches, count_launches
from jax_kvcached.engine.logit_inputs import entry_sizes
from jax_kvcached.engine.recurrent import slot_blocks
from jax_kvcached.engine.sampler_programs import mask_rows, sampler_programs
from jax_kvcached.engine.sampling import NUM_CANDIDATES
from jax_kvcached.engine.sleep import Offloaded
from jax_kvcached.engine.step_layout import NUM_PARAMS
from jax_kvcached.engine.step_program import StepSpec, make_step
from jax_kvcached.engine.step_result import StepResult
from jax_kvcached.engine.step_shapes import StepShapes
from jax_kvcached.engine.step_weights import StepWeights
from jax_kvcached.memory import ops
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.models.lora import LoRASlots, lora_targets
from jax_kvcached.models.sharding import shard_model

log = logging.getLogger(__name__)



def lora_slots(model: Any, mesh: Any, device: Any, max_loras: int, max_rank: int, *,
               unroll: bool) -> LoRASlots | None:  # fmt: skip
    """The adapter slots of a runner (None: ``max_loras`` 0); ValueError for a model or a
    placement that does not take adapters."""
    if not max_loras:
        return None
    if mesh is not None:
        raise ValueError("LoRA adapters over a device mesh (tensor parallelism) are not "
                         "served yet")  # fmt: skip
    if not lora_targets(model):
        raise ValueError(f"{model.config.model_type}: LoRA adapters are not served for "
                         "this family")  # fmt: skip
    return LoRASlots(model.config, max_loras, max_rank, device, unroll=unroll)


def src_rows(src: np.ndarray, rows: int) -> np.ndarray:
    """``src`` padded to the sampler's rows (-1: the row's input was not fed)."""
    out = np.full(rows, -1, np.int32)
    out[: len(src)] = src
    return out


class ModelRunner:
    """``attention``: ``auto`` (the Pallas kernel for a CUDA cache, the host custom call
    for a host cache), ``host``, ``xla``, ``pallas`` or ``pallas-interpret``.

    Steps of at most ``max_batch`` sequences and ``max_num_batched_tokens`` new tokens in
    all (default: :func:`~jax_kvcached.engine.step_shapes.default_token_budget`), or
    ``max_prefill_tokens`` when no row decodes (default:
    :func:`~jax_kvcached.engine.step_shapes.default_prefill_budget`), contexts up to
    ``max_model_len`` tokens: these bound the shape set (:class:`StepShapes`).
    ``scan_layers``: run the model's layers under
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
        max_loras: int = 0,
        max_lora_rank: int = 16,
    ) -> None:
        cfg = model.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ValueError("the KV cache's layers / KV heads / head_dim do not match the model")
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
        self.weights = StepWeights(state, cfg.num_layers, unroll=not self.scan_layers,
                                   mesh=self.mesh)  # fmt: skip
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
        # A recurrent group (its layers' state slots: recurrent.py), or None.
        rec = [i for i, s in enumerate(cfg.layer_specs()) if s.kind == "recurrent"]
        self.state_group = cache.layer_groups[rec[0]] if rec else None
        self.slot_blocks = slot_blocks(cache, cfg.state_elems) if rec else 0
        if rec and (self.mesh is not None or cache.latent):
            raise ValueError(
                f"{cfg.model_type}: recurrent-state layers run on one device with a K/V "
                "cache (tensor parallelism over them is not supported yet)"
            )
        # LoRA adapters' slots (models/lora.py), inputs of every step (None: no adapters).
        self.lora = lora_slots(model, self.mesh, cache.device, max_loras, max_lora_rank,
                               unroll=not self.scan_layers)  # fmt: skip
        self.shapes = StepShapes(
            cache.backend, self.attention, max_batch=max_batch,
            max_num_batched_tokens=max_num_batched_tokens, max_prefill_tokens=max_prefill_tokens,
            max_blocks=-(-max_len // cache.block_size), block_size=cache.block_size,
            groups=cache.num_groups, query_per_kv=cfg.num_heads // cfg.num_kv_heads,
            slot_blocks=self.slot_blocks, lora=self.lora is not None,
        )  # fmt: skip
        shapes = self.shapes
        self.max_blocks, self.max_batch = shapes.max_blocks, max_batch
        self.max_num_batched_tokens = budget = shapes.max_num_batched_tokens
        self.max_prefill_tokens = prefill = shapes.max_prefill_tokens
        self.sampler_sizes, self.max_rows = shapes.sampler_sizes, shapes.max_rows
        self.token_sizes, self.widths = shapes.token_sizes, shapes.widths
        self.paced = shapes.paced
        # Logit processing: token lists of these widths (prompt + output + biases).
        self.entry_sizes = entry_sizes(max_len + 64)
        spec = StepSpec(
            graphdef=self.graphdef, cache=cache, attention=self.attention,
            max_rows=self.max_rows, num_candidates=num_candidates,
            windows=np.asarray(cfg.layer_windows(), np.int32), join=self.weights.join,
            layout=shapes.layout, per_device=self._per_device, head_spec=self._head_spec,
            logits_sharding=None if self.mesh is None else self._device,
            fuse=cache.backend == "cuda" if fuse_sampling is None else fuse_sampling,
        )  # fmt: skip
        self.builder = InputBuilder(shapes, cache.groups, self.entry_sizes, spec.fused,
                                    cfg.eos_ids, self.state_group)  # fmt: skip
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
                # (a host cache's programs find it by its view: the same for every cache)
                self.graphdef, cache.handle if cache.backend != "host" else "view",
                cache.view.shape, str(cache.dtype),
                cache.block_size, str(cache.view.sharding), self.attention, max_batch, budget,
                prefill, self.max_blocks, num_candidates, str(self._device), cache.layer_groups,
                sorted(self.compiler_options.items()), spec.fuse, spec.windows.tolist(),
                self.scan_layers,
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
        # A structured output's mask and the sampler, one program (one dispatch).
        self._jitted_mask = jax.jit(self._per_device(
            lambda logits, mask, params: sample_rows(mask_rows(logits, mask), params),
            (None, None, None), None))  # fmt: skip
        # One block copy per KV cache group (a fork's copy-on-write of a partial block).
        view_spec = None if self.mesh is None else cache.sharding.spec
        self._jitted_copy = [
            jax.jit(self._per_device(
                lambda view, src, dst, token, g=g: ops.copy_blocks(cache, src, dst, token,
                                                                   group=g, view=view),
                (view_spec, None, None, None), None,
            ))
            for g in range(cache.num_groups)
        ]  # fmt: skip
        self._compiled: set[tuple[int, int]] = set()  # step shapes compiled
        self._samplers: set[int] = set()  # sampler row counts compiled (powers of two)
        self._extras: set[tuple] = set()  # logit processing / log-probability functions
        self.warm = False  # set by compile(): a shape compiled later is counted and logged
        compile_events()  # (listening from now on: every trace and compile is counted)
        self.compiles_after_warmup = 0
        # Committed to the cache's device, like every later step's output: the jit cache
        # keys on placement, so warm-up and serving must pass alike-placed arguments.
        self.last_tokens = jax.device_put(jnp.zeros((self.max_rows,), jnp.int32), self._device)

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
        return self.shapes.all()

    def shapes_for(self, batch: list[StepInput]) -> tuple[int, int]:
        """The shape of a step of ``batch`` (ValueError past the runner's bounds)."""
        return self.shapes.of([(x.start, len(x.tokens)) for x in batch])

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
        """The logit-processing (rows, token-list width), log-probability (rows) and
        masked-sampler (rows) functions a step may call, compiled by :meth:`compile` with
        the samplers."""
        keys: list[tuple] = [("copy", g) for g in range(self.cache.num_groups)]
        keys += [("logprobs", r) for r in self.sampler_sizes]
        keys += [("process", r, p) for r in self.sampler_sizes for p in self.entry_sizes]
        keys += [("mask", r) for r in self.sampler_sizes]
        return keys

    def launches(self, key: tuple[int, int] | int) -> Launches:
        """What one step of shape ``key`` (tokens, block-table width), or the separate
        sampler of ``key`` rows, launches on the device when run op by op
        (:func:`~jax_kvcached.engine.launches.count_launches`): the kernels a command
        buffer replays at once."""
        return count_launches(self._program(key).as_text())

    def lower(self, key: tuple[int, int] | int):
        """The lowered step of a shape, or sampler of ``key`` rows (for inspection)."""
        if isinstance(key, int):  # the sampler of that many rows
            logits = jax.ShapeDtypeStruct((key, self.config.vocab_size), jnp.float32)
            params = jax.ShapeDtypeStruct((NUM_PARAMS, key), jnp.int32)
            return self._jitted_sample.lower(logits, params)
        t, nb = key
        packed = jax.ShapeDtypeStruct((self.shapes.layout(key).size,), jnp.int32)
        args = (self._weights_arg(), self.cache.view, packed, self.last_tokens, t, nb, self.token)
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
        if isinstance(key, tuple) and key[0] == "copy":  # ("copy", group): a block of it
            one = np.zeros(1, np.int32)
            return self._jitted_copy[key[1]], (self.cache.view, one, one, self.token)
        rows = key if isinstance(key, int) else key[1]
        if isinstance(key, int) or isinstance(key[0], str):
            logits = np.zeros((rows, self.config.vocab_size), np.float32)  # a step's
            logits = jax.device_put(logits, self._device)  # placed like a step's output
        if isinstance(key, int):
            return self._jitted_sample, (logits, np.zeros((NUM_PARAMS, key), np.int32))
        if key[0] == "logprobs":
            return self._jitted_logprobs, (logits, self.last_tokens, np.full(rows, -1, np.int32))
        if key[0] == "mask":
            words = (self.config.vocab_size + 31) // 32
            return self._jitted_mask, (logits, np.full((rows, words), -1, np.int32),
                                       np.zeros((NUM_PARAMS, rows), np.int32))
        if key[0] == "process":
            p = key[2]
            args = (np.zeros((rows, p), np.int32), np.zeros((3, rows, p), np.float32),
                    np.ones((3, rows), np.float32), self.last_tokens,
                    np.full(rows, -1, np.int32))  # fmt: skip
            return self._jitted_process, (logits, *args)
        t, nb = key
        packed = np.zeros(self.shapes.layout(key).size, np.int32)
        args = (self._weights_arg(), self.cache.view, packed, self.last_tokens, t, nb, self.token)
        return self._jitted, args

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

    def _weights_arg(self) -> tuple[list[jax.Array], Any]:
        """A step's first argument: the weights, and the LoRA slots' stacks (or None)."""
        return self.weights.arrays, self.lora.arrays() if self.lora is not None else None

    # -- sleep -----------------------------------------------------------------------------
    def state_arrays(self) -> list[jax.Array]:
        """The device arrays of the weights the steps run with (empty while asleep)."""
        return list(self.weights.arrays)

    def weight_bytes(self) -> dict[str, int]:
        """See :meth:`StepWeights.nbytes`."""
        return self.weights.nbytes()

    def offload_weights(self, level: int) -> Offloaded:
        """Sleep: see :meth:`StepWeights.offload`."""
        return self.weights.offload(level)

    def restore_weights(self, off: Offloaded, model: Any = None) -> float:
        """Wake: see :meth:`StepWeights.restore`."""
        return self.weights.restore(off, model)

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
        """Builds and runs one step: its logits and sampled tokens (see :meth:`execute`)."""
        result = self.execute(self.builder.build(batch))
        return result.logits, result.tokens

    def execute(self, step: PreparedStep) -> StepResult:
        """Runs a built step; returns its outputs on the device: the logits of its first
        ``step.logit_rows`` sequence slots ``(rows, vocab)``, the sampled next tokens
        ``(max_rows,)`` (rows past the batch and rows without ``params`` are padding),
        the log-probabilities and the targets' scores (None when no row asked for them)
        and the step's fence. A ``deferred`` step (structured rows) runs its forward pass
        only: :meth:`sample` samples it once its masks are known."""
        program = self._program(step.shape)
        with self._context():
            (logits, scores, sampled, lps), self.token = program(
                self._weights_arg(), self.cache.view, step.packed, self.last_tokens, self.token
            )
            self.dispatches += 1
            scores = scores if step.has_targets else None
            if step.deferred:
                return StepResult(logits, None, None, scores, self.token)
            out_lps = lps if step.fused and step.want_logprobs else None
            if not step.fused:
                sampled, out_lps = self._behind(step, logits, None)
            self.last_tokens = sampled  # (the next step's device-fed rows read them)
        return StepResult(logits, sampled, out_lps, scores, self.token)

    def sample(self, step: PreparedStep, logits: jax.Array, mask: np.ndarray) -> tuple:
        """A deferred step's sampled tokens and log-probabilities, its rows' logits
        masked by ``mask`` ``(logit_rows, words)`` first (-1 words: no constraint)."""
        with self._context():
            sampled, lps = self._behind(step, logits, mask)
            self.last_tokens = sampled
        return sampled, lps

    def _behind(self, step: PreparedStep, logits: jax.Array, mask: np.ndarray | None) -> tuple:
        """Logit processing, the mask, sampling and log-probabilities of a step, as
        programs dispatched right behind it (no host round trip in between)."""
        rows = step.logit_rows
        hint = src_rows(step.src, rows)
        processed, out_lps = logits, None
        if step.processing is not None:
            process = self._program(("process", rows, step.processing[0].shape[1]))
            processed = process(logits, *step.processing, self.last_tokens, hint)
            self.dispatches += 1
        if mask is not None:  # a structured output's allowed tokens, then sampling
            sampled = self._program(("mask", rows))(processed, mask, step.params)
        else:
            sampled = self._program(rows)(processed, step.params)  # (one transfer)
        self.dispatches += 1
        if step.want_logprobs:
            out_lps = self._program(("logprobs", rows))(logits, sampled, hint)
            self.dispatches += 1
        return sampled, out_lps

    def copy_block(self, src: int, dst: int, group: int = 0) -> jax.Array:
        """Copies block ``src`` into block ``dst`` of KV cache group ``group`` (every
        layer of the group, K and V) on the device, after every step dispatched so far;
        later steps see the copy (a fork's copy-on-write of its last partial block).
        Returns the token that orders later work after the copy."""
        self.cache.groups[group].check_writable({dst})
        copy = self._program(("copy", group))
        ids = np.asarray([src], np.int32), np.asarray([dst], np.int32)
        with self._context():
            self.token = copy(self.cache.view, *ids, self.token)
        return self.token
