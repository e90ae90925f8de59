"""Engine: continuous-batching generation for one model over a KVCache of a Pool."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from jax_kvcached.engine.compile_events import compile_events, fresh_compiles
from jax_kvcached.engine.detokenizer import TextStream
from jax_kvcached.engine.eviction import EvictionPolicy
from jax_kvcached.engine.kv_groups import kv_cache_groups
from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.prefix_cache import PrefixCache, extra_key_bytes
from jax_kvcached.engine.runner import ModelRunner
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.scheduler import Scheduler
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory import ops
from jax_kvcached.memory.config import host_cache_blocks, parse_bytes
from jax_kvcached.memory.errors import ContextLengthExceeded, PoolExhausted
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.memory.pool import Pool
from jax_kvcached.models.chat_template import ChatTemplate
from jax_kvcached.models.interface import CausalLM

# One prompt: text, token ids, or a Prompt an engine validated.
PromptLike = str | Seq[int] | Any


def _alternatives(ids: Any, logprobs: Any, k: int) -> list[tuple[int, float]]:
    """The first ``k`` (id, log-probability) pairs of a row of top-k ids and values."""
    return [(int(i), float(v)) for i, v in zip(ids[:k], logprobs[:k], strict=True)]


def _as_prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s prompts as a list: one string, Prompt or flat token-id list is one
    prompt (as the OpenAI ``prompt`` field reads it)."""
    if isinstance(prompts, (str, Prompt)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _text(tokenizer: Any, s: Sequence) -> str | None:
    """A finished sequence's output text (cut before its stop string, if it hit one)."""
    if tokenizer is None:
        return None
    if s.detok is None:
        return tokenizer.decode(s.output)
    s.detok.flush()
    return s.detok.text


def _same_mesh(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a.axis_names == b.axis_names and list(a.devices.flat) == list(b.devices.flat)


def _mesh_text(mesh: Any) -> str:
    if mesh is None:
        return "(none: one device)"
    return f"{dict(mesh.shape)} over {[str(d) for d in mesh.devices.flat]}"


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    ttft_s: float
    latency_s: float
    preemptions: int
    cached_tokens: int = 0
    seed: int | None = None  # the request's sampling seed (drawn if it gave none)
    text: str | None = None
    # params.logprobs: per token (logprob, [(id, logprob)]); params.prompt_logprobs: per
    # prompt position the same (None for the first; params.logprobs alternatives).
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt one engine has validated (:meth:`Engine.prompt`): token ids in its
    vocabulary that leave room in its context. Passing it on is not validated again."""

    token_ids: tuple[int, ...]
    engine: Any = dataclasses.field(repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose sampled tokens may still be computing."""

    sequences: list[Sequence]  # the sequences that sample a token, in order
    tokens: Any  # device array of the step's sampled tokens, or None
    rows: list[int] = dataclasses.field(default_factory=list)  # their rows in ``tokens``
    logprobs: Any = None  # device arrays of the sampled tokens' log-probabilities
    # Prompt log-probabilities: device array (1 + 2K, tokens) and (sequence, first column
    # on the step's token axis, start, n).
    scores: Any = None
    scored: list[tuple[Sequence, int, int, int]] = dataclasses.field(default_factory=list)


class Engine:
    """Serves one Flax model (``jax_kvcached.models.CausalLM``) from a pool.

    Args:
      model: the model (its ``config`` gives the KV shape).
      pool: the pool its KV cache is created in.
      name: the KV cache's name in the pool.
      max_batch: sequences running at once.
      max_num_batched_tokens: the most new tokens of a step while any sequence decodes,
        decode rows first, then prompt chunks (at least ``max_batch``). Default: on a CPU
        :func:`~jax_kvcached.engine.step_shapes.cpu_decode_budget` of the D decode rows (16 +
        4 D tokens, rounded down to 16, at most 64: one stream and a 15-token chunk), so
        streams keep their pace; 2048 on a GPU. A value given is a fixed budget.
      max_prefill_tokens: new tokens in a step without decode rows (nobody waits for it);
        default 256 on a CPU, the step budget on a GPU or when ``max_num_batched_tokens``
        is given.
      max_model_len: prompt + output limit (default: the model's max positions).
      kv_dtype: KV cache dtype (default: the model's dtype).
      tokenizer: optional, for string prompts, stop strings and ``RequestOutput.text``.
      chat_template: the model's :class:`ChatTemplate`, for :meth:`chat` (default: a
        plain ``<|role|>`` one); :meth:`from_pretrained` passes the checkpoint's.
      prefix_caching: reuse the KV of cached prompt prefixes across requests.
      max_cached_tokens: prefix-cache bound (default ``KVCACHED_MAX_CACHED_TOKENS``).
      eviction: the prefix cache's eviction policy, ``"lru"`` (default) or ``"lfu"``.
      host_cache_tokens / host_cache_bytes: the bound of the prefix cache's host tier
        (evicted prefix blocks are copied to host memory and restored from there instead
        of recomputed); default ``KVCACHED_HOST_CACHE_TOKENS`` / ``_BYTES``, unset: off.
        On when a bound is positive (both: the smaller); 0 turns it off.
      log_every: steps between INFO logs of the prefix-cache metrics.
      memory_limit / memory_guarantee: this tenant's share of the pool (see
        :meth:`Pool.set_memory_limit`); changeable at run time through the pool.
      attention: ``auto`` (the Pallas paged-attention kernel for a CUDA cache, the host
        custom call for a host cache), ``host``, ``xla``, ``pallas`` or
        ``pallas-interpret`` (the kernel interpreted).
      overlap: prepare and dispatch step n+1 before waiting for step n's tokens (the
        device feeds them to step n+1); False waits after every step. Same outputs.
      mesh: tensor parallelism: the 1-D mesh of the pool (``Pool(mesh=)`` or
        ``devices=``); default: the pool's. A copy of the model's parameters is placed
        on it by its ``tensor_parallel_plan`` and each device attends over its heads.
        A mesh other than the pool's is a ValueError.
      reload: returns a fresh copy of the model (its checkpoint read again), for waking
        from a level-2 :meth:`sleep`; :meth:`from_pretrained` passes one.
      free_window_blocks: sliding-window layers form their own KV cache groups and give
        back the blocks below their window as sequences advance (``False``: one group,
        every block kept while its sequence runs; the attention is windowed either way).
      command_buffers: on CUDA, run each step as command buffers (CUDA graphs, with its
        branches and layer loop inside them); None: on unless ``XLA_FLAGS`` sets
        ``--xla_gpu_enable_command_buffer`` (see ``runner.compiler_options``).
      fuse_sampling: decode-sized steps sample inside the step program (one dispatch per
        step); None: on CUDA only (see ``ModelRunner``).
    """

    def __init__(
        self,
        model: Any,
        pool: Pool,
        *,
        name: str = "model",
        max_batch: int = 8,
        max_num_batched_tokens: int | None = None,
        max_prefill_tokens: int | None = None,
        max_model_len: int | None = None,
        kv_dtype: Any = None,
        block_size: int = 16,
        tokenizer: Any = None,
        chat_template: ChatTemplate | None = None,
        prefix_caching: bool = True,
        max_cached_tokens: int | None = None,
        eviction: str | EvictionPolicy = "lru",
        host_cache_tokens: int | None = None,
        host_cache_bytes: int | str | None = None,
        log_every: int = 200,
        memory_limit: int | str | None = None,
        memory_guarantee: int | str = 0,
        attention: str = "auto",
        overlap: bool = True,
        mesh: Any = None,
        reload: Callable[[], Any] | None = None,
        free_window_blocks: bool = True,
        command_buffers: bool | None = None,
        fuse_sampling: bool | None = None,
    ) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(
                f"Engine needs a model with config, dtype, __call__(tokens, positions, "
                f"attend) and hf_weights() (jax_kvcached.models.CausalLM), got "
                f"{type(model).__name__}"
            )
        cfg = model.config
        budgets = (max_num_batched_tokens, max_prefill_tokens)
        if max_batch <= 0 or any(b is not None and b <= 0 for b in budgets):
            raise ValueError(
                "max_batch, max_num_batched_tokens and max_prefill_tokens must be positive"
            )
        if mesh is not None and not _same_mesh(mesh, pool.mesh):
            raise ValueError(
                f"Engine mesh {_mesh_text(mesh)} does not match the pool's "
                f"{_mesh_text(pool.mesh)}: create the pool with Pool(mesh=...) of that mesh"
            )
        self.mesh = pool.mesh
        self.config = cfg
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        # KV cache groups: layers of one attention kind and window share a block table.
        layer_groups, windows = kv_cache_groups(cfg.layer_windows())
        if not free_window_blocks:
            layer_groups, windows = (0,) * cfg.num_layers, (0,)  # one group, all kept
        self.cache: KVCache = pool.create_kv_cache(
            name,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype or model.dtype,
            block_size=block_size,
            memory_limit=memory_limit,
            memory_guarantee=memory_guarantee,
            layer_groups=layer_groups,
        )
        self.windows = windows  # each KV cache group's window (0: full attention)
        self.name = name
        self.pool = pool
        try:
            self.runner = ModelRunner(
                model, self.cache, attention, max_batch=max_batch,
                max_num_batched_tokens=max_num_batched_tokens,
                max_prefill_tokens=max_prefill_tokens, max_model_len=self.max_model_len,
                command_buffers=command_buffers, fuse_sampling=fuse_sampling,
            )  # fmt: skip
        except BaseException:
            self.cache.close()  # a model that cannot run here leaves the pool as it was
            raise
        if max_cached_tokens is None:
            max_cached_tokens = pool.config.max_cached_tokens
        if host_cache_tokens is None:
            host_cache_tokens = pool.config.host_cache_tokens
        if host_cache_bytes is None:
            host_cache_bytes = pool.config.host_cache_bytes
        elif not isinstance(host_cache_bytes, int) or isinstance(host_cache_bytes, bool):
            host_cache_bytes = parse_bytes(host_cache_bytes, "host_cache_bytes", allow_zero=True)
        try:
            host_blocks = host_cache_blocks(
                host_cache_tokens, host_cache_bytes, block_size,
                self.cache.block_bytes * self.cache.pages_per_kv_page * len(self.cache.shards),
            )  # fmt: skip
            self.kv = KVManager(
                self.cache, self.max_model_len, prefix_caching=prefix_caching,
                max_cached_tokens=max_cached_tokens, eviction=eviction,
                host_cache_blocks=host_blocks, windows=windows,
            )  # fmt: skip
        except BaseException:
            self.cache.close()
            raise
        self.kv.set_fence(self.runner.token)
        self.scheduler = Scheduler(
            self.kv, max_batch, self.runner.max_num_batched_tokens, self.max_model_len,
            self.runner.max_prefill_tokens, self.runner.decode_budget,
        )  # fmt: skip
        self.max_batch = max_batch
        self.max_num_batched_tokens = self.runner.max_num_batched_tokens
        self.log_every = log_every
        self.overlap = overlap
        self._ids = itertools.count()
        self._by_id: dict[int, Sequence] = {}
        self._inflight: deque[PendingStep] = deque()  # dispatched, oldest first
        self._lock = threading.RLock()  # steps vs. another tenant's reclaim
        self._finished: list[Sequence] = []  # until drain_finished()
        self._rejected: list[Sequence] = []  # rejected while dispatching, for step()
        # Requests that fork a running request's prompt once it is computed (n samples).
        self._forks: dict[int, list[Sequence]] = {}
        self.forks = 0  # children that took their parent's prompt blocks
        self.fork_fallbacks = 0  # children admitted on their own (batch or memory full)
        self.steps = 0
        self._asleep: Any = None  # the offloaded weights while sleeping (sleep.Offloaded)
        self._reload = reload  # a fresh model of the same weights (a level-2 wake)
        pool.set_reclaimer(name, self._reclaim)

    @classmethod
    def from_pretrained(
        cls,
        source: str,
        pool: Pool,
        *,
        dtype: Any = None,
        download: bool = False,
        seed: int = 0,
        **kwargs: Any,
    ) -> Engine:
        """An engine for :func:`jax_kvcached.models.load_pretrained`'s ``source`` (a
        packaged model's name, a preset, a GGUF file or a checkpoint folder) with its
        tokenizer and chat template; ``dtype`` defaults to what the pool's device computes
        well (fp32 on a CPU, bf16 on a GPU). ``kwargs`` go to the constructor."""
        from jax_kvcached.models.pretrained import load_pretrained, weights_dtype

        dtype = dtype or weights_dtype(source, pool.device)
        pre = load_pretrained(source, dtype=dtype, seed=seed, download=download)
        kwargs.setdefault("name", source)
        # a level-2 sleep drops the weights: waking reads the checkpoint again
        kwargs.setdefault("reload", lambda: load_pretrained(source, dtype=dtype, seed=seed).model)
        return cls(pre.model, pool, tokenizer=pre.tokenizer, chat_template=pre.template, **kwargs)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.kv.prefix_cache

    def max_new_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """The tokens a prompt of ``prompt_len`` may generate: ``max_tokens`` checked
        against the room its context leaves (None: all of that room).
        :class:`ContextLengthExceeded` when it asks for more."""
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} and max_tokens asks for {max_tokens}"
            )
        return max_tokens

    # -- requests ----------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int] | Prompt) -> list[int]:
        """Token ids of a prompt, validated (vocabulary, length); raises ValueError
        (:class:`ContextLengthExceeded` for a prompt that leaves no room)."""
        return list(self.prompt(prompt).token_ids)

    def prompt(self, prompt: str | Seq[int] | Prompt) -> Prompt:
        """The validated prompt (see :meth:`encode`); one this engine validated already
        is returned as it is."""
        if isinstance(prompt, Prompt) and prompt.engine is self:
            return prompt
        if isinstance(prompt, Prompt):
            prompt = prompt.token_ids
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs an Engine tokenizer")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token ids out of the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
            )
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt of {len(ids)} tokens leaves no room in max_model_len={self.max_model_len}"
            )
        return Prompt(tuple(ids), self)

    def add_request(
        self,
        prompt: str | Seq[int] | Prompt,
        params: SamplingParams | None = None,
        on_token: Callable[[int, int, bool], None] | None = None,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        fork_of: int | None = None,
        on_logprobs: Callable[[int, Any], None] | None = None,
    ) -> int:
        """Queues a request; ``on_token(request_id, token, finished)`` streams its output.

        Requests share cached prefixes only with the same model, ``cache_salt`` and
        ``adapter_id``. ``fork_of``: an active request with the same prompt (and keys)
        whose prompt is not computed yet; this one then shares its prompt's KV blocks
        instead of computing them (``n`` samples of one prompt: one prefill).
        ``on_logprobs(request_id, (logprob, [(id, logprob)...]))`` streams each token's
        log-probabilities (``params.logprobs``) just before its ``on_token``.
        """
        ids = list(self.prompt(prompt).token_ids)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab = self.config.vocab_size
        if (field := params.outside_vocabulary(vocab)) is not None:
            raise ValueError(f"{field} names token ids outside the vocabulary [0, {vocab})")
        self.max_new_tokens(len(ids), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an Engine tokenizer (token ids: stop_token_ids)")
        if params.top_k >= vocab:  # keeps the whole vocabulary: off
            params = dataclasses.replace(params, top_k=0)
        params = params.seeded()  # an unseeded request gets a fresh seed (reported)
        with self._lock:
            rid = next(self._ids)
            seq = Sequence(rid, ids, params, on_token, on_logprobs=on_logprobs)
            if params.stop:
                seq.detok = TextStream(self.tokenizer.decode, list(params.stop))
            seq.extra = extra_key_bytes(self.name, cache_salt, adapter_id)
            parent = self._by_id.get(fork_of) if fork_of is not None else None
            if (
                parent is not None
                and parent.finish_reason is None
                and parent.num_computed < parent.num_prompt
                and parent.prompt == ids
                and parent.extra == seq.extra
            ):
                self._forks.setdefault(parent.request_id, []).append(seq)
            else:
                self.scheduler.add(seq)
            self._by_id[rid] = seq
        return rid

    def abort(self, request_id: int) -> bool:
        """Drops a queued or running request and frees its blocks; False if it is not
        active. Its ``on_token`` is not called again."""
        with self._lock:
            seq = self._by_id.pop(request_id, None)
            if seq is None:
                return False
            for kids in self._forks.values():  # a fork still waiting for its parent
                if seq in kids:
                    kids.remove(seq)
                    seq.finish_reason = "abort"
                    return True
            self._unfork(request_id)
            return self.scheduler.abort(seq)

    def _unfork(self, parent_id: int) -> None:
        """The forks waiting for a parent that will not compute its prompt (aborted or
        rejected) are admitted on their own."""
        for kid in self._forks.pop(parent_id, []):
            self.scheduler.add(kid)
            self.fork_fallbacks += 1

    def _fork(self, parent: Sequence) -> None:
        """The parent's prompt is computed (by the step just dispatched): its forks
        share its blocks and copy the partial one, ordered after that step."""
        for kid in self._forks.pop(parent.request_id, []):
            copies = None
            if len(self.scheduler.running) < self.max_batch:
                copies = self.kv.fork(parent, kid)
            if copies is None:  # no room in the batch or memory: on its own, later
                self.scheduler.add(kid)
                self.fork_fallbacks += 1
                continue
            for group, src, dst in copies:
                self.runner.copy_block(src, dst, group)
            self.kv.set_fence(self.runner.token)
            self.scheduler.add_running(kid)
            self.forks += 1

    @property
    def num_inflight(self) -> int:
        """Dispatched steps whose results have not been completed."""
        return len(self._inflight)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._inflight) or bool(self._rejected)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

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

    # -- the loop ----------------------------------------------------------------------
    # -- sleep -----------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self._asleep is not None

    @property
    def sleep_level(self) -> int | None:
        return None if self._asleep is None else self._asleep.level

    @property
    def can_reload(self) -> bool:
        """Whether the weights can be read again from a checkpoint (a level-2 sleep)."""
        return self._reload is not None

    def sleep(self, level: int = 1, *, abort: bool = False) -> dict[str, Any]:
        """Gives the device memory back while idle: the requests in flight finish first
        (``abort=True``: they are aborted), idle cached prefixes go to the host tier when
        there is one, every KV block and page is released, and the weights go to host
        memory (level 1: page-locked where the device has it) or are dropped (level 2:
        :meth:`wake` reads the checkpoint again; engines made by :meth:`from_pretrained`).
        The compiled steps stay. Requests added while asleep wait for :meth:`wake`
        (:meth:`run` and :meth:`generate` wake first). The model object the engine was
        built from shares the weights: a sleep deletes them, so that object is unusable
        from then on (the engine holds the weights it wakes with; build another model
        object to run one outside it)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            if self._asleep is not None:
                raise ValueError(f"{self.name!r} is already asleep (level {self.sleep_level})")
            if level == 2 and self._reload is None:
                raise ValueError(
                    "a level-2 sleep drops the weights: only an engine with a reload (as "
                    "Engine.from_pretrained makes) can read them again; use level 1"
                )
            t0 = time.perf_counter()
            if abort:
                for rid in [r for r, s in self._by_id.items() if s.finish_reason is None]:
                    self.abort(rid)
            self.run()
            self.drain()
            # Idle prefixes of every KV cache group (to the host tier, if any).
            spilled = sum(pc.evict(pc.num_evictable_blocks) for pc in self.kv.prefix_caches)
            self.runner.token.block_until_ready()  # (frees wait for the last step)
            self.kv.poll()
            self._asleep = self.runner.offload_weights(level)
            self.pool.publish_sleep(self.name, level)  # (a process group's ctl sees it)
            return {
                "level": level, "weight_bytes": self._asleep.nbytes, "evicted_blocks": spilled,
                "mapped_pages": self.cache.mapped_pages, "seconds": time.perf_counter() - t0,
            }  # fmt: skip

    def wake(self, *, preload_tokens: int = 0) -> dict[str, Any]:
        """Brings the weights back (a copy from host memory, or a reload of the
        checkpoint after a level-2 sleep); nothing compiles. ``preload_tokens``: then
        copies the host tier's most-hit prefixes back, up to that many tokens (per KV
        cache group), so the first requests hit them on the device. KV memory is mapped
        on demand (nothing to do for it here). ValueError when awake; a failed wake
        leaves the engine asleep (retry it)."""
        if isinstance(preload_tokens, bool) or preload_tokens < 0:
            raise ValueError(f"preload_tokens must be >= 0, got {preload_tokens!r}")
        with self._lock:
            if self._asleep is None:
                raise ValueError(f"{self.name!r} is awake")
            t0 = time.perf_counter()
            compiled = self.num_compiled
            model = self._reload() if self._asleep.level == 2 else None
            loaded = time.perf_counter() - t0
            copy = self.runner.restore_weights(self._asleep, model)
            level, self._asleep = self._asleep.level, None
            self.pool.publish_sleep(self.name, 0)
            t1 = time.perf_counter()
            blocks = self.kv.preload(preload_tokens)  # per KV cache group
            return {
                "level": level, "reload_s": loaded, "weights_s": copy,
                "preload_s": time.perf_counter() - t1,
                "preloaded_tokens": blocks[0] * self.cache.block_size,
                "preloaded_blocks": sum(blocks),
                "compiled": self.num_compiled - compiled,
                "seconds": time.perf_counter() - t0,
            }  # fmt: skip

    def step(self) -> list[Sequence]:
        """Advances the pipeline: dispatches the next step (the host prepares it while the
        device runs the previous one), then completes the previous step. Returns the
        sequences that finished, and those rejected (finish_reason "error", ``error``
        says why: they can never fit). A sleeping engine steps nothing."""
        if self._asleep is not None:
            return []
        new = self.dispatch() if self.scheduler.has_work else None
        rejected, self._rejected = self._rejected, []
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
            self.kv.poll()
            out = self.scheduler.schedule()
            for s in out.rejected:  # it can never fit: dropped, reported by step()
                self._by_id.pop(s.request_id, None)
                self._finished.append(s)
                self._unfork(s.request_id)
            self._rejected += out.rejected
            if not out.scheduled:
                return None
            # The builder decides which rows sample, their logit entries and targets.
            prepared = self.runner.builder.prepare(out)
            _, tokens = self.runner.execute(prepared)
            self.kv.set_fence(self.runner.token)  # frees wait for this step from now on
            self.steps += 1
            for x in out.scheduled:
                s = x.seq
                self.kv.computed(s, x.end)
                if s.request_id in self._forks and s.num_computed >= s.num_prompt:
                    self._fork(s)
            for s, i in prepared.sampling:
                s.num_pending += 1
                s.last_row = i
            if self.prefix_cache and self.steps % self.log_every == 0:
                self.prefix_cache.log_stats()
            step = PendingStep([s for s, _ in prepared.sampling],
                               tokens if prepared.sampling else None,
                               [i for _, i in prepared.sampling])  # fmt: skip
            step.logprobs = self.runner.last_logprobs
            if prepared.scored and self.runner.last_scores is not None:
                step.scores, step.scored = self.runner.last_scores, prepared.scored
            self._inflight.append(step)
            return step

    def complete(self, step: PendingStep | None) -> list[Sequence]:
        """Waits for a dispatched step's tokens (the oldest in flight), streams them and
        finishes sequences."""
        if step is None:
            return []
        with self._lock:
            if not self._inflight or step is not self._inflight[0]:
                raise RuntimeError("this step is not the engine's oldest dispatched step")
            self._inflight.popleft()
            if step.scores is not None:
                self._take_scores(step)
            if step.tokens is None:
                return []
            host = self.runner.fetch(step.tokens)
            lps = None
            if step.logprobs is not None:
                lps = [self.runner.fetch(a) for a in step.logprobs]
            ops.raise_device_errors(self.cache)  # (a host sync point: cheap here)
            now = time.perf_counter()
            done = []
            eos = self.config.eos_ids
            for s, row in zip(step.sequences, step.rows, strict=True):
                s.num_pending -= 1
                if s.finish_reason is not None:  # aborted or finished while in flight
                    continue
                tok = int(host[row])
                s.token_ids.append(tok)
                if s.logprobs is not None and lps is not None:
                    k = s.params.logprobs
                    top = _alternatives(lps[1][row], lps[2][row], k)
                    s.logprobs.append((float(lps[0][row]), top))
                    if s.on_logprobs is not None:
                        s.on_logprobs(s.request_id, s.logprobs[-1])
                if s.first_token_time is None:
                    s.first_token_time = now
                if s.blocks:  # a block that held this pending token can be cached now
                    self.kv.computed(s, s.num_computed)
                if s.detok is not None:
                    s.detok.feed(tok)
                reason = None
                if tok in s.params.stop_token_ids or (tok in eos and not s.params.ignore_eos):
                    reason = "stop"
                elif s.detok is not None and s.detok.stopped:
                    reason = "stop"
                elif len(s.token_ids) - s.num_prompt >= s.params.max_tokens:
                    reason = "length"
                elif len(s.token_ids) >= self.max_model_len:
                    reason = "length"
                if reason:
                    self.scheduler.finish(s, reason)
                    self._by_id.pop(s.request_id, None)
                    done.append(s)
                if s.on_token is not None:
                    s.on_token(s.request_id, tok, reason is not None)
            self._finished.extend(done)
            return done

    def _take_scores(self, step: PendingStep) -> None:
        """Stores the prompt log-probabilities a step computed (by position: a
        recomputation after preemption writes the same entries)."""
        scores = self.runner.fetch(step.scores)
        top = (scores.shape[0] - 1) // 2
        for s, first, start, n in step.scored:
            k = s.params.logprobs or 0
            for j in range(n):
                pos = start + 1 + j  # the token this position's logits predict
                if pos < s.num_prompt:
                    col = scores[:, first + j]
                    alts = _alternatives(col[1 : 1 + top], col[1 + top :], k)
                    s.prompt_logprobs[pos] = (float(col[0]), alts)

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

    def generate(
        self,
        prompts: PromptLike | Seq[PromptLike],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        on_token: Callable[[int, int, bool], None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (batched continuously); outputs in prompt order.

        ``prompts``: a list of prompts (strings, token-id lists), or one prompt (a string
        or a flat list of token ids), as the OpenAI ``prompt`` field reads them; one
        prompt gives a list of one output. The first call compiles the step shapes it
        meets (seconds each): :meth:`compile` compiles all of them up front."""
        prompts = _as_prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        encoded = [self.encode(p) for p in prompts]  # validate all before queueing any
        ids = [
            self.add_request(e, q, on_token, cache_salt=cache_salt)
            for e, q in zip(encoded, params, strict=True)
        ]
        self.run()
        wanted = set(ids)
        with self._lock:
            by_id = {s.request_id: s for s in self._finished if s.request_id in wanted}
            self._finished = [s for s in self._finished if s.request_id not in wanted]
        for rid in ids:
            if by_id[rid].error is not None:  # rejected: it can never fit
                raise by_id[rid].error
        out = []
        for rid in ids:
            s = by_id[rid]
            out.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=s.prompt,
                    token_ids=s.output,
                    finish_reason=s.finish_reason or "",
                    ttft_s=s.ttft or 0.0,
                    latency_s=time.perf_counter() - s.arrival,
                    preemptions=s.preemptions,
                    cached_tokens=s.cached_tokens,
                    seed=s.params.seed,
                    text=_text(self.tokenizer, s),
                    logprobs=s.logprobs,
                    prompt_logprobs=s.prompt_logprobs,
                )
            )
        return out

    def chat(
        self,
        messages: Seq[dict[str, str]] | Seq[Seq[dict[str, str]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Answers a conversation (a list of ``{"role", "content"}`` messages), or each of
        a list of them, through the model's chat template; outputs in order. ``kwargs``
        go to :meth:`generate`."""
        if self.tokenizer is None:
            raise ValueError("Engine.chat needs an Engine tokenizer (Engine.from_pretrained)")
        if isinstance(messages, dict) or not messages:
            raise TypeError("chat takes a list of {'role', 'content'} messages, or a list of those")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        template = self.chat_template or ChatTemplate()
        prompts = [
            self.tokenizer.encode(template.render(list(c)), add_special_tokens=False) for c in convs
        ]  # (the rendered template brings its own special tokens)
        return self.generate(prompts, params, **kwargs)

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
            "tensor_parallel": self.cache.tensor_parallel,
            "limit_bytes": lim.limit_bytes,
            "guarantee_bytes": lim.guarantee_bytes,
            "prefix_cache": self.kv.stats(),
            "host_cache": self.kv.host_stats(),
            "kv_cache_groups": self.kv.group_stats(),
            "sleeping": self.sleeping,
            "sleep_level": self.sleep_level,
        }

    def close(self) -> None:
        with self._lock:
            self.pool.set_reclaimer(self.name, None)
            self.kv.close()
            self.cache.close()
