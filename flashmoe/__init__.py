"""FlashMoE's app layer, by role (the services themselves are in ``services/``, what they share
in ``common/``):

  cli/      the `flashmoe` command: one module per group of commands, shared flags in options
  runtime/  the system as local processes: `flashmoe run`, the launcher, supervisor, doctor
  sim/      the trace simulator: the replay, the learning path in-process, the device model
  bench/    the benchmark programs, one module each, listed in ``bench.BENCHMARKS``
  tools/    stores and traces: convert, store writer, synthetic stores, tiny models, trace
            recording, text warm-up
  deploy/   `flashmoe deploy`: the compose file's services through the Docker SDK
  errors.py, reports.py: the user errors the CLI reports, the report files
"""

import os

__version__ = "0.1.0"

# Every FlashMoE process does small matrix work beside other busy processes on a small box;
# BLAS thread pools that spin-wait for work slow that down by an order of magnitude. Set before
# numpy is first imported (every FlashMoE process imports this package first); a user's
# setting wins.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
