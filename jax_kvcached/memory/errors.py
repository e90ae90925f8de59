"""Exceptions raised by jax_kvcached (the C++ core raises the same classes)."""

from jax_kvcached.memory._C import BackendError, KVCacheError, PoolExhausted


class ContextLengthExceeded(ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context length."""


__all__ = ["BackendError", "ContextLengthExceeded", "KVCacheError", "PoolExhausted"]
