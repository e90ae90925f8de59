"""ServeConfig: the server's settings, each rule validated once; ``serve`` takes one.

Its fields, and the :class:`~jax_kvcached.engine.config.EngineConfig` it holds for every
served model, carry their flags: ``jax-kvcached serve``'s options are generated from them
(:func:`~jax_kvcached.engine.config.add_cli_args`). Light to import: no JAX.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, ClassVar

from jax_kvcached.engine.config import ConfigError, EngineConfig, option, to_cli_args
from jax_kvcached.serve.reasoning import PARSERS as REASONING_PARSERS
from jax_kvcached.serve.tools import PARSERS as TOOL_PARSERS

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What ``serve`` runs: the models, the pool, the HTTP server, sleep, auth."""

    # ``serve --help``'s sections (every command-line field is in one).
    CLI_SECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "models": ("models", "served_model_name", "dtype", "quantization", "chat_template",
                   "generation_config", "default_temperature", "default_top_p",
                   "default_top_k", "default_repetition_penalty", "seed"),
        "memory (the pool and each model's share)": (
            "memory", "group", "limit", "guarantee", "backend", "page_size"),
        "devices and hosts": ("tensor_parallel", "devices", "nnodes", "node_rank",
                              "dist_init_addr", "dist_timeout", "dist_secret_file"),
        "sleep (idle models give their memory back)": (
            "idle_sleep", "max_awake", "sleep_level", "preload_tokens"),
        "start-up": ("warmup", "compile_cache"),
        "HTTP server": ("host", "port", "max_queue", "max_connections", "shutdown_timeout",
                        "log_level", "access_log", "allowed_origins", "allowed_hosts"),
        "keys and tenants": ("api_key", "api_key_file", "tenant_keys_file", "admin_key",
                             "admin_key_file", "allow_unauthenticated_admin"),
        "tools and reasoning (chat)": ("enable_auto_tool_choice", "tool_call_parser",
                                       "reasoning_parser",
                                       "structured_outputs_in_reasoning"),
        "LoRA adapters (see also: engine: LoRA adapters)": ("enable_lora", "lora_modules"),
    }  # fmt: skip

    models: list[str] = option(
        [],
        "a served model (repeatable): smollm2-135m, a random preset (tiny-llama, tiny-qwen2), "
        "a .gguf file or a checkpoint dir; NAME defaults to the model's own name (default: "
        "smollm2-135m)",
        flag="--model", metavar="[NAME=]MODEL", append=True,
    )  # fmt: skip
    served_model_name: str | None = option(
        None, "the name clients use for the one served model (default: its own name)",
        metavar="NAME",
    )  # fmt: skip
    dtype: str = option("auto", "weights' dtype; auto: float32 on a CPU, bfloat16 on a GPU",
                        choices=DTYPES)  # fmt: skip
    quantization: str = option(
        "auto",
        "packed weights: auto (a quantized GGUF stays packed, int8 / int4, others in "
        "the dtype), int8 / int4 (every projection packed at load), none (dequantized)",
        choices=QUANTIZATIONS,
    )  # fmt: skip
    chat_template: str | None = option(
        None, "a Jinja chat template replacing the checkpoint's (default: the checkpoint's)",
        metavar="FILE",
    )  # fmt: skip
    generation_config: str = option(
        "auto",
        "sampling defaults for fields a request omits: auto (the checkpoint's generation "
        "config; smollm2-135m: temperature 0.2, top_p 0.9), openai (temperature 1) or a "
        "folder with a generation_config.json",
        metavar="auto|openai|DIR",
    )  # fmt: skip
    default_temperature: float | None = option(
        None, "temperature for requests that omit it, over the generation config (default: "
        "none)", kind=float,
    )  # fmt: skip
    default_top_p: float | None = option(
        None, "top_p for requests that omit it, over the generation config (default: none)",
        kind=float,
    )  # fmt: skip
    default_top_k: int | None = option(
        None, "top_k for requests that omit it, over the generation config (default: none)",
        kind=int,
    )  # fmt: skip
    default_repetition_penalty: float | None = option(
        None, "repetition_penalty for requests that omit it, over the generation config "
        "(default: none)", kind=float,
    )  # fmt: skip
    memory: str | None = option(
        None,
        "the shared pool budget (default 1GiB; with --group: the group's budget, or the "
        "device's default share when this process creates the group)",
    )  # fmt: skip
    group: str | None = option(
        None,
        "share the device budget with other processes of this group (a ledger in POSIX "
        "shared memory; default: $KVCACHED_IPC_NAME); see `jax-kvcached ctl`",
        metavar="NAME",
    )  # fmt: skip
    limit: list[str] = option(
        [], "a model's memory limit, e.g. llama=2GiB (repeatable; default: none, the budget)",
        metavar="NAME=BYTES", append=True,
    )  # fmt: skip
    guarantee: list[str] = option(
        [], "memory no other model may take from it (repeatable; default: none)",
        metavar="NAME=BYTES", append=True,
    )  # fmt: skip
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    backend: str = option("auto", "physical memory: cuda (driver VMM), host (Linux VM) or auto",
                          choices=("auto", "host", "cuda"))  # fmt: skip
    page_size: str | None = option(
        None, "physical page size (default: $KVCACHED_PAGE_SIZE_MB, else 2MiB)"
    )
    tensor_parallel: int = option(
        1,
        "split every model's heads and KV heads over N devices (default 1); --memory is then "
        "the budget of each device. On a CPU-only machine N host devices are created",
        metavar="N",
    )  # fmt: skip
    devices: str | None = option(
        None, "the JAX device indices to use (default: the first --tensor-parallel ones)",
        metavar="I,J,...",
    )  # fmt: skip
    nnodes: int = option(
        1, "serve one model across N processes (hosts) on jax.distributed: its mesh spans "
        "every process's devices; rank 0 serves HTTP and schedules (default 1)", metavar="N",
    )  # fmt: skip
    node_rank: int = option(0, "this process's rank (0 to nnodes - 1; default 0)", metavar="R")
    dist_init_addr: str | None = option(
        None, "rank 0's address for jax.distributed's coordinator (PORT) and the step "
        "channel (PORT+1), the same on every rank", metavar="HOST:PORT",
    )  # fmt: skip
    dist_timeout: float = option(
        120.0, "seconds a rank waits for the others at start before failing", metavar="SECONDS"
    )
    dist_secret_file: str | None = option(
        None, "a file (mode 600) holding the secret every rank shares, at least 16 bytes: "
        "the step channel admits only ranks that hold it (default: $KVCACHED_DIST_SECRET; "
        "one of the two is required with --nnodes > 1)", metavar="PATH",
    )  # fmt: skip
    max_queue: int = option(64, "waiting requests per model")
    idle_sleep: float | None = option(
        None,
        "put a model to sleep (weights and KV memory given back) after this long without "
        "requests; a request wakes it (default: never)",
        kind=float, metavar="SECONDS",
    )  # fmt: skip
    max_awake: int | None = option(
        None,
        "keep at most N models awake: waking one puts the least recently used idle one to "
        "sleep (default: all)",
        kind=int, metavar="N",
    )  # fmt: skip
    sleep_level: int = option(
        1,
        "1: a sleeping model's weights go to host memory; 2: they are dropped and read again "
        "from the checkpoint on wake (default 1)",
        choices=(1, 2),
    )  # fmt: skip
    preload_tokens: int = option(
        4096,
        "on wake, copy up to N tokens of the model's most-hit prefixes back from its host "
        "tier before its first request (default 4096; 0: off; needs a host tier)",
        metavar="N",
    )  # fmt: skip
    seed: int = option(0, "weights of the built-in presets")
    warmup: bool = option(
        True, "skip compiling every step shape before serving (shapes then compile on first use)"
    )
    compile_cache: str | None = option(
        None,
        "JAX's persistent compilation cache, so a second start is fast ('off' disables; "
        "default: $KVCACHED_COMPILE_CACHE or ~/.cache/jax-kvcached/xla)",
        metavar="DIR",
    )  # fmt: skip
    api_key: str | None = option(
        None, "required as 'Authorization: Bearer KEY' on /v1/* (default: $KVCACHED_API_KEY)"
    )
    api_key_file: str | None = option(None, "read the API key from this file (default: none)",
                                      metavar="FILE")  # fmt: skip
    tenant_keys_file: str | None = option(
        None, "API keys of named tenants, one 'TENANT KEY' a line: a tenant's requests share "
        "cached prefixes only with its own; the API key's callers are the default tenant "
        "(default: none)", metavar="FILE",
    )  # fmt: skip
    admin_key: str | None = option(
        None,
        "required on /admin/* (default: $KVCACHED_ADMIN_KEY); without one the admin routes "
        "are disabled",
    )  # fmt: skip
    admin_key_file: str | None = option(
        None, "read the admin key from this file (keys on the command line are visible to "
        "other users in the process list; default: none)", metavar="FILE",
    )  # fmt: skip
    allow_unauthenticated_admin: bool = option(
        False, "serve /admin/* without a key: only with a loopback --host (127.0.0.1, ::1)"
    )
    shutdown_timeout: float = option(
        10.0, "seconds in-flight requests get after SIGTERM/SIGINT before they are cancelled"
    )
    log_level: str = option("info", "the server's log level",
                            choices=("debug", "info", "warning", "error"))  # fmt: skip
    access_log: bool = option(
        True,
        "no per-request log line (default: one INFO line a request: method, route, model, "
        "status, tokens, latency)",
    )  # fmt: skip
    allowed_origins: str | None = option(
        None,
        "browser origins allowed by CORS, comma-separated, or * (default: none, CORS off)",
        metavar="ORIGIN,...",
    )  # fmt: skip
    allowed_hosts: str | None = option(
        None, "host names the Host header may name, comma-separated, or * (default: with a "
        "loopback --host, localhost, 127.0.0.1 and ::1, against DNS rebinding; else any)",
        metavar="HOST,...",
    )  # fmt: skip
    enable_auto_tool_choice: bool = option(
        False, "serve tool_choice 'auto': the model decides whether to call a tool, and "
        "--tool-call-parser reads the calls from its text (default: off; such requests "
        "get a 400)",
    )  # fmt: skip
    tool_call_parser: str | None = option(
        None, "how the models write tool calls: hermes (<tool_call> JSON blocks: Hermes, "
        "Qwen 2.5 / 3), llama3_json (a JSON call as the whole output) or mistral "
        "([TOOL_CALLS] and a JSON array of calls)",
        choices=TOOL_PARSERS,
    )  # fmt: skip
    reasoning_parser: str | None = option(
        None, "split a thinking model's <think> ... </think> out of the content into "
        "reasoning_content: deepseek_r1 or qwen3 (default: off); a request's structured "
        "output then holds only the answer after </think>", choices=REASONING_PARSERS,
    )  # fmt: skip
    structured_outputs_in_reasoning: bool = option(
        False, "hold the thought to a request's structured output too (vLLM's "
        "enable_in_reasoning; default: off, only the answer after </think>)",
    )  # fmt: skip
    enable_lora: bool = option(
        False, "serve LoRA adapters: a request's model may name one; "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter (admin key) change them "
        "(default: off)",
    )  # fmt: skip
    lora_modules: list[str] = option(
        [], "adapters loaded at start: NAME=PATH (a PEFT folder) or JSON {\"name\", "
        "\"path\", \"base_model_name\"}; several after one flag, or the flag again",
        metavar="SPEC", many=True,
    )  # fmt: skip
    max_body_bytes: int = option(1 << 20, "the largest request body", cli=False)
    max_connections: int = option(
        1024, "concurrent connections and requests the server takes; past them it answers "
        "503 (default 1024)", metavar="N",
    )  # fmt: skip
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules", "needs --enable-lora")
        if self.engine.max_loras and not self.enable_lora:
            raise ConfigError("max_loras", "needs --enable-lora")
        if self.enable_lora and not self.engine.max_loras:  # (vLLM's default: 1)
            object.__setattr__(self, "engine", self.engine.replace(max_loras=1))
        if self.enable_lora and self.nnodes > 1:
            raise ConfigError("enable_lora", "is not served across hosts (--nnodes > 1) yet")
        if self.enable_lora and self.tensor_parallel > 1:
            raise ConfigError("enable_lora", "is not served with --tensor-parallel > 1 yet")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice", "needs --tool-call-parser")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ConfigError("tool_call_parser", f"must be one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError("reasoning_parser",
                              f"must be one of {', '.join(REASONING_PARSERS)}")  # fmt: skip
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", f"must be one of {', '.join(QUANTIZATIONS)}, "
                              f"got {self.quantization!r}")  # fmt: skip
        if self.max_queue < 0:
            raise ConfigError("max_queue", f"must be >= 0, got {self.max_queue}")
        if self.max_connections < 1:
            raise ConfigError("max_connections", f"must be >= 1, got {self.max_connections}")
        if not self.shutdown_timeout >= 0:
            raise ConfigError("shutdown_timeout", f"must be >= 0, got {self.shutdown_timeout}")
        if self.tensor_parallel < 1:
            raise ConfigError("tensor_parallel", f"must be >= 1, got {self.tensor_parallel}")
        if self.idle_sleep is not None and not self.idle_sleep > 0:
            raise ConfigError("idle_sleep", f"must be > 0 seconds, got {self.idle_sleep}")
        if self.max_awake is not None and self.max_awake < 1:
            raise ConfigError("max_awake", f"must be >= 1, got {self.max_awake}")
        if self.sleep_level not in (1, 2):
            raise ConfigError("sleep_level", f"must be 1 or 2, got {self.sleep_level!r}")
        if self.preload_tokens < 0:
            raise ConfigError("preload_tokens", f"must be >= 0, got {self.preload_tokens}")
        if not 0 <= self.port < 65536:
            raise ConfigError("port", f"must be in [0, 65536), got {self.port}")
        gc = self.generation_config
        if gc not in ("auto", "openai") and not os.path.isdir(gc):
            raise ConfigError("generation_config", f"must be auto, openai or a folder, got {gc!r}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError("chat_template", f"{self.chat_template}: no such file")
        self._check_distributed()
        if self.engine.kv_events and len(self.model_sources) > 1:
            raise ConfigError("kv_events", "publishes one model's blocks: serve one model "
                              f"a replica behind a router ({len(self.models)} given)")

    def _check_distributed(self) -> None:
        if self.nnodes < 1:
            raise ConfigError("nnodes", f"must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("node_rank", f"must be in [0, {self.nnodes}) (--nnodes "
                              f"{self.nnodes}), got {self.node_rank}")  # fmt: skip
        if self.nnodes == 1:
            return
        addr = self.dist_init_addr
        host, _, port = (addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ConfigError("dist_init_addr", f"must be HOST:PORT (PORT < 65535: PORT+1 "
                              f"carries the steps), got {addr!r}")  # fmt: skip
        if not self.dist_timeout > 0:
            raise ConfigError("dist_timeout", f"must be > 0, got {self.dist_timeout}")
        self.dist_secret()  # (checked here: a missing secret fails before JAX starts)
        if len(self.model_sources) > 1:
            raise ConfigError("nnodes", "serves one model across hosts (several given)")
        if self.idle_sleep is not None:
            raise ConfigError("idle_sleep", "is not supported across hosts (--nnodes > 1)")

    def flags(self) -> list[str]:
        """The ``serve`` command line of this config: its flags, then its engine's."""
        return to_cli_args(self, skip=("engine",)) + to_cli_args(self.engine)

    @property
    def model_sources(self) -> list[str]:
        """The ``--model`` values (default: the packaged SmolLM2)."""
        return list(self.models) or ["smollm2-135m"]

    @property
    def default_sampling(self) -> dict[str, float | None]:
        """The operator's ``--default-*`` sampling fields."""
        return {
            "temperature": self.default_temperature, "top_p": self.default_top_p,
            "top_k": self.default_top_k, "repetition_penalty": self.default_repetition_penalty,
        }  # fmt: skip

    @property
    def origins(self) -> list[str] | None:
        """The CORS origins (None: CORS off)."""
        if not self.allowed_origins:
            return None
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]

    @property
    def hosts(self) -> list[str] | None:
        """``--allowed-hosts`` as a list (None: any host)."""
        if self.allowed_hosts:
            hosts = [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
            return None if "*" in hosts else hosts
        return list(_LOOPBACK) if self.host in _LOOPBACK else None

    def dist_secret(self) -> bytes:
        """The step channel's shared secret (``step_channel.load_secret``): the file,
        else the environment; a ConfigError naming the flag when it is missing, weak or
        others may read it."""
        from jax_kvcached.serve.step_channel import load_secret

        try:
            return load_secret(self.dist_secret_file)
        except ValueError as e:
            raise ConfigError("dist_secret_file", f": {e}") from None

    def auth(self) -> Any:
        """The server's keys (``serve.auth.AuthConfig``): flags first, then the key file,
        then the environment."""
        from jax_kvcached.serve.auth import AuthConfig

        api_key = _key(self.api_key, self.api_key_file, "api_key", "KVCACHED_API_KEY")
        admin_key = _key(self.admin_key, self.admin_key_file, "admin_key", "KVCACHED_ADMIN_KEY")
        if self.allow_unauthenticated_admin and admin_key is None and self.host not in _LOOPBACK:
            raise ConfigError("allow_unauthenticated_admin", f"only with a loopback --host "
                              f"(127.0.0.1 or ::1), got {self.host!r}: set --admin-key-file "
                              "instead")  # fmt: skip
        tenants = _tenant_keys(self.tenant_keys_file) if self.tenant_keys_file else ()
        if api_key is not None and any(t.key == api_key for t in tenants):
            raise ConfigError("tenant_keys_file", "holds the --api-key too (a key names "
                              "one tenant)")  # fmt: skip
        return AuthConfig(api_key, admin_key, self.allow_unauthenticated_admin, tenants)


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _tenant_keys(path: str) -> tuple[Any, ...]:
    """``TenantKey`` s from a file of 'TENANT KEY' lines ('#' starts a comment); a
    ConfigError names the line that is not one."""
    from jax_kvcached.serve.auth import TenantKey

    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("tenant_keys_file", f"{path}: {e}") from None
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        bad = (len(parts) != 2 or not _TENANT.fullmatch(parts[0])
               or not parts[1].isprintable())  # fmt: skip
        if bad or parts[1] in seen:
            why = "a key given twice" if not bad else (
                "not 'TENANT KEY' (a tenant is 1-64 of A-Z a-z 0-9 . _ -)")
            raise ConfigError("tenant_keys_file", f"{path}:{n}: {why}")
        seen.add(parts[1])
        out.append(TenantKey(*parts))
    if not out:
        raise ConfigError("tenant_keys_file", f"{path} holds no 'TENANT KEY' line")
    return tuple(out)


def _key(given: str | None, path: str | None, field: str, env: str) -> str | None:
    """A key from its flag, else its file, else the environment (None: no key). An empty
    key (which a bare ``Authorization: Bearer`` would match) or one with spaces is a
    ConfigError naming the flag."""
    key, where = given, field
    if key is None and path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(field + "_file", f"{path}: {e.strerror}") from None
        where = field + "_file"
    if key is None:
        key, where = os.environ.get(env), env
        if key is None:
            return None
    if not key.strip():
        raise ConfigError(field, f"is empty (from {where}): a bare 'Authorization: Bearer' "
                          "would pass; give a key or none")  # fmt: skip
    if not key.isprintable() or " " in key:
        raise ConfigError(field, "must be printable and contain no spaces")
    return key
