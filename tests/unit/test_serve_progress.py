"""`flashmoe serve`'s progress line: nothing before the first request, and a model computed
without a bad expert is said on the console, not only in /health."""

from flashmoe.runtime.serve import progress_line

STATS = {"requests": 3, "tokens_generated": 40, "hit_rate": 0.5, "estimate": "ready",
         "estimates_used": 7}


def test_nothing_before_the_first_request():
    assert progress_line({"requests": 0}) is None


def test_a_whole_model_is_not_called_degraded():
    line = progress_line({**STATS, "experts_routed_around": 0})
    assert line.startswith("3 requests, 40 tokens generated") and "DEGRADED" not in line


def test_experts_routed_around_are_said():
    line = progress_line({**STATS, "experts_routed_around": 2})
    assert "DEGRADED: 2 expert(s)" in line and "flashmoe verify" in line
