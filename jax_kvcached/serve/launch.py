"""``jax-kvcached serve``: builds the models' engines on one pool and runs the server."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading

from jax_kvcached.engine.engine import Engine
from jax_kvcached.memory.config import ipc_name_from_env, parse_bytes
from jax_kvcached.memory.pool import Pool, device_memory_bytes
from jax_kvcached.progress import Log
from jax_kvcached.serve.auth import AuthConfig
from jax_kvcached.serve.chat_template import ChatTemplate
from jax_kvcached.serve.context import ServedModel

log = logging.getLogger("jax_kvcached.serve")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # a built-in preset or a checkpoint directory
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


def parse_specs(models: list[str], limits: list[str], guarantees: list[str]) -> list[ModelSpec]:
    srcs = parse_pairs(models, "--model")
    lims, gs = parse_pairs(limits, "--limit"), parse_pairs(guarantees, "--guarantee")
    for what, d in (("--limit", lims), ("--guarantee", gs)):
        for name, v in d.items():
            if name not in srcs:
                raise ValueError(f"{what} names {name!r}, which is not a --model")
            parse_bytes(v, what, allow_zero=True)
    return [ModelSpec(n, s, lims.get(n), gs.get(n, 0)) for n, s in srcs.items()]


def pick_devices(tensor_parallel: int, devices: str | None, backend: str) -> list | None:
    """The devices of ``serve --tensor-parallel N --devices I,J,...`` (None: one device,
    the pool's default). Raises ValueError naming the flag on a bad value."""
    import jax

    if tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be >= 1, got {tensor_parallel}")
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


def build_served(
    spec: ModelSpec,
    pool: Pool,
    *,
    max_batch: int,
    seed: int,
    dtype: object = None,
    **engine_kw: object,
) -> ServedModel:
    """An engine for a packaged model (``smollm2-135m``), a built-in random preset, a GGUF
    file or a local Hugging Face checkpoint folder."""
    from jax_kvcached.models import (
        BUILTIN_CONFIGS,
        PRETRAINED,
        ByteTokenizer,
        build_model,
        load_pretrained,
    )

    if spec.source in BUILTIN_CONFIGS:
        model = build_model(BUILTIN_CONFIGS[spec.source], seed=seed)
        tokenizer, template = ByteTokenizer(), ChatTemplate()
    elif spec.source in PRETRAINED or os.path.exists(spec.source):
        pre = load_pretrained(spec.source, dtype=dtype)
        model, tokenizer = pre.model, pre.tokenizer
        template = ChatTemplate.from_source(pre.chat_template, pre.special_tokens, pre.path)
    else:
        raise ValueError(
            f"--model {spec.name}={spec.source}: neither a packaged model "
            f"({', '.join(sorted(PRETRAINED))}), a built-in random one "
            f"({', '.join(sorted(BUILTIN_CONFIGS))}), a .gguf file nor a checkpoint directory"
        )
    engine = Engine(
        model, pool, name=spec.name, max_batch=max_batch, tokenizer=tokenizer,
        memory_limit=spec.limit, memory_guarantee=spec.guarantee, **engine_kw,
    )  # fmt: skip
    return ServedModel(engine, tokenizer, template)


def warm_up(served: ServedModel, name: str, out: Log | None = None) -> float:
    """Compiles every step shape the engine can use (a progress bar, a log line), so a
    served run compiles nothing later; returns the seconds taken."""
    out = out or Log(quiet=False)
    done = served.engine.compile(progress=lambda d, n: out.progress(name, d, n, "compiled"))
    log.info(
        "%s: %d step shapes and %d samplers compiled in %.1f s",
        name, done["shapes"], done["samplers"], done["seconds"],
    )  # fmt: skip
    return done["seconds"]


COMPILE_CACHE_ENV = "KVCACHED_COMPILE_CACHE"


def default_compile_cache() -> str:
    """``$KVCACHED_COMPILE_CACHE``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``) +
    ``/jax-kvcached/xla``."""
    if os.environ.get(COMPILE_CACHE_ENV):
        return os.environ[COMPILE_CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-kvcached", "xla")


def enable_compile_cache(path: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache in ``path`` (None: the default; "off"
    or "": disabled), so a second start loads its compiled steps instead of compiling
    them; returns the directory used."""
    import jax

    path = default_compile_cache() if path is None else path
    if path in ("", "off", "none"):
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


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


def serve(
    specs: list[ModelSpec],
    *,
    memory: str | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "auto",
    page_size: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    max_cached_tokens: int | None = None,
    eviction: str = "lru",
    seed: int = 0,
    warmup: bool = True,
    compile_cache: str | None = None,
    auth: AuthConfig | None = None,
    shutdown_timeout: float = 10.0,
    max_body_bytes: int = 1 << 20,
    tensor_parallel: int = 1,
    devices: str | None = None,
    host_cache_tokens: int | None = None,
    host_cache_bytes: int | None = None,
    group: str | None = None,
) -> None:
    """Builds the engines and serves until SIGINT / SIGTERM. On the signal it stops
    accepting connections and requests, lets in-flight requests finish for up to
    ``shutdown_timeout`` seconds, cancels the rest (an error event each, blocks freed)
    and returns."""
    import uvicorn

    from jax_kvcached.serve.app import create_app
    from jax_kvcached.serve.loop import ServingLoop

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)  # type: ignore[arg-type]
            if first:
                log.info("shutting down: in-flight requests get %.1f s", shutdown_timeout)
                threading.Thread(
                    target=loop.shutdown, args=(shutdown_timeout,), daemon=True
                ).start()

    import jax.numpy as jnp

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sock = bind_socket(host, port)
    cache_dir = enable_compile_cache(compile_cache)
    log.info("compilation cache: %s", cache_dir or "off")
    picked = pick_devices(tensor_parallel, devices, backend)  # None: the default device
    group = group or ipc_name_from_env()
    if memory is None and group is None:
        memory = "1GiB"
    if memory is not None:
        nbytes, device = parse_bytes(memory, "--memory"), device_memory_bytes(backend, picked)
        if nbytes > device:
            raise ValueError(
                f"--memory ({nbytes / 2**30:.1f} GiB) exceeds the memory of the device "
                f"({device / 2**30:.1f} GiB)"
            )
    pool = Pool(memory, page_size=page_size, backend=backend, devices=picked, group=group)
    # Trained weights: bf16 on a GPU; fp32 on the CPU, where XLA emulates bf16 matmuls.
    dtype = jnp.bfloat16 if pool.backend == "cuda" else jnp.float32
    models: dict[str, ServedModel] = {}
    try:
        for i, spec in enumerate(specs):
            models[spec.name] = build_served(
                spec, pool, max_batch=max_batch, seed=seed + i, dtype=dtype,
                max_cached_tokens=max_cached_tokens, eviction=eviction,
                host_cache_tokens=host_cache_tokens, host_cache_bytes=host_cache_bytes,
            )  # fmt: skip
            if hc := models[spec.name].engine.stats()["host_cache"]:
                log.info(
                    "%s: host tier of %d tokens (%.1f MiB%s)", spec.name, hc["capacity_tokens"],
                    hc["capacity_bytes"] / 2**20, ", page-locked" if hc["pinned_memory"] else "",
                )  # fmt: skip
            if warmup:
                warm_up(models[spec.name], spec.name)
        loop = ServingLoop({n: m.engine for n, m in models.items()}, max_queue=max_queue)
        app = create_app(loop, models, auth=auth, max_body_bytes=max_body_bytes)
        log.info(
            "serving %s on http://%s:%d (pool %.0f MiB on %s%s%s)",
            ", ".join(models), host, port, pool.memory_limit / 2**20, pool.backend,
            f", shared with process group {group!r}" if group else "",
            f", per device, tensor parallel over {pool.tensor_parallel}"
            if pool.tensor_parallel > 1 else "",
        )  # fmt: skip
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning",
            timeout_graceful_shutdown=shutdown_timeout + 5,  # a backstop: the loop ends first
        )  # fmt: skip
        # uvicorn re-raises the signal it handled once it is done: make that a no-op so
        # a graceful shutdown exits 0.
        previous = {s: signal.signal(s, lambda *_: None) for s in _SIGNALS}
        try:
            with loop:
                GracefulServer(config).run(sockets=[sock])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        sock.close()
        pool.close()


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
