"""What document search (gateway.documents.embed) and session memory (memory.service) share about the
embedding model: its error type and the one-thread BLAS limit both set before their similarity products.
Memory receives an embedder object and catches :class:`EmbedError` from it without importing the gateway.
"""

from __future__ import annotations

import functools

__all__ = ["EmbedError", "single_threaded_blas"]


@functools.lru_cache(maxsize=1)
def single_threaded_blas() -> bool:
    """Limit numpy's BLAS to one thread in this process (once). Its threaded matrix-vector product waits for a
    second core that the lanes and the event loop hold: 12 ms for a session's 10,000 x 384 vectors at load 9
    on the 2-core VM, 1.0 ms on one thread. False when threadpoolctl is missing (then nothing changes)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    threadpool_limits(1, user_api="blas")
    return True


class EmbedError(RuntimeError):
    """The embedding model is missing or unusable."""
