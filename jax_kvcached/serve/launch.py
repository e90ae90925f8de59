"""``jax-kvcached serve``: builds the models' engines on one pool and runs the server."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from jax_kvcached.engine.config import EngineConfig
from jax_kvcached.engine.engine import Engine
from jax_kvcached.memory.config import ipc_name_from_env, parse_bytes
from jax_kvcached.memory.pool import Pool, device_memory_bytes
from jax_kvcached.models.chat_template import ChatTemplate
from jax_kvcached.progress import Log
from jax_kvcached.serve.adapters import load as load_adapter
from jax_kvcached.serve.adapters import parse_spec
from jax_kvcached.serve.compile_cache import enable_compile_cache
from jax_kvcached.serve.config import DTYPES, ServeConfig
from jax_kvcached.serve.context import ServedModel

log = logging.getLogger("jax_kvcached.serve")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # a packaged model, a built-in preset, a .gguf file or a checkpoint folder
    limit: int | str | None = None
    guarantee: int | str = 0


def parse_pairs(items: list[str], what: str) -> dict[str, str]:
    """``["a=x", "b=y"]`` -> ``{"a": "x", "b": "y"}``; ValueError on a bad item."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what} must look like NAME=VALUE, got {item!r}")
        if name in out:
            raise ValueError(f"{what}: {name!r} is given twice")
        out[name] = value
    return out


def default_name(source: str) -> str:
    """The served name of ``--model SOURCE`` given without ``NAME=``: a packaged model's
    or preset's own name, else the file's or folder's name without ``.gguf``."""
    base = os.path.basename(os.path.normpath(source)) or source
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def parse_specs(
    models: list[str], limits: list[str], guarantees: list[str], served_name: str | None = None
) -> list[ModelSpec]:
    """``--model [NAME=]SOURCE`` (repeatable), ``--limit``, ``--guarantee`` and
    ``--served-model-name`` (one model only) as specs; ValueError naming the flag."""
    named = [m if "=" in m else f"{default_name(m)}={m}" for m in models]
    srcs = parse_pairs(named, "--model")
    if served_name is not None:
        if len(srcs) != 1:
            raise ValueError("--served-model-name names one --model; use NAME=MODEL for several")
        srcs = {served_name: next(iter(srcs.values()))}
    lims, gs = parse_pairs(limits, "--limit"), parse_pairs(guarantees, "--guarantee")
    for what, d in (("--limit", lims), ("--guarantee", gs)):
        for name, v in d.items():
            if name not in srcs:
                raise ValueError(f"{what} names {name!r}, which is not a --model")
            parse_bytes(v, what, allow_zero=True)
    return [ModelSpec(n, s, lims.get(n), gs.get(n, 0)) for n, s in srcs.items()]


def pick_devices(tensor_parallel: int, devices: str | None, backend: str) -> list | None:
    """The devices of ``serve --tensor-parallel N --devices I,J,...`` (None: one device,
    the pool's default). Raises ValueError naming the flag on a bad value
    (``tensor_parallel`` >= 1: :class:`ServeConfig` checked it)."""
    import jax

    if devices is None and tensor_parallel == 1:
        return None
    avail = jax.devices("cpu") if backend == "host" else jax.devices()
    if devices is None:
        idx = list(range(tensor_parallel))
    else:
        try:
            idx = [int(x) for x in devices.split(",")]
        except ValueError:
            raise ValueError(f"--devices takes comma-separated indices, got {devices!r}") from None
        if tensor_parallel not in (1, len(idx)):
            raise ValueError(
                f"--devices lists {len(idx)} devices but --tensor-parallel is {tensor_parallel}"
            )
    if len(set(idx)) != len(idx) or any(not 0 <= i < len(avail) for i in idx):
        raise ValueError(
            f"--devices / --tensor-parallel: need distinct indices in [0, {len(avail)}) "
            f"({len(avail)} {avail[0].platform} device(s) visible), got {idx}"
        )
    return [avail[i] for i in idx]


def generation_defaults(
    pretrained_defaults: dict[str, float], generation_config: str, overrides: dict[str, float]
) -> dict[str, float]:
    """The sampling a request that omits a field gets: ``generation_config`` "auto" (the
    checkpoint's generation config), "openai" (none: OpenAI's defaults) or a folder with
    a ``generation_config.json``; then the operator's ``--default-*`` overrides."""
    from jax_kvcached.models import generation_config as read_generation_config

    if generation_config == "auto":
        out = dict(pretrained_defaults)
    elif generation_config == "openai":
        out = {}
    elif os.path.isdir(generation_config):
        out = read_generation_config(generation_config)
    else:
        raise ValueError(
            f"--generation-config must be auto, openai or a folder, got {generation_config!r}"
        )
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


