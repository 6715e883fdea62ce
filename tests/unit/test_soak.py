"""`flashmoe soak`'s arithmetic: growth per hour from the samples after the settling time."""

from flashmoe.bench.soak import format_table, growth, per_hour


def sample(minute, rss, fds=10, rows=100):
    return {"minute": minute, "services": {"worker": {"rss_bytes": rss, "fds": fds,
                                                      "threads": 4}},
            "tables": {"feature_extractor.token_rows": rows}, "shm_bytes": 4096, "restarts": 0}


def test_growth_is_the_slope_per_hour_after_settling():
    # 1 MiB a minute, after a start-up jump the settling time leaves out
    samples = [sample(0, 500 << 20)] + [sample(m, (100 + m) << 20, rows=100 + 2 * m)
                                        for m in range(3, 11)]
    assert abs(per_hour(samples, lambda s: s["services"]["worker"]["rss_bytes"], 3)
               - 60 * 2**20) < 1
    rows = {row["what"]: row for row in growth(samples, 3)}
    assert abs(rows["worker"]["fds_per_hour"]) < 1e-9 and rows["worker"]["rss_bytes_last"] == 110 << 20
    assert abs(rows["feature_extractor.token_rows"]["per_hour"] - 120) < 1e-6
    assert abs(rows["shm"]["bytes_per_hour"]) < 1e-6


def test_too_few_samples_give_no_growth_and_the_table_says_so():
    samples = [sample(0, 1 << 20), sample(1, 2 << 20)]
    assert per_hour(samples, lambda s: s["shm_bytes"], 0) is None
    report = {"target": "run", "minutes": 1, "interval_s": 60, "settle_min": 0, "restarts": 0,
              "growth": growth(samples, 0)}
    assert " - " in format_table(report)
