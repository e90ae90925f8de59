"""What the runner picks by device backend: the attention implementation and the
options XLA compiles the step programs with (command buffers on CUDA)."""

from __future__ import annotations

import logging
import os

from jax_kvcached.engine.config import ATTENTION_IMPLS
from jax_kvcached.memory.kv_cache import KVCache

log = logging.getLogger("jax_kvcached.engine.runner")


def resolve_attention(impl: str, cache: KVCache) -> str:
    """Validates an attention choice for ``cache``; ``auto`` becomes the Pallas kernel for
    a CUDA cache and the host custom call for a host cache. The kernel's tiles span the
    head dim, which Triton wants a power of two: a CUDA cache of another width (MLA's 576
    latent) gets XLA's attention under ``auto``, and the log says so."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "auto":
        if cache.backend != "cuda":
            return "host"
        d = cache.head_dim
        if d & (d - 1):
            log.info("%s: head dim %d is not a power of two (Triton's tiles): XLA's attention "
                     "instead of the Pallas kernel", cache.name, d)  # fmt: skip
            return "xla"
        return "pallas"
    if impl == "host" and cache.backend != "host":
        raise ValueError("attention='host' needs a host-backend cache")
    return impl


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
