"""Exceptions raised by jax_kvcached (the C++ core raises the same classes)."""

from jax_kvcached.memory._C import BackendError, KVCacheError, PoolExhausted


class ContextLengthExceeded(ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context length."""


class LayoutError(KVCacheError, ValueError):
    """A KV cache shape the pool cannot lay out (a block larger than a page): a
    ValueError naming the parameters, and the KVCacheError the core raises for it."""


__all__ = ["BackendError", "ContextLengthExceeded", "KVCacheError", "LayoutError", "PoolExhausted"]
