"""Engine: continuous-batching generation for one model over a KVCache of a Pool.

This module wires the parts together: the KV manager (blocks), the scheduler (decisions),
the runner and its input builder (the step), the output processor (tokens to outputs),
forks (``n`` samples of a prompt), the offline API (``generate`` / ``chat``) and sleep
mode. One step: schedule, build and dispatch it, record what it computed, then complete
the previous step's tokens (the host prepares step n+1 while the device runs step n).
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jax_kvcached.engine.adapters import AdapterAdmission, AdapterTable
from jax_kvcached.engine.compile_events import compile_events, fresh_compiles
from jax_kvcached.engine.config import EngineConfig
from jax_kvcached.engine.detokenizer import TextStream
from jax_kvcached.engine.forks import Forks
from jax_kvcached.engine.intake import RequestIntake
from jax_kvcached.engine.kv_event_publisher import KVEventPublisher
from jax_kvcached.engine.kv_events import KVEventLog
from jax_kvcached.engine.kv_groups import kv_cache_groups
from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.offline import OfflineAPI, Prompt, PromptLike, RequestOutput
from jax_kvcached.engine.output_processor import OutputProcessor, PendingStep
from jax_kvcached.engine.prefix_cache import PrefixCache, extra_key_bytes
from jax_kvcached.engine.runner import ModelRunner
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.scheduler import Scheduler
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.engine.sleep_mode import SleepMode
from jax_kvcached.engine.step_pacer import StepPacer
from jax_kvcached.engine.structured import GrammarCompiler
from jax_kvcached.memory import ops
from jax_kvcached.memory.config import host_cache_blocks
from jax_kvcached.memory.errors import PoolExhausted
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.memory.pool import Pool
from jax_kvcached.models.chat_template import ChatTemplate
from jax_kvcached.models.interface import CausalLM

__all__ = ["Engine", "EngineConfig", "PendingStep", "Prompt", "PromptLike", "RequestOutput"]


def _same_mesh(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a.axis_names == b.axis_names and list(a.devices.flat) == list(b.devices.flat)


def _mesh_text(mesh: Any) -> str:
    if mesh is None:
        return "(none: one device)"
    return f"{dict(mesh.shape)} over {[str(d) for d in mesh.devices.flat]}"


class Engine(RequestIntake, OfflineAPI, SleepMode):
    """Serves one Flax model (``jax_kvcached.models.CausalLM``) from a pool.

    Args:
      model: the model (its ``config`` gives the KV shape).
      pool: the pool its KV cache is created in.
      config: the engine's settings (:class:`~jax_kvcached.engine.config.EngineConfig`:
        batch and step budgets, context, prefix cache and host tier, memory share,
        attention, overlap, window freeing, command buffers, fused sampling); any of its
        fields may be given as keywords instead (or on top of it).
      tokenizer: optional, for string prompts, stop strings and ``RequestOutput.text``.
      chat_template: the model's :class:`ChatTemplate`, for :meth:`chat` (default: a
        plain ``<|role|>`` one); :meth:`from_pretrained` passes the checkpoint's.
      mesh: tensor parallelism: the 1-D mesh of the pool (``Pool(mesh=)`` or
        ``devices=``); default: the pool's. A copy of the model's parameters is placed
        on it by its ``tensor_parallel_plan`` and each device attends over its heads.
        A mesh other than the pool's is a ValueError.
      reload: returns a fresh copy of the model (its checkpoint read again), for waking
        from a level-2 :meth:`sleep`; :meth:`from_pretrained` passes one.
    """

    def __init__(
        self,
        model: Any,
        pool: Pool,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        chat_template: ChatTemplate | None = None,
        mesh: Any = None,
        reload: Callable[[], Any] | None = None,
        **settings: Any,
    ) -> None:
        if config is None:
            config = EngineConfig(**settings)
        elif settings:
            config = config.replace(**settings)
        if not isinstance(model, CausalLM):
            raise TypeError(
                f"Engine needs a model with config, dtype, __call__(tokens, positions, "
                f"attend) and hf_weights() (jax_kvcached.models.CausalLM), got "
                f"{type(model).__name__}"
            )
        cfg = model.config
        if mesh is not None and not _same_mesh(mesh, pool.mesh):
            raise ValueError(
                f"Engine mesh {_mesh_text(mesh)} does not match the pool's "
                f"{_mesh_text(pool.mesh)}: create the pool with Pool(mesh=...) of that mesh"
            )
        c = self.engine_config = config.with_defaults(pool.config)
        name = c.name
        self.mesh = pool.mesh
        self.config = cfg
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = c.max_model_len or cfg.max_position_embeddings
        # KV cache groups: layers of one attention kind and window share a block table.
        layer_groups, specs = kv_cache_groups(
            cfg.layer_specs(), merge_windows=not c.free_window_blocks  # (all kept)
        )
        self.cache: KVCache = pool.create_kv_cache(
            name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, c.kv_dtype or model.dtype,
            block_size=c.block_size, memory_limit=c.memory_limit,
            memory_guarantee=c.memory_guarantee, layer_groups=layer_groups,
            latent=bool(getattr(cfg, "kv_latent", False)),
        )  # fmt: skip
        self.group_specs = specs  # what each KV cache group's layers keep
        self.name = name
        self.pool = pool
        # KV-cache events (vLLM's), published from a thread when an endpoint is set.
        self.kv_events = KVEventLog(c.block_size, specs) if c.kv_events else None
        self.kv_event_publisher: KVEventPublisher | None = None
        try:
            self.runner = ModelRunner(
                model, self.cache, c.attention, max_batch=c.max_batch,
                max_num_batched_tokens=c.max_num_batched_tokens,
                max_prefill_tokens=c.max_prefill_tokens, max_model_len=self.max_model_len,
                command_buffers=c.command_buffers, fuse_sampling=c.fuse_sampling,
                max_loras=c.max_loras, max_lora_rank=c.max_lora_rank,
            )  # fmt: skip
            host_blocks = host_cache_blocks(
                c.host_cache_tokens, c.host_cache_bytes, c.block_size,
                self.cache.block_bytes * self.cache.pages_per_kv_page * len(self.cache.shards),
            )  # fmt: skip
            self.kv = KVManager(
                self.cache, self.max_model_len, prefix_caching=c.prefix_caching,
                max_cached_tokens=c.max_cached_tokens, eviction=c.eviction,
                host_cache_blocks=host_blocks, specs=specs, slot_blocks=self.runner.slot_blocks,
                state_interval=c.state_checkpoint_tokens, events=self.kv_events,
            )  # fmt: skip
            if self.kv_events is not None:
                self.kv_event_publisher = KVEventPublisher(
                    self.kv_events, c.kv_events, c.kv_events_replay, topic=c.kv_events_topic,
                    token_ids=c.kv_events_token_ids, curve_dir=c.kv_events_curve_dir,
                )  # fmt: skip
        except BaseException:
            if getattr(self, "kv", None) is not None:
                self.kv.close()
            self.cache.close()  # a model that cannot run here leaves the pool as it was
            raise
        self.kv.set_fence(self.runner.token)
        # A CPU step's prompt chunk beside decode rows: paced by measured step times.
        self.pacer = StepPacer(c.stall_ratio, self.runner.max_num_batched_tokens,
                               self.runner.token_sizes) if self.runner.paced else None  # fmt: skip
        self._last_ready: float | None = None  # the last completed step's (for the pacer)
        self.scheduler = Scheduler(
            self.kv, c.max_batch, self.runner.max_num_batched_tokens, self.max_model_len,
            self.runner.max_prefill_tokens, self.pacer.budget if self.pacer else None,
        )  # fmt: skip
        self.outputs = OutputProcessor(
            lambda x: self.runner.fetch(x), cfg.eos_ids, self.max_model_len,
            accepted=lambda s: self.kv.computed(s, s.num_computed), finish=self._finish,
            check_device=lambda: ops.raise_device_errors(self.cache),
        )  # fmt: skip
        self._forks = Forks(self.kv, self.scheduler, self.runner.copy_block)
        self.max_batch = c.max_batch
        self.max_num_batched_tokens = self.runner.max_num_batched_tokens
        self.log_every = c.log_every
        self.overlap = c.overlap
        self._ids = itertools.count()
        self.adapters = AdapterTable(self.runner.lora, model, c.max_cpu_loras)  # by name
        self.lora_queue = AdapterAdmission(self.adapters, lambda: self._by_id.values())
        # Structured outputs: compiled for this model's tokenizer.
        self.grammars = GrammarCompiler(tokenizer, cfg.vocab_size, cfg.eos_ids)
        self._by_id: dict[int, Sequence] = {}
        self._inflight: deque[PendingStep] = deque()  # dispatched, oldest first
        self._lock = threading.RLock()  # steps vs. another tenant's reclaim
        self._finished: list[Sequence] = []  # until drain_finished()
        self._rejected: list[Sequence] = []  # rejected while dispatching, for step()
        self.steps = 0
        self.schedule_digest: int | None = None  # the last dispatch's (see dispatch)
        self._asleep: Any = None  # the offloaded weights while sleeping (sleep.Offloaded)
        self._reload = reload  # a fresh model of the same weights (a level-2 wake)
        pool.set_reclaimer(name, self._reclaim)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.kv.prefix_cache

    def add_request(
        self,
        prompt: str | Seq[int] | Prompt,
        params: SamplingParams | None = None,
        on_token: Callable[[int, int, bool], None] | None = None,
        *,
        cache_salt: str | None = None,
        adapter: str | None = None,
        fork_of: int | None = None,
        on_logprobs: Callable[[int, Any], None] | None = None,
    ) -> int:
        """Queues a request; ``on_token(request_id, token, finished)`` streams its output.

        ``adapter``: a loaded LoRA adapter's name (:meth:`load_adapter`; None: the base
        model). Requests share cached prefixes only with the same model, ``cache_salt``
        and adapter. ``fork_of``: an active request with the same prompt (and keys)
        whose prompt is not computed yet; this one then shares its prompt's KV blocks
        instead of computing them (``n`` samples of one prompt: one prefill).
        ``on_logprobs(request_id, (logprob, [(id, logprob)...]))`` streams each token's
        log-probabilities (``params.logprobs``) just before its ``on_token``.
        """
        ids = list(self.prompt(prompt).token_ids)
        params = self.checked_params(len(ids), params)
        with self._lock:
            lora = self.adapters.get(adapter) if adapter is not None else None
            rid = next(self._ids)
            seq = Sequence(rid, ids, params, on_token, on_logprobs=on_logprobs)
            if lora is not None:
                seq.lora = (lora.id, lora.name)
            if params.structured is not None:
                seq.grammar = self.grammars.state(params.structured)
            if params.stop:
                seq.detok = TextStream(self.tokenizer.decode, list(params.stop))
            seq.extra = extra_key_bytes(self.name, cache_salt, lora and lora.key)
            parent = self._by_id.get(fork_of) if fork_of is not None else None
            # (an adapter's request without a slot waits: every slot's adapter is in use)
            if (lora is None or self.lora_queue.submit(seq)) and not self._forks.wait(
                parent, seq
            ):  # fmt: skip
                self.scheduler.add(seq)
            self._by_id[rid] = seq
        return rid

    def load_adapter(self, name: str, path: str) -> Any:
        """Registers the PEFT LoRA adapter in folder ``path`` as ``name``; it takes a
        device slot when a request uses it (nothing recompiles). An AdapterError names
        what does not fit."""
        adapter = self.adapters.read(name, path)  # (the folder read off the lock)
        with self._lock:
            return self.adapters.register(adapter)

    def unload_adapter(self, name: str) -> None:
        """Drops adapter ``name`` (ValueError while a request uses it)."""
        with self._lock:
            self.adapters.unload(name, self.lora_queue.users)

    def abort(self, request_id: int) -> bool:
        """Drops a queued or running request and frees its blocks; False if it is not
        active. Its ``on_token`` is not called again."""
        with self._lock:
            seq = self._by_id.pop(request_id, None)
            if seq is None:
                return False
            if self.lora_queue.drop(seq):
                return True
            if self._forks.abort(seq):  # a fork still waiting for its parent
                return True
            self._forks.orphan(request_id)
            return self.scheduler.abort(seq)

    @property
    def forks(self) -> int:
        """Forks that took their parent's prompt blocks."""
        return self._forks.forks

    @property
    def fork_fallbacks(self) -> int:
        """Forks admitted on their own (batch or memory full, parent gone)."""
        return self._forks.fallbacks

    def active_requests(self) -> list[int]:
        """The ids of requests queued, running or waiting for a parent."""
        with self._lock:
            return [r for r, s in self._by_id.items() if s.finish_reason is None]

    def take_finished(self, request_ids: Seq[int]) -> dict[int, Sequence]:
        """Removes the finished (or rejected) sequences of ``request_ids`` from those
        :meth:`drain_finished` would return, by id."""
        wanted = set(request_ids)
        with self._lock:
            out = {s.request_id: s for s in self._finished if s.request_id in wanted}
            self._finished = [s for s in self._finished if s.request_id not in wanted]
        return out

    @property
    def num_inflight(self) -> int:
        """Dispatched steps whose results have not been completed."""
        return len(self._inflight)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or bool(self._inflight) or bool(self._rejected)
                or bool(self.lora_queue.waiting))  # fmt: skip

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.lora_queue.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def drain_finished(self) -> list[Sequence]:
        """The sequences finished (or rejected) since the last call, oldest first."""
        with self._lock:
            done, self._finished = self._finished, []
            return done

    def reset_prefix_cache(self) -> int:
        """Evicts every idle cached prefix block; returns how many."""
        with self._lock:
            return self.kv.reset_prefix_cache()

    def compile(self, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Compiles every step shape the engine can run (warm-up): after it, serving
        compiles nothing. Returns the step shape and sampler counts, ``programs`` (all
        that compiled now: shapes, samplers, logit functions; what ``progress(done,
        total)`` counts), the seconds taken, and how many of the programs XLA compiled
        (``xla_compiles``), loaded from the persistent compilation cache
        (``cache_loads``: traced and lowered, not compiled) or loaded as stored
        executables (``executables_loaded``: none of the three)."""
        shapes = self.runner.step_shapes()
        total = [0]

        def report(done: int, n: int) -> None:
            total[0] = n
            if progress is not None:
                progress(done, n)

        before = compile_events()
        store = self.runner.store
        loaded = store.loaded if store is not None else 0
        secs = self.runner.compile(shapes, progress=report)
        after = compile_events()
        return {
            "shapes": len(shapes), "samplers": self.runner.num_samplers,
            "programs": total[0], "seconds": secs,
            "xla_compiles": fresh_compiles(before, after),
            "cache_loads": after["cache_hits"] - before["cache_hits"],
            "executables_loaded": (store.loaded if store is not None else 0) - loaded,
        }  # fmt: skip

    @property
    def num_compiled(self) -> int:
        """Step shapes compiled so far."""
        return self.runner.num_compiled

    def step(self) -> list[Sequence]:
        """Advances the pipeline: dispatches the next step (the host prepares it while the
        device runs the previous one), then completes the previous step. Returns the
        sequences that finished, and those rejected (finish_reason "error", ``error``
        says why: they can never fit). A sleeping engine steps nothing."""
        if self._asleep is not None:
            return []
        if self.lora_queue.waiting:
            with self._lock:
                self.lora_queue.admit(self.scheduler.add)
        new = self.dispatch() if self.scheduler.has_work else None
        rejected, self._rejected = self._rejected, []
        if new is not None and new.sample_later is not None and len(self._inflight) > 1:
            # Structured rows: their masks need the previous step's tokens. It completes
            # while this step's forward pass runs, then this step samples.
            rejected += self.complete(self._inflight[0])
            self._sample_deferred()
        if not self._inflight:
            return rejected
        if self.overlap and new is not None and len(self._inflight) == 1:
            return rejected  # the new step runs alone: its results are collected next call
        return rejected + self.complete(self._inflight[0])

    def drain(self) -> list[Sequence]:
        """Completes every dispatched step."""
        done: list[Sequence] = []
        while self._inflight:
            done += self.complete(self._inflight[0])
        return done

    def dispatch(self) -> PendingStep | None:
        """Schedules and dispatches one step without waiting for any result (None:
        nothing could run). At most one step may be in flight when dispatching: the
        next one's decode rows take their tokens from it on the device."""
        with self._lock:
            if len(self._inflight) > 1:
                raise RuntimeError("complete() a dispatched step before dispatching another")
            self._sample_deferred()  # (its tokens feed this step's device-fed rows)
            started = time.perf_counter()
            self.kv.poll()
            self.lora_queue.admit(self.scheduler.add)
            out = self.scheduler.schedule()
            # What this step decided, in a few bytes (ranks of one model compare it).
            self.schedule_digest = zlib.crc32(repr(
                ([(x.seq.request_id, x.end) for x in out.scheduled],
                 [s.request_id for s in out.rejected])).encode())  # fmt: skip
            for s in out.rejected:  # it can never fit: dropped, reported by step()
                self._by_id.pop(s.request_id, None)
                self._finished.append(s)
                self._forks.orphan(s.request_id)
            self._rejected += out.rejected
            if not out.scheduled:
                return None
            # The builder decides which rows sample, their logit entries and targets.
            prepared = self.runner.builder.prepare(out)
            result = self.runner.execute(prepared)
            self.kv.set_fence(result.fence)  # frees wait for this step from now on
            self.steps += 1
            for x in out.scheduled:
                s = x.seq
                self.kv.computed(s, x.end)
                if self._forks.waits_for(s.request_id) and s.num_computed >= s.num_prompt:
                    self._forks.take(s, self.max_batch)
            for s, i in prepared.sampling:
                s.num_pending += 1
                s.last_row = i
            if self.prefix_cache and self.steps % self.log_every == 0:
                self.prefix_cache.log_stats()
            step = PendingStep([s for s, _ in prepared.sampling],
                               result.tokens if prepared.sampling else None,
                               [i for _, i in prepared.sampling])  # fmt: skip
            step.decodes, step.started = out.num_decodes, started
            step.prompt_tokens = sum(x.num_tokens for x in out.scheduled) - out.num_decodes
            step.position = max((x.end for x in out.scheduled[out.num_decodes:]), default=0)
            step.logprobs = result.logprobs
            if prepared.scored and result.scores is not None:
                step.scores, step.scored = result.scores, prepared.scored
            if prepared.deferred:
                step.sample_later = lambda: self._sample(step, prepared, result.logits)
            self._inflight.append(step)
            if len(self._inflight) == 1:
                self._sample_deferred()  # (nothing older: its masks are known now)
            return step

    def _sample(self, step: PendingStep, prepared: Any, logits: Any) -> None:
        """Samples a deferred step: its structured rows' masks (the others: -1, all
        allowed), then the programs behind the step."""
        mask = np.full((prepared.logit_rows, self.grammars.words), -1, np.int32)
        for s, i in prepared.grammar_rows:
            if s.finish_reason is None:  # (one that ended meanwhile samples unmasked)
                mask[i] = s.grammar.mask()
        step.tokens, step.logprobs = self.runner.sample(prepared, logits, mask)

    def complete(self, step: PendingStep | None) -> list[Sequence]:
        """Waits for a dispatched step's tokens (the oldest in flight), streams them and
        finishes sequences."""
        if step is None:
            return []
        with self._lock:
            if not self._inflight or step is not self._inflight[0]:
                raise RuntimeError("this step is not the engine's oldest dispatched step")
            self._sample_deferred()
            self._inflight.popleft()
            done = self.outputs.process(step)
            self._finished.extend(done)
            self._pace(step)
            return done

    def _pace(self, step: PendingStep) -> None:
        """Gives the pacer a completed step's time: from the previous step's tokens
        (the device was busy since), or from its own dispatch (it was idle)."""
        last, self._last_ready = self._last_ready, step.ready
        if self.pacer is None or step.ready is None or last is None:
            return  # (after a step without tokens, the interval is not this step's)
        self.pacer.observe(step.decodes, step.prompt_tokens,
                           step.ready - max(last, step.started), step.position)  # fmt: skip

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence whose output stops (the output processor's call)."""
        self.scheduler.finish(seq, reason)
        self._by_id.pop(seq.request_id, None)

    def _sample_deferred(self) -> None:
        """Samples the oldest step in flight if it waits for its masks (every older
        step has completed, so its structured rows' matchers have their tokens)."""
        if self._inflight and self._inflight[0].sample_later is not None:
            later, self._inflight[0].sample_later = self._inflight[0].sample_later, None
            later()

    def _reclaim(self, pages: int) -> int:
        """Another tenant needs memory: the KV manager evicts idle cached prefixes.
        Never blocks (0 while this engine is stepping)."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            return self.kv.reclaim(pages)
        finally:
            self._lock.release()

    def run(self) -> None:
        """Steps until every queued request has finished.

        Raises PoolExhausted when nothing can run because other tenants hold the memory
        (run each engine from a serving loop to wait for it instead). A sleeping engine
        with work wakes first."""
        if self._asleep is not None and self.has_work:
            self.wake()
        while self.has_work:
            preemptions = self.scheduler.num_preemptions
            steps, inflight = self.steps, len(self._inflight)
            done = self.step()
            stuck = self.steps == steps and not inflight and not done
            if stuck and preemptions == self.scheduler.num_preemptions:
                raise PoolExhausted(
                    f"{self.name!r}: {len(self.scheduler.waiting)} requests wait for KV memory "
                    "held by other tenants of the pool"
                )

    def stats(self) -> dict[str, Any]:
        """Queue, memory and prefix-cache figures (a snapshot; any thread)."""
        lim = self.pool.memory_limit_of(self.name)
        return {
            "steps": self.steps,
            "waiting": self.num_waiting,
            "running": self.num_running,
            "max_batch": self.max_batch,
            "preemptions": self.num_preemptions,
            "mapped_bytes": self.cache.mapped_bytes,  # per device
            **self.runner.weight_bytes(),  # per device; 0 while asleep
            "tensor_parallel": self.cache.tensor_parallel,
            "limit_bytes": lim.limit_bytes,
            "guarantee_bytes": lim.guarantee_bytes,
            "prefix_cache": self.kv.stats(),
            "host_cache": self.kv.host_stats(),
            "kv_cache_groups": self.kv.group_stats(),
            "lora": self.adapters.stats(),
            "sleeping": self.sleeping,
            "sleep_level": self.sleep_level,
        }

    def close(self) -> None:
        with self._lock:
            self.pool.set_reclaimer(self.name, None)
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.close()
            self.kv.close()
            self.cache.close()
