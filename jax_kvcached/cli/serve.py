"""``jax-kvcached serve``: the OpenAI-compatible server. Its flags are generated from
:class:`~jax_kvcached.serve.config.ServeConfig` and the command-line fields of
:class:`~jax_kvcached.engine.config.EngineConfig` (one definition, one validation)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from jax_kvcached.cli.common import fail, usage_error
from jax_kvcached.engine.config import ConfigError, EngineConfig, add_cli_args, flag_of
from jax_kvcached.engine.config import from_cli_args as config_from
from jax_kvcached.serve.config import ServeConfig


def add(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    s = command("serve", "OpenAI-compatible server for several models on one pool")
    add_cli_args(s, ServeConfig)
    add_cli_args(s, EngineConfig)


def from_cli_args(args: argparse.Namespace) -> ServeConfig:
    """The server's config of parsed flags (ConfigError on a broken rule)."""
    return config_from(ServeConfig, args, engine=config_from(EngineConfig, args))


def config_error(err: ConfigError) -> str:
    """A rule broken, in the command line's words (the flag, not the field)."""
    for cls in (ServeConfig, EngineConfig):
        try:
            flag = flag_of(cls, err.field)
        except KeyError:
            continue
        return flag + ("" if err.reason.startswith(":") else " ") + err.reason
    return str(err)


def run(args: argparse.Namespace) -> int:
    from jax_kvcached.serve.launch import serve

    try:
        config = from_cli_args(args)
    except ConfigError as e:
        return usage_error(config_error(e))
    except ValueError as e:
        return fail(e)
    if config.tensor_parallel > 1:
        # CPU devices for tensor parallelism without a GPU (no effect on GPUs); must be
        # set before JAX starts.
        flag = f"--xla_force_host_platform_device_count={config.tensor_parallel}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    try:
        serve(config)
    except ConfigError as e:
        return usage_error(config_error(e))
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:  # a bad model, size...
        return fail(e)
    return 0
