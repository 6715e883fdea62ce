"""Property tests with hostile inputs (hypothesis).

Two profiles: ``ci`` (the default: a few hundred cases a test, what the suite can afford) and
``report`` (10,000 cases a test: ``HYPOTHESIS_PROFILE=report pytest tests/fuzz --timeout 0``;
10,000 completions take longer than the suite's 300 s a test). Neither has a deadline: these
machines are shared, and a slow case is not a failure.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("report", max_examples=10_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
