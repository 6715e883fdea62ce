"""CPU threads of the learning path.

The feature extractor and the predictor work on small arrays a token at a time (a 256 x 256
covariance, an LSTM step over 768 experts). Run multi-threaded, OpenBLAS's and torch's worker
threads spin between those small operations: measured here, the extractor's CPU time per token
went from 0.48 ms single-threaded to 18.7 ms with two threads while another process shared the
two cores, and the learner's budget is 2.5 ms a token (5% of one core at 20 tokens/s), next to
an inference worker that needs the cores. So the learning path runs on one thread, and so does the cache manager's loop.
"""

from __future__ import annotations

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
