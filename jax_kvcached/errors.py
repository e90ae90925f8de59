"""Exceptions raised by jax_kvcached (the C++ core raises the same classes)."""

from jax_kvcached._C import BackendError, KVCacheError, PoolExhausted

__all__ = ["BackendError", "KVCacheError", "PoolExhausted"]