def build_served(
    spec: ModelSpec,
    pool: Pool,
    engine: EngineConfig,
    *,
    seed: int,
    dtype: str = "auto",
    chat_template: str | None = None,
    generation_config: str = "auto",
    default_sampling: dict[str, float] | None = None,
    quantization: str = "auto",
) -> ServedModel:
    """An engine (of ``engine``'s settings, named and limited by ``spec``) for a
    packaged model (``smollm2-135m``: downloaded on first use), a built-in random preset,
    a GGUF file or a local Hugging Face checkpoint folder. ``dtype`` "auto": what the
    pool's device computes well (fp32 on a CPU, bf16 on a GPU). ``chat_template``: a
    Jinja file replacing the checkpoint's."""
    import jax.numpy as jnp

    from jax_kvcached.models import check_source, fetch, load_pretrained, weights_dtype

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    kind = check_source(spec.source)  # (checked before the port opened, too)
    if kind == "builtin":
        where = "a built-in random preset"
    elif kind == "packaged":
        where = fetch(spec.source, log=log.info)
    else:
        where = spec.source
    dt = weights_dtype(spec.source, pool.device) if dtype == "auto" else dtype
    quant = None if quantization == "auto" else quantization
    log.info("loading %s from %s (%s, quantization %s)", spec.name, where, jnp.dtype(dt).name,
             quantization)  # fmt: skip
    pre = load_pretrained(spec.source, dtype=dt, seed=seed, quantization=quant)
    # A checkpoint without a template serves no chat (a preset's plain one is its own).
    template = pre.template if pre.chat_template is not None or not pre.path else None
    if template is None and chat_template is None:
        log.warning("%s has no chat template: /v1/chat/completions answers 400 for it "
                    "(use /v1/completions, or --chat-template FILE)", spec.name)  # fmt: skip
    if chat_template is not None:
        try:
            with open(chat_template, encoding="utf-8") as f:
                template = ChatTemplate(f.read(), **pre.special_tokens)
        except OSError as e:
            raise ValueError(f"--chat-template {chat_template}: {e.strerror}") from None
    settings = engine.replace(name=spec.name, memory_limit=spec.limit,
                              memory_guarantee=spec.guarantee)  # fmt: skip
    served = Engine(pre.model, pool, settings, tokenizer=pre.tokenizer,
                    chat_template=template or pre.template)  # (the library's fallback)
    defaults = generation_defaults(pre.generation, generation_config, default_sampling or {})
    if defaults:
        log.info("%s: sampling defaults for omitted fields: %s", spec.name, defaults)
    return ServedModel(served, pre.tokenizer, template, defaults=defaults)


