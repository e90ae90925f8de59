"""EngineConfig: one engine's settings, each rule validated once, and the CLI made from them.

vLLM's ``engine/arg_utils.py`` is the model: a dataclass whose fields carry their help,
flag and choices (:func:`option`); :func:`add_cli_args` turns any such dataclass into
argparse flags, :func:`from_cli_args` back into the dataclass and :func:`to_cli_args`
a config into its flags, so the library, the server, the command line and the scripts
that start servers share one definition and one validation. A rule broken
raises :class:`ConfigError` naming the field (the CLI names the flag instead).

This module imports neither JAX nor Flax (``jax-kvcached top`` and ``ctl`` start
without them).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from typing import Any, ClassVar

from jax_kvcached.memory.config import Config, parse_bytes

ATTENTION_IMPLS = ("auto", "host", "xla", "pallas", "pallas-interpret")
EVICTION_POLICIES = ("lru", "lfu")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class ConfigError(ValueError):
    """A setting that breaks a rule: ``field`` is the dataclass field, ``reason`` the
    rest of the message."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field + ("" if reason.startswith(":") else " ") + reason)
        self.field = field
        self.reason = reason


def option(
    default: Any,
    help: str,
    *,
    cli: bool = True,
    flag: str | None = None,
    kind: Any = None,
    choices: Any = None,
    metavar: str | None = None,
    append: bool = False,
    many: bool = False,
) -> Any:
    """A dataclass field with its command-line form: ``flag`` (default ``--field-name``;
    a bool field is a switch: ``--no-x`` when it defaults to True), ``kind`` (the
    argument's type, default the default's), ``choices``, ``metavar``, ``append`` (a
    repeatable flag collecting a list; ``many``: each taking one or more values);
    ``cli=False``: library only."""
    md = {"help": help, "cli": cli, "flag": flag, "kind": kind, "choices": choices,
          "metavar": metavar, "append": append or many, "many": many}  # fmt: skip
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=md)
    return dataclasses.field(default=default, metadata=md)


def flag_of(cls: Any, name: str) -> str:
    """The command-line flag of a field of a config dataclass."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.metadata.get("flag"):
                return f.metadata["flag"]
            if f.default is True:
                return "--no-" + name.replace("_", "-")
            return "--" + name.replace("_", "-")
    raise KeyError(name)


def add_cli_args(parser: argparse.ArgumentParser, cls: Any) -> None:
    """Adds a flag for every command-line field of config dataclass ``cls``, in the
    help sections its ``CLI_SECTIONS`` name (title -> field names; every command-line
    field is in one)."""
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]
    group_of: dict[str, Any] = {}  # field -> its section's argument group (else the parser)
    for title, names in getattr(cls, "CLI_SECTIONS", {}).items():
        section = parser.add_argument_group(title)
        group_of.update(dict.fromkeys(names, section))
    if group_of and (missing := [f.name for f in fields if f.name not in group_of]):
        raise AssertionError(f"{cls.__name__}.CLI_SECTIONS misses {missing}")
    for f in fields:
        md = f.metadata
        group = group_of.get(f.name, parser)
        flag = flag_of(cls, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, bool):
            action = "store_false" if default else "store_true"
            # The help says what the flag does; the flag is never on unless given
            # (argparse would show a --no-X flag's default as True: "X is off").
            said = "" if "default" in md["help"] else " (off unless given)"
            group.add_argument(flag, dest=f.name, action=action, help=md["help"] + said,
                               default=argparse.SUPPRESS)  # fmt: skip
            continue
        kw: dict[str, Any] = {"dest": f.name, "help": md["help"], "default": default}
        if md.get("append"):
            kw.update(action="append", default=None if default == [] else default)
        if md.get("many"):
            kw.update(action="extend", nargs="+")
        kind = md.get("kind") or (type(default) if default not in (None, []) else str)
        if kind is not str:
            kw["type"] = kind
        for key in ("choices", "metavar"):
            if md.get(key) is not None:
                kw[key] = md[key]
        group.add_argument(flag, **kw)


def from_cli_args(cls: Any, args: argparse.Namespace, **extra: Any) -> Any:
    """The config dataclass ``cls`` of parsed flags (and ``extra`` fields)."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") and hasattr(args, f.name):
            value = getattr(args, f.name)
            if f.metadata.get("append") and value is None:
                value = []
            kw[f.name] = value
    return cls(**kw, **extra)


