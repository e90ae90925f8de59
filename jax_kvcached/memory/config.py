"""KVCACHED_* environment variables, parsed and validated in one place."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, what: str = "size", *, allow_zero: bool = False) -> int:
    """Parses a byte count: an int, or a string such as ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value >= 2.0**63:
            raise ValueError(f"{what} must be a finite number of bytes below 2**63, got {value!r}")
        if not value.is_integer():
            raise ValueError(f"{what} must be a whole number of bytes, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        if value.strip().startswith("-"):
            raise ValueError(f"{what} must not be negative, got {value.strip()!r}")
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{what}: cannot parse {value!r} (examples: 8GiB, 512MiB, 1.5GB, 4096)"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"{what} must be a number of bytes or a string like '8GiB', got {value!r}")
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")
    if n >= 1 << 63:
        raise ValueError(f"{what} must be below 2**63 bytes, got {value!r}")
    return n


def _env_number(env: Mapping[str, str], name: str, default, kind, lo=None, hi=None):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name}={raw!r} must be in [{lo}, {hi}]")
    return value


def _env_bytes(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return parse_bytes(raw, name, allow_zero=True)


def ipc_name_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """``KVCACHED_IPC_NAME``: the process group to join (None: unset or blank)."""
    env = os.environ if env is None else env
    return (env.get("KVCACHED_IPC_NAME") or "").strip() or None


def host_cache_blocks(
    tokens: int | None, nbytes: int | None, block_size: int, block_bytes: int
) -> int:
    """Blocks a host tier bounded by ``tokens`` and / or ``nbytes`` holds (``block_bytes``:
    one block's host bytes). 0 (off) when neither is set or either is 0."""
    for value, what in ((tokens, "host cache tokens"), (nbytes, "host cache bytes")):
        if value is not None and (isinstance(value, bool) or value < 0):
            raise ValueError(f"{what} must be >= 0 (0: off), got {value!r}")
    bounds = []
    if tokens is not None:
        bounds.append(tokens // block_size)
    if nbytes is not None:
        bounds.append(nbytes // block_bytes)
    return min(bounds) if bounds else 0


@dataclass(frozen=True)
class Config:
    """Library settings; :meth:`from_env` reads them from ``KVCACHED_*`` variables."""

    page_size: int = 2 << 20
    gpu_utilization: float = 0.95
    host_memory_fraction: float = 0.5
    min_reserved_pages: int = 5
    max_reserved_pages: int = 10
    max_cached_tokens: int = 16000
    # The host tier of the prefix cache, per engine (None: unset; 0: off). It is on when
    # a bound is set and positive; with both set it holds the smaller.
    host_cache_tokens: int | None = None
    host_cache_bytes: int | None = None
    # The process group whose shared ledger a pool joins (None: this process alone), and
    # how long a member waits for other processes to give memory back.
    ipc_name: str | None = None
    ipc_reclaim_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.min_reserved_pages > self.max_reserved_pages:
            raise ValueError(
                f"KVCACHED_MIN_RESERVED_PAGES ({self.min_reserved_pages}) exceeds "
                f"KVCACHED_MAX_RESERVED_PAGES ({self.max_reserved_pages})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        env = os.environ if env is None else env
        page_mb = _env_number(env, "KVCACHED_PAGE_SIZE_MB", 2.0, float, lo=0.0625)
        page_size = int(page_mb * (1 << 20))
        if page_size % 4096:
            raise ValueError(f"KVCACHED_PAGE_SIZE_MB={page_mb} is not a multiple of 4 KiB")
        return cls(
            page_size=page_size,
            gpu_utilization=_env_number(env, "KVCACHED_GPU_UTILIZATION", 0.95, float, 0.01, 1.0),
            host_memory_fraction=_env_number(
                env, "KVCACHED_HOST_MEMORY_FRACTION", 0.5, float, 0.01, 1.0
            ),
            min_reserved_pages=_env_number(env, "KVCACHED_MIN_RESERVED_PAGES", 5, int, lo=0),
            max_reserved_pages=_env_number(env, "KVCACHED_MAX_RESERVED_PAGES", 10, int, lo=0),
            max_cached_tokens=_env_number(env, "KVCACHED_MAX_CACHED_TOKENS", 16000, int, lo=-1),
            host_cache_tokens=_env_number(env, "KVCACHED_HOST_CACHE_TOKENS", None, int, lo=0),
            host_cache_bytes=_env_bytes(env, "KVCACHED_HOST_CACHE_BYTES"),
            ipc_name=ipc_name_from_env(env),
            ipc_reclaim_wait_s=_env_number(
                env, "KVCACHED_IPC_RECLAIM_WAIT_S", 1.0, float, 0.0, 600.0
            ),
        )
