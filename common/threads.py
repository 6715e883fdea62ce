"""CPU threads and heap of the learning path.

The feature extractor and the predictor work on small arrays a token at a time (a 256 x 256
covariance, an LSTM step over 768 experts). Run multi-threaded, OpenBLAS's and torch's worker
threads spin between those small operations: measured here, the extractor's CPU time per token
went from 0.48 ms single-threaded to 18.7 ms with two threads while another process shared the
two cores, and the learner's budget is 2.5 ms a token (5% of one core at 20 tokens/s), next to
an inference worker that needs the cores. So the learning path runs on one thread, and so does the cache manager's loop.

Its heap is kept too (``keep_heap``): a training step allocates and frees some 30 MB of
temporaries, which glibc by default maps afresh and hands back each time, so every step paid
~190 page faults (2.3 of its 21 ms here, more under memory pressure); with the freed memory kept
for the next step it pays none and takes 17 ms.
"""

from __future__ import annotations

import ctypes
import functools

LEARNING_THREADS = 1


def limit_threads(n: int = LEARNING_THREADS, torch_too: bool = True) -> None:
    """Limit this process's BLAS thread pools (and torch's, with ``torch_too``) to ``n``.
    The cache manager uses it too, without torch: a single-threaded event loop whose numpy
    products (the prefetcher's) are small."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(n)
    if torch_too:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks below it come from the heap
TRIM_THRESHOLD_BYTES = 256 << 20  # free memory at the heap's top kept up to this


@functools.cache  # once a process: a setting of its C library
def keep_heap() -> bool:
    """Keep freed memory in this process's heap for reuse instead of handing it back to the
    kernel (see the module's docstring). True where it took effect; False where the C library
    is not glibc (it has no mallopt), which changes only the speed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def prepare_learning_path() -> None:
    """What every process (or in-process replay) that runs the learning path sets first: one
    thread, and a heap that keeps its freed memory."""
    limit_threads()
    keep_heap()
