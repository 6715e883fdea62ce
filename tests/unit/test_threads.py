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