def warm_up(
    served: ServedModel, name: str, out: Log | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> float:  # fmt: skip
    """Compiles every program the engine can run (a progress bar with an ETA, a log
    line), so a served run compiles nothing later; returns the seconds taken."""
    out = out or Log(quiet=False)

    def progress(done: int, total: int) -> None:
        out.progress(name, done, total, "compiled", every=1)  # a line per program
        if on_progress is not None:
            on_progress(done, total)

    done = served.engine.compile(progress=progress)
    log.info(
        "%s: %d programs ready (%d step shapes, the rest samplers and logit functions) in "
        "%.1f s: %d stored executables loaded, %d compiled by XLA, %d from the compilation "
        "cache", name, done["programs"], done["shapes"], done["seconds"],
        done["executables_loaded"], done["xla_compiles"], done["cache_loads"],
    )  # fmt: skip
    return done["seconds"]


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the (long) warm-up so a busy port
    fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: ServeConfig) -> None:
    """Binds the port and answers at once (``/health`` reports the warm-up), loads and
    compiles the models in the background, then serves until SIGINT / SIGTERM. On the
    signal it stops accepting connections and requests, lets in-flight requests finish
    for up to ``config.shutdown_timeout`` seconds, cancels the rest (an error event each,
    blocks freed) and returns. A model that fails to load stops the server with its
    error; a bad setting is a ValueError before the port opens."""
    import uvicorn

    from jax_kvcached.models import check_source
    from jax_kvcached.serve import distributed
    from jax_kvcached.serve.app import create_app
    from jax_kvcached.serve.loop import ServingLoop
    from jax_kvcached.serve.startup import Startup, StartupGate

    c = config
    specs = parse_specs(c.model_sources, c.limit, c.guarantee, c.served_model_name)
    for spec in specs:  # a missing file or a mistyped name, before anything listens
        try:
            check_source(spec.source)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--model {spec.name}={spec.source}: {e}") from None
    for text in c.lora_modules:  # (their folders read at load; the form checked here)
        lora = parse_spec(text)
        if not os.path.isfile(os.path.join(lora.path, "adapter_config.json")):
            raise FileNotFoundError(f"--lora-modules {lora.name}: {lora.path!r} is not a PEFT "
                                    "adapter folder (no adapter_config.json)")  # fmt: skip
    auth = c.auth()
    host, port, shutdown_timeout, log_level = c.host, c.port, c.shutdown_timeout, c.log_level
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("jax_kvcached").setLevel(log_level.upper())
    logging.getLogger("uvicorn").setLevel(max(logging.WARNING, logging.getLogger().level))
    if not c.access_log:
        logging.getLogger("jax_kvcached.access").setLevel(logging.WARNING)
    channel = None
    if c.node_rank > 0:  # a follower: no HTTP
        channel = distributed.connect(c)
        distributed.initialize(c)
        return _follow(c, specs, channel)
    sock = bind_socket(host, port)
    if c.nnodes > 1:
        try:
            channel = distributed.connect(c)  # (every rank there, flags checked)
            distributed.initialize(c)
        except BaseException:
            sock.close()
            raise
    try:  # what can be checked in a moment fails before the server starts
        pool = _pool(c.memory, c.backend, c.page_size, c.tensor_parallel, c.devices, c.group,
                     c.nnodes)  # fmt: skip
    except BaseException:
        sock.close()
        raise
    group = pool.group
    state = Startup()
    gate = StartupGate(state)
    held: dict[str, Any] = {"loop": None, "error": None, "leader": None}

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            loop = held["loop"]
            if first and loop is not None:
                log.info("shutting down: in-flight requests get %.1f s", shutdown_timeout)
                threading.Thread(
                    target=loop.shutdown, args=(shutdown_timeout,), daemon=True
                ).start()

    config = uvicorn.Config(
        gate, host=host, port=port, log_level="warning", lifespan="off", log_config=None,
        timeout_graceful_shutdown=shutdown_timeout + 1,  # a backstop: the loop ends first
        limit_concurrency=c.max_connections,  # past it, 503 (no socket or task pile-up)
    )  # fmt: skip
    server = GracefulServer(config)

    def load() -> None:
        try:
            models = _load(specs, state, pool, c)
            if channel is not None:  # rank 0: every step reaches the followers first
                leader = held["leader"] = channel
                models = {n: dataclasses.replace(m, engine=distributed.MirroredEngine(
                    m.engine, leader)) for n, m in models.items()}  # fmt: skip
            freeze_start_up_heap()
            loop = ServingLoop(
                {n: m.engine for n, m in models.items()}, max_queue=c.max_queue,
                idle_sleep_s=c.idle_sleep, max_awake=c.max_awake, sleep_level=c.sleep_level,
                preload_tokens=c.preload_tokens,
            )  # fmt: skip
            held["loop"] = loop.start()
            if c.nnodes > 1:
                held["leader"].watch(lambda rank, why: _rank_lost(loop, rank, why))
            if server.should_exit:  # a signal came during the warm-up
                return
            gate.open(create_app(
                loop, models, auth=auth, max_body_bytes=c.max_body_bytes,
                allowed_origins=c.origins, allowed_hosts=c.hosts, access_log=c.access_log,
            ))  # fmt: skip
            log.info(
                "serving %s on http://%s:%d (pool %.0f MiB on %s%s%s)",
                ", ".join(models), host, port, pool.memory_limit / 2**20, pool.backend,
                f", shared with process group {group!r}" if group else "",
                f", per device, tensor parallel over {pool.tensor_parallel}"
                if pool.tensor_parallel > 1 else "",
            )  # fmt: skip
        except BaseException as e:  # reported by serve() once the server has stopped
            held["error"] = e
            state.error = str(e)
            server.should_exit = True

    log.info("listening on http://%s:%d; GET /health reports the start-up", host, port)
    loader = threading.Thread(target=load, name="kvcached-load", daemon=True)
    # uvicorn re-raises the signal it handled once it is done: make that a no-op so a
    # graceful shutdown exits 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in _SIGNALS}
    try:
        loader.start()
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
        stopped = held["loop"] is None or held["loop"].stop(timeout=1.0)
        if held["leader"] is not None:
            held["leader"].close()  # the followers stop with rank 0
        busy = loader.is_alive() or not stopped
        if not busy:
            pool.close()
    if held["error"] is not None:
        raise held["error"]
    if busy:
        # A compile (of the warm-up, or of a step) is still running and would hold the
        # process past its shutdown deadline: every request has had its answer, so exit
        # now; the OS takes the pool's memory back.
        log.info("a compile is still running: exiting without waiting for it")
        logging.shutdown()
        os._exit(0)


def _rank_lost(loop: Any, rank: int, why: str) -> None:
    """A follower of a server across hosts is gone: every request fails, the server
    exits (status 1) without waiting for a step stuck in a collective."""
    from jax_kvcached.serve import distributed

    reason = f"rank {rank} of the server across hosts is gone ({why}); the server stops"
    log.error(reason)
    loop.fail_all(reason)
    distributed.exit_soon()