def to_cli_args(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that give config dataclass ``config`` (its command-line fields that
    differ from their defaults): :func:`from_cli_args` of them is ``config`` again, so
    scripts that start a server build its command line from a checked config. A
    library-only field set (not in ``skip``) has no flag: ValueError naming it."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(config, f.name)
        if value == default or f.name in skip:
            continue
        if not f.metadata.get("cli"):
            raise ValueError(f"{type(config).__name__}.{f.name} has no command-line flag "
                             f"(set to {value!r})")  # fmt: skip
        flag = flag_of(type(config), f.name)
        if isinstance(default, bool):
            out.append(flag)
        elif value is None:
            raise ValueError(f"{flag} has no form for None (its default is {default!r})")
        elif f.metadata.get("append"):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise ConfigError(name, f"must be positive, got {value!r}")


def check_budgets(max_batch: int, budget: int | None, prefill: int | None) -> None:
    """The step budgets' rule: ``max_batch <= max_num_batched_tokens <=
    max_prefill_tokens`` (every running sequence decodes one token in each step; a step
    without decode rows may take more). None: not given (a default follows it)."""
    if budget is not None and budget < max_batch:
        raise ConfigError(
            "max_num_batched_tokens",
            f"({budget}) must be at least max_batch ({max_batch}): every running sequence "
            "decodes one token in each step",
        )
    if prefill is not None and prefill < (budget or 1):
        raise ConfigError(
            "max_prefill_tokens",
            f"({prefill}) must be at least max_num_batched_tokens ({budget})",
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """One engine's settings (``Engine(model, pool, config)``, or the same fields as
    keywords). Validated when made."""

    # ``serve --help``'s sections of the engine's flags (every command-line field).
    CLI_SECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {
        "engine: scheduling": ("max_batch", "max_num_batched_tokens", "max_prefill_tokens",
                               "stall_ratio", "max_model_len"),
        "engine: prefix cache": ("max_cached_tokens", "eviction", "host_cache_tokens",
                                 "host_cache_bytes", "state_checkpoint_tokens"),
        "engine: KV-cache events": ("kv_events", "kv_events_replay", "kv_events_topic",
                                    "kv_events_token_ids", "kv_events_curve_dir"),
        "engine: LoRA adapters": ("max_loras", "max_lora_rank", "max_cpu_loras"),
    }  # fmt: skip

    name: str = option("model", "the KV cache's name in the pool", cli=False)
    max_batch: int = option(8, "requests run at once per model")
    max_num_batched_tokens: int | None = option(
        None,
        "new tokens of a step per model while requests decode: every running decode first, "
        "then chunks of waiting prompts; a fixed budget, at least the batch size (default: "
        "on a CPU 64, each step's prompt chunk paced by the stall ratio; 2048 on a GPU)",
        kind=int, metavar="N",
    )  # fmt: skip
    max_prefill_tokens: int | None = option(
        None,
        "new tokens in a step when no request decodes (default: 256 on a CPU, the step "
        "budget on a GPU or when that budget is given)",
        kind=int, metavar="N",
    )  # fmt: skip
    stall_ratio: float = option(
        2.5,
        "on a CPU without a fixed step budget: a step that carries decode rows and a prompt "
        "chunk takes about this many times a decode-only step (the chunk is sized from "
        "measured step times), so streams slow by about that while prompts prefill "
        "(default: 2.5)",
        kind=float, metavar="X",
    )  # fmt: skip
    max_model_len: int | None = option(
        None, "prompt + output tokens per request (default: the model's max positions)",
        kind=int, metavar="N",
    )  # fmt: skip
    kv_dtype: Any = option(None, "the KV cache's dtype (default: the model's)", cli=False)
    block_size: int = option(16, "tokens per KV block", cli=False)
    prefix_caching: bool = option(True, "reuse the KV of cached prompt prefixes", cli=False)
    max_cached_tokens: int | None = option(
        None,
        "idle tokens the prefix cache keeps per model (default: $KVCACHED_MAX_CACHED_TOKENS, "
        "else 16000; -1 unlimited, 0 off)",
        kind=int, metavar="N",
    )  # fmt: skip
    eviction: Any = option(
        "lru", "which idle cached prefix goes first: least recently or least frequently used",
        choices=EVICTION_POLICIES,
    )  # fmt: skip
    host_cache_tokens: int | None = option(
        None,
        "per model, a host-memory tier of N tokens for evicted prefix blocks: restored "
        "instead of recomputed (default: $KVCACHED_HOST_CACHE_TOKENS; unset or 0: off)",
        kind=int, metavar="N",
    )  # fmt: skip
    host_cache_bytes: int | str | None = option(
        None,
        "the host tier's bound in bytes per model, e.g. 4GiB (default: "
        "$KVCACHED_HOST_CACHE_BYTES; with --host-cache-tokens the smaller holds; 0: off)",
        metavar="SIZE",
    )  # fmt: skip
    log_every: int = option(200, "steps between INFO logs of the prefix-cache figures",
                            cli=False)  # fmt: skip
    memory_limit: int | str | None = option(None, "this tenant's memory limit", cli=False)
    memory_guarantee: int | str = option(0, "memory no other tenant may take", cli=False)
    attention: str = option("auto", "auto, host, xla, pallas or pallas-interpret", cli=False)
    overlap: bool = option(True, "prepare step n+1 while step n runs", cli=False)
    free_window_blocks: bool = option(
        True, "sliding-window layers give back the blocks below their window", cli=False
    )
    state_checkpoint_tokens: int = option(
        512, "tokens between a recurrent model's cached state checkpoints in a prompt "
        "(besides one at its end)", metavar="N",
    )  # fmt: skip
    kv_events: str | None = option(
        None,
        "publish KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, "
        "msgpack) on a ZMQ PUB socket at ENDPOINT, e.g. tcp://*:5557 (needs pyzmq)",
        metavar="ENDPOINT",
    )  # fmt: skip
    kv_events_replay: str | None = option(
        None, "the KV events' replay socket (ZMQ ROUTER), e.g. tcp://*:5558", metavar="ENDPOINT"
    )
    kv_events_topic: str = option("", "the KV events' topic frame", metavar="TOPIC")
    kv_events_token_ids: bool = option(
        True, "publish BlockStored events without their token ids, hashes only (default: "
        "with them, as vLLM does: any subscriber reads the prompts)",
    )  # fmt: skip
    kv_events_curve_dir: str | None = option(
        None, "encrypt the KV events and admit only known subscribers (ZMQ CURVE): DIR "
        "holds server.key_secret and clients/*.key (zmq.auth.create_certificates); "
        "bound endpoints only (default: none, unauthenticated)", metavar="DIR",
    )  # fmt: skip
    max_loras: int = option(
        0, "LoRA adapters held on the device at once, each in a slot of the step's stacks "
        "(default 0: no adapters; serve --enable-lora makes it 1 unless given)", metavar="N",
    )  # fmt: skip
    max_lora_rank: int = option(16, "the highest LoRA rank an adapter may have (default 16)",
                                metavar="R")  # fmt: skip
    max_cpu_loras: int | None = option(
        None, "adapters whose weights stay in host memory; the others are read from their "
        "folder again when a request needs them (default: all)", kind=int, metavar="N",
    )  # fmt: skip
    command_buffers: bool | None = option(None, "CUDA graphs (None: on on CUDA)", cli=False)
    fuse_sampling: bool | None = option(None, "sample inside decode steps (None: on CUDA)",
                                        cli=False)  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or self.max_batch <= 0:
            raise ConfigError("max_batch", f"must be positive, got {self.max_batch!r}")
        for name in ("max_num_batched_tokens", "max_prefill_tokens", "block_size", "log_every",
                     "state_checkpoint_tokens", "max_lora_rank"):  # fmt: skip
            _positive(name, getattr(self, name))
        check_budgets(self.max_batch, self.max_num_batched_tokens, self.max_prefill_tokens)
        if isinstance(self.stall_ratio, bool) or not (
            isinstance(self.stall_ratio, (int, float)) and 1 < self.stall_ratio < float("inf")
        ):
            raise ConfigError("stall_ratio", f"must be a number above 1, got {self.stall_ratio!r}")
        if isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ConfigError("max_loras", f"must be >= 0 (0: no adapters), got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < max(1, self.max_loras):
            raise ConfigError("max_cpu_loras", f"must be at least --max-loras "
                              f"({max(1, self.max_loras)}), got {self.max_cpu_loras}")  # fmt: skip
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.max_cached_tokens is not None and self.max_cached_tokens < -1:
            raise ConfigError(
                "max_cached_tokens", f"must be >= -1 (-1: unlimited), got {self.max_cached_tokens}"
            )
        if self.host_cache_tokens is not None and self.host_cache_tokens < 0:
            raise ConfigError(
                "host_cache_tokens", f"must be >= 0 (0: off), got {self.host_cache_tokens}"
            )
        if self.host_cache_bytes is not None:
            try:
                nbytes = parse_bytes(self.host_cache_bytes, "host_cache_bytes", allow_zero=True)
            except ValueError as e:  # (the reason after the name)
                raise ConfigError("host_cache_bytes", str(e)[len("host_cache_bytes") :].lstrip(
                    " ")) from None  # fmt: skip
            object.__setattr__(self, "host_cache_bytes", nbytes)
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError("attention", f"must be one of {ATTENTION_IMPLS}, got "
                              f"{self.attention!r}")  # fmt: skip
        for name in ("kv_events", "kv_events_replay"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v.startswith(_ZMQ_SCHEMES)
                                      and v.partition("://")[2]):
                raise ConfigError(name, f"must be a ZMQ endpoint ({', '.join(_ZMQ_SCHEMES)}"
                                  f"...), got {v!r}")  # fmt: skip
        if self.kv_events_curve_dir is not None and self.kv_events is None:
            raise ConfigError("kv_events_curve_dir", "needs kv_events (the stream it secures)")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError("kv_events_replay", "needs kv_events (the stream it replays)")
        if self.kv_events is not None and importlib.util.find_spec("zmq") is None:
            raise ConfigError("kv_events", "needs pyzmq: pip install 'jax-kvcached[events]'")
        if isinstance(self.eviction, str) and self.eviction not in EVICTION_POLICIES:
            raise ConfigError("eviction", f"must be one of {EVICTION_POLICIES} or an "
                              f"EvictionPolicy, got {self.eviction!r}")  # fmt: skip

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_defaults(self, env: Config) -> EngineConfig:
        """This config with the fields it leaves to the environment filled from ``env``
        (the pool's ``KVCACHED_*`` settings: the prefix cache's bound and its host
        tier), so the engine and everything it builds read one resolved config."""
        fills = {"max_cached_tokens": env.max_cached_tokens,
                 "host_cache_tokens": env.host_cache_tokens,
                 "host_cache_bytes": env.host_cache_bytes}  # fmt: skip
        return self.replace(**{k: v for k, v in fills.items() if getattr(self, k) is None})
