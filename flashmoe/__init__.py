"""FlashMoE's app layer: the CLI, the launcher, the benchmarks and the trace simulator."""

import os

__version__ = "0.1.0"

# Every FlashMoE process does small matrix work beside other busy processes on a small box;
# BLAS thread pools that spin-wait for work slow that down by an order of magnitude. Set before
# numpy is first imported (every FlashMoE process imports this package first); a user's
# setting wins.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
