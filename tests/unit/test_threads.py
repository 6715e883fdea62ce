"""The learning path and the cache manager run their BLAS and torch pools on one thread
(common/threads.py); checked in a child process, so that this one keeps its pools."""

import subprocess
import sys

CHILD = """
import numpy, torch
from threadpoolctl import threadpool_info
from common.threads import limit_threads
limit_threads()
pools = [p["num_threads"] for p in threadpool_info()]
print(torch.get_num_threads(), max(pools) if pools else 1)
"""


def test_limit_threads_leaves_one_thread_in_every_pool():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out == ["1", "1"]


HEAP_CHILD = """
import resource, sys
import numpy as np
from common.threads import keep_heap
kept = keep_heap() if sys.argv[1] == "keep" else False
def step():  # three 8 MB temporaries alive together, then freed, as in a training step
    blocks = [np.ones(2 << 20, np.float32) for _ in range(3)]
    del blocks
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(int(kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_keep_heap_reuses_freed_memory_without_page_faults():
    """A training step's temporaries, made and freed again and again, fault no new pages once
    the heap keeps them; glibc's default trims the heap's free top and faults part of it in
    again every step (~1000 faults a step here)."""
    def faults(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", HEAP_CHILD, mode], capture_output=True,
                             text=True, check=True, timeout=120).stdout.split()
        return int(out[0]), int(out[1])

    kept, with_keep = faults("keep")
    if not kept:
        import pytest
        pytest.skip("not glibc: no mallopt")
    _, default = faults("default")
    assert default > 4 * 250  # the default really does map afresh
    assert with_keep < 200