def _follow(c: ServeConfig, specs: list[ModelSpec], channel: Any) -> None:
    """A follower rank: the same pool and engine as rank 0, no HTTP; runs rank 0's steps."""
    from jax_kvcached.serve import distributed
    from jax_kvcached.serve.startup import Startup

    pool = _pool(c.memory, c.backend, c.page_size, c.tensor_parallel, c.devices, c.group,
                 c.nnodes)  # fmt: skip
    try:
        models = _load(specs, Startup(), pool, c)
        distributed.follow(c, channel, next(iter(models.values())).engine)
    except BaseException:
        distributed.exit_soon(5.0)  # (a step stuck in a collective: not waited for)
        raise
    pool.close()


def _pool(
    memory: str | None, backend: str, page_size: str | None, tensor_parallel: int,
    devices: str | None, group: str | None, nnodes: int = 1,
) -> Pool:  # fmt: skip
    """The server's pool; ValueError naming the flag on a bad size or device choice.
    Across hosts (``nnodes`` > 1): every process's devices."""
    if nnodes > 1:
        import jax

        picked = jax.devices()
        if tensor_parallel not in (1, len(picked)) or devices is not None:
            raise ValueError(f"--nnodes {nnodes}: the model spans all {len(picked)} devices of "
                             "the ranks (--tensor-parallel 1 or that many; no --devices)")
        local = [d for d in picked if d.process_index == jax.process_index()]
        return _checked_pool(memory, backend, page_size, picked, local, group)
    picked = pick_devices(tensor_parallel, devices, backend)  # None: the default device
    return _checked_pool(memory, backend, page_size, picked, picked, group)


def _checked_pool(memory: str | None, backend: str, page_size: str | None, picked: Any,
                  local: Any, group: str | None) -> Pool:  # fmt: skip
    """A pool on ``picked`` whose budget fits each of the ``local`` devices."""
    group = group or ipc_name_from_env()
    if memory is None and group is None:
        memory = "1GiB"
    if memory is not None:
        nbytes, device = parse_bytes(memory, "--memory"), device_memory_bytes(backend, local)
        if nbytes > device:
            raise ValueError(
                f"--memory ({nbytes / 2**30:.1f} GiB) exceeds the memory of the device "
                f"({device / 2**30:.1f} GiB)"
            )
    return Pool(memory, page_size=page_size, backend=backend, devices=picked, group=group)


def _load(
    specs: list[ModelSpec], state: Any, pool: Pool, c: ServeConfig
) -> dict[str, ServedModel]:
    """The served models, loaded and (unless ``--no-warmup``) compiled; progress goes to
    ``state`` for /health."""
    cache_dir = enable_compile_cache(c.compile_cache)
    log.info("compilation cache: %s", cache_dir or "off")
    models: dict[str, ServedModel] = {}
    for i, spec in enumerate(specs):
        served = build_served(
            spec, pool, c.engine, seed=c.seed + i, dtype=c.dtype, chat_template=c.chat_template,
            generation_config=c.generation_config, default_sampling=c.default_sampling,
            quantization=c.quantization,
        )  # fmt: skip
        models[spec.name] = dataclasses.replace(
            served, reasoning_parser=c.reasoning_parser,
            constrain_thought=c.structured_outputs_in_reasoning,
            tool_parser=c.tool_call_parser if c.enable_auto_tool_choice else None,
        )  # fmt: skip
        if hc := models[spec.name].engine.stats()["host_cache"]:
            log.info(
                "%s: host tier of %d tokens (%.1f MiB%s)", spec.name, hc["capacity_tokens"],
                hc["capacity_bytes"] / 2**20, ", page-locked" if hc["pinned_memory"] else "",
            )  # fmt: skip
    for text in c.lora_modules:  # (--enable-lora: the adapters named at start)
        try:
            adapter = load_adapter(models, parse_spec(text))
        except ValueError as e:
            raise ValueError(f"--lora-modules: {e}") from None
        log.info("LoRA adapter %s: rank %d, %s", adapter.name, adapter.rank, adapter.path)
    if c.warmup:
        # /health counts every model's programs: earlier models' totals stay added.
        base = [0, 0]
        for name, m in models.items():

            def report(done: int, total: int, base: list = base) -> None:
                state.progress(base[0] + done, base[1] + total)

            warm_up(m, name, on_progress=report)
            base[0], base[1] = state.compiled, state.total
    return models


def freeze_start_up_heap() -> int:
    """Moves every object alive after the start-up (models, compiled programs, JAX's
    caches: some 300k for SmolLM2) out of the garbage collector's scans (``gc.freeze``),
    as vLLM does: a full collection while serving walked them all, a pause of up to
    0.5 s between two steps on 2 cores. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("the garbage collector skips %d start-up objects from now on", frozen)
    return frozen


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
